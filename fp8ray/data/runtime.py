"""Where a Ray Data UDF runs: the device it encodes or decodes on, and its CPU threads."""

from __future__ import annotations

import ray
import torch

from ..errors import InvalidOptionError

DEVICES = ("cpu", "cuda")


def choose_device(device: str | None) -> str:
    """``device`` as asked (``"cpu"`` or ``"cuda"``), or by default the GPU when Ray gave
    this actor one (``map_batches(..., num_gpus=...)``) and torch sees CUDA, else the CPU
    kernels. Frames are the same bytes on either (the CUDA path equals the CPU kernels
    bit for bit)."""
    if device is None:
        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
        return "cuda" if gpu_ids and torch.cuda.is_available() else "cpu"
    if device not in DEVICES:
        raise InvalidOptionError(f"device must be one of {list(DEVICES)} or None, got {device!r}", field="device")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidOptionError("device 'cuda' was asked for, but torch sees no CUDA device", field="device")
    return device


def check_threads(threads: int | None) -> int | None:
    """``threads`` checked: the CPU kernels' threads in each call of this actor. Set it
    to the CPUs given to ``map_batches`` so that actors on one node do not oversubscribe
    it. ``None`` leaves the default (``FP8RAY_NUM_THREADS``, else every CPU the process
    may use)."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InvalidOptionError(f"threads must be a positive integer or None, got {threads!r}", field="threads")
    return threads
