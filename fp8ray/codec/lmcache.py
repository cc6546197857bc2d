"""Drop-in replacements for LMCache's fp8 serde (``lmcache/v1/distributed/serde/fp8.py``).

Headerless, one byte per element, and byte-identical to LMCache's plain
``src.to(float8_e4m3fn)`` cast wherever that cast is finite. Where it is not, these
differ on purpose: finite values beyond the format's range saturate to +-max (the seed
gives NaN on torch <= 2.11 and inf in e5m2), and NaN or +-inf input raises
``ValueError`` unless ``nonfinite="keep"`` (then NaN is stored as NaN, and +-inf as
+-inf in e5m2 or NaN in e4m3fn). ``src`` and ``dst`` are any objects with a
``.tensor`` attribute, like LMCache's ``MemoryObj``; serialized buffers are 1-byte
tensors (uint8).

CPU tensors use fp8ray's numba kernels (scaling ``none``), others plain torch ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import cpu, reference
from .fp8codec import _raise_nonfinite
from .formats import DTYPES, NONFINITE_POLICIES, Fp8Format, get_format


@dataclass
class MemoryLayoutDesc:
    """The layout LMCache describes a memory object with: one shape and dtype per tensor."""

    shapes: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)


def _tensors(src, dst) -> tuple[torch.Tensor, torch.Tensor]:
    src_tensor = getattr(src, "tensor", None)
    dst_tensor = getattr(dst, "tensor", None)
    if src_tensor is None or dst_tensor is None:
        raise ValueError("Fp8 serde requires src and dst to have tensors")
    return src_tensor, dst_tensor


def _byte_buffer(t: torch.Tensor, role: str) -> torch.Tensor:
    if t.element_size() != 1:
        raise ValueError(f"{role} must be a 1-byte buffer (e.g. uint8), got a {t.dtype} tensor")
    return t.view(torch.uint8)


class _Fp8Serde:
    def __init__(self, fp8_dtype: torch.dtype | str = torch.float8_e4m3fn, nonfinite: str = "error"):
        self._fmt: Fp8Format = get_format(fp8_dtype)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"unknown nonfinite policy {nonfinite!r}; expected one of {list(NONFINITE_POLICIES)}")
        self._keep_nonfinite = nonfinite == "keep"

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._fmt.dtype


class Fp8QuantizationSerializer(_Fp8Serde):
    """Quantize a KV tensor to fp8, one byte per element, into a byte buffer."""

    def serialize(self, src, dst) -> int:
        """Cast ``src.tensor`` to fp8 and write its bytes to the start of ``dst.tensor``.

        Returns the number of bytes written (the element count).
        """
        src_tensor, dst_tensor = _tensors(src, dst)
        if src_tensor.dtype not in DTYPES:
            raise TypeError(f"src tensor has unsupported dtype {src_tensor.dtype}; expected bfloat16, float16 or float32")
        dst_bytes = _byte_buffer(dst_tensor, "dst")
        n_bytes = src_tensor.numel()
        if dst_bytes.numel() < n_bytes:
            raise ValueError(f"dst holds {dst_bytes.numel()} bytes but src needs {n_bytes} ({tuple(src_tensor.shape)})")
        if not dst_bytes.is_contiguous():
            # flatten() of a non-contiguous tensor is a copy: the bytes would be lost.
            raise ValueError("dst tensor must be contiguous, or the written bytes would land in a copy")
        target = dst_bytes.reshape(-1)[:n_bytes]
        if src_tensor.device.type == "cpu" and target.device.type == "cpu":
            bad = cpu.quantize(src_tensor.contiguous(), self._fmt, "none", 0, target.numpy(), None)
        else:
            codes, _, bad = reference.quantize(src_tensor, self._fmt, "none", 0, self._keep_nonfinite)
            target.copy_(codes)
        if bad and not self._keep_nonfinite:
            _raise_nonfinite(src_tensor, bad)
        return n_bytes

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """Exactly one byte per element, summed over the layout's shapes: no header, no margin."""
        return sum(math.prod(int(d) for d in shape) for shape in layout_desc.shapes)


class Fp8QuantizationDeserializer(_Fp8Serde):
    """Dequantize fp8 bytes back into the destination tensor's dtype and shape."""

    def deserialize(self, src, dst) -> None:
        """Read ``dst.tensor.numel()`` fp8 bytes from ``src.tensor`` and decode them into ``dst.tensor``."""
        src_tensor, dst_tensor = _tensors(src, dst)
        src_bytes = _byte_buffer(src_tensor, "src").reshape(-1)
        n_elements = dst_tensor.numel()
        if src_bytes.numel() < n_elements:
            raise ValueError(
                f"src holds {src_bytes.numel()} bytes but dst needs {n_elements} ({tuple(dst_tensor.shape)})"
            )
        codes = src_bytes[:n_elements]
        fast = (
            dst_tensor.dtype in DTYPES
            and dst_tensor.device.type == "cpu"
            and codes.device.type == "cpu"
            and dst_tensor.is_contiguous()
        )
        if fast:
            cpu.dequantize(codes.contiguous().numpy(), None, self._fmt, "none", tuple(dst_tensor.shape), 0, dst_tensor)
        else:
            dst_tensor.copy_(codes.view(self._fmt.dtype).reshape(dst_tensor.shape).to(dst_tensor.dtype))


def make_fp8_serde(kwargs: dict | None = None) -> tuple[Fp8QuantizationSerializer, Fp8QuantizationDeserializer]:
    """The pair LMCache's ``"fp8"`` serde factory builds, from the same kwargs (``fp8_dtype`` by name)."""
    kwargs = kwargs or {}
    name = str(kwargs.get("fp8_dtype", "float8_e4m3fn"))
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown torch dtype: {name!r}")
    nonfinite = str(kwargs.get("nonfinite", "error"))
    return Fp8QuantizationSerializer(dtype, nonfinite), Fp8QuantizationDeserializer(dtype, nonfinite)


__all__ = ["Fp8QuantizationDeserializer", "Fp8QuantizationSerializer", "MemoryLayoutDesc", "make_fp8_serde"]
