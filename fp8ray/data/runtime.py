"""Where a Ray Data UDF runs: the device it encodes or decodes on, and its CPU threads."""

from __future__ import annotations

import numpy as np
import ray

from ..codec import devices
from ..errors import InvalidOptionError


def choose_device(device: str | None) -> str:
    """``device`` as asked (``"cpu"`` or ``"cuda"``), or by default the GPU when Ray gave
    this actor one (``map_batches(..., num_gpus=...)``) and torch sees CUDA, else the CPU
    kernels (:func:`fp8ray.codec.devices.choose_device`)."""
    return devices.choose_device(device, gpus_given=ray.is_initialized() and bool(ray.get_gpu_ids()))


def check_threads(threads: int | None) -> int | None:
    """``threads`` checked: the CPU kernels' threads in each call of this actor. Set it
    to the CPUs given to ``map_batches`` so that actors on one node do not oversubscribe
    it. ``None`` leaves the default (``FP8RAY_NUM_THREADS``, else every CPU the process
    may use)."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1):
        raise InvalidOptionError(f"threads must be a positive integer or None, got {threads!r}", field="threads")
    return None if threads is None else int(threads)
