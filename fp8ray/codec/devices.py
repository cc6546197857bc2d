"""Which device a worker encodes and decodes on: the one rule for every kind of worker
(``QuantWorker``, the Ray Data UDFs). Frames are the same bytes on either device (the
CUDA path equals the CPU kernels bit for bit). torch is loaded only where CUDA is asked
about: a CPU worker runs without it."""

from __future__ import annotations

import sys
import warnings

import numpy as np

from ..errors import InvalidOptionError

DEVICES = ("cpu", "cuda")


def choose_device(device: str | None, gpus_given: bool) -> str:
    """``device`` as asked (``"cpu"`` or ``"cuda"``), or by default the GPU when Ray gave
    the caller one (``gpus_given``) and torch sees CUDA, else the CPU kernels."""
    if device is None:
        return "cuda" if gpus_given and cuda_available() else "cpu"
    if device not in DEVICES:
        raise InvalidOptionError(f"device must be one of {list(DEVICES)} or None, got {device!r}", field="device")
    if device == "cuda" and not cuda_available():
        raise InvalidOptionError("device 'cuda' was asked for, but torch sees no CUDA device", field="device")
    return device


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (loads torch)."""
    import torch

    return torch.cuda.is_available()


def is_tensor(value) -> bool:
    """Whether ``value`` is a torch tensor (never, while torch is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def host_tensor(array: np.ndarray):
    """A zero-copy CPU tensor over a host array, read-only ones included (the codec only
    reads them: torch's warning about it is silenced)."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def host_buffer(nbytes: int, device) -> np.ndarray:
    """``nbytes`` of host memory for what travels to or from ``device``, to be reused: for
    CUDA, pinned, so that copies run at the bus's speed, not through a bounce buffer
    (BENCHMARKS.md, "GPU"). Pinned memory comes from torch's caching allocator, which keeps
    it, locked, for the next request once dropped: for buffers a process keeps and reuses
    (a GPU worker's), not for one-off results. ``device``: a name (``"cpu"``, ``"cuda:1"``)
    or a torch device."""
    if str(device).split(":")[0] == "cuda":
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty(nbytes, dtype=np.uint8)
