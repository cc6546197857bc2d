"""Drop-in replacements for LMCache's ``"fp8"`` serde (``lmcache/v1/distributed/serde/fp8.py``,
the seed this project started from): headerless, one byte per element.

Byte-identical to LMCache's plain ``src.to(float8_e4m3fn)`` wherever the input and that cast are finite,
for a source of any real dtype, as LMCache's (float64, float8 and integer ones go by way
of float32, as torch's cast does). Where it is not, these differ on purpose: finite
values beyond the format's range saturate to +-max (torch's cast gives inf in e5m2, and
NaN in e4m3fn in some of its versions), and NaN or +-inf input raises
``NonFiniteError`` (a ``ValueError``) unless ``nonfinite="keep"`` (then NaN is stored as
NaN, and +-inf as +-inf in e5m2 or NaN in e4m3fn). An object of several kernel groups is
written group after group, in order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from ..codec import cpu, reference
from ..codec.formats import DTYPES, NONFINITE_POLICIES, Fp8Format, get_format
from ..codec.fp8codec import copy_into, raise_nonfinite
from ..errors import BadInputError, CorruptDataError, InvalidOptionError
from .objects import Shape, byte_view, check_dense, kv_tensors, layout_pairs
from .settings import kwargs_dict


def _code_spans(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], roles: tuple[str, str], error: type[Exception]):
    """Each tensor with its span of ``buffer``, one byte per element, in turn; ``error``
    (naming ``roles``: the buffer's, then the tensors') when the buffer is too short."""
    needed = sum(t.numel() for t in tensors)
    if buffer.numel() < needed:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise error(f"{roles[0]} holds {buffer.numel()} bytes but {roles[1]} needs {needed} ({shapes})")
    ends = [0, *itertools.accumulate(t.numel() for t in tensors)]
    return [(t, buffer[start:end]) for t, start, end in zip(tensors, ends, ends[1:])]


def _castable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or of a dtype the kernels do not take, ``t`` in float32: torch casts every
    real dtype to fp8 by way of float32 (float64 rounded twice), so the codes are the
    same. A complex tensor is refused, as it has no one real value per element."""
    check_dense(t, "src")
    if t.dtype in DTYPES:
        return t
    if t.is_complex():
        raise TypeError(f"src tensor has unsupported dtype {t.dtype}: a KV cache is real")
    if t.dtype == torch.float64:  # a finite value past float32's range saturates, as in range: it must not become inf
        top = torch.finfo(torch.float32).max
        t = torch.where(t.isfinite(), t.clamp(-top, top), t)
    return t.to(torch.float32)


class _Fp8Serde:
    def __init__(self, fp8_dtype: torch.dtype | str = torch.float8_e4m3fn, nonfinite: str = "error"):
        self._fmt: Fp8Format = get_format(fp8_dtype)
        if nonfinite not in NONFINITE_POLICIES:
            raise InvalidOptionError(
                f"unknown nonfinite policy {nonfinite!r}; expected one of {list(NONFINITE_POLICIES)}", field="nonfinite"
            )
        self._keep_nonfinite = nonfinite == "keep"

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._fmt.dtype


class Fp8QuantizationSerializer(_Fp8Serde):
    """Quantize a KV object to fp8, one byte per element, into a byte buffer."""

    def serialize(self, src, dst, key=None) -> int:
        """Cast ``src``'s tensors to fp8 and write their bytes, one after the other, to
        the start of ``dst.tensor``. ``key`` (LMCache's ``ObjectKey``) is ignored.

        Returns the number of bytes written (the element count).
        """
        return self.serialize_tensors(kv_tensors(src), getattr(dst, "tensor", None))

    def serialize_tensors(self, tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> int:
        """Write ``tensors`` as fp8 bytes, one after the other, to the start of
        ``buffer`` (a contiguous tensor of 1-byte elements); returns the bytes written."""
        spans = _code_spans(byte_view(buffer, "dst"), [_castable(t) for t in tensors], ("dst", "src"), BadInputError)
        for given, (t, codes) in zip(tensors, spans):
            if t.device.type == "cpu" and codes.device.type == "cpu":
                bad = cpu.quantize(cpu.kernel_array(t.resolve_neg().contiguous()), self._fmt, "none", 0, codes.numpy(), None)
            else:
                ref_codes, _, bad = reference.quantize(t, self._fmt, "none", 0, self._keep_nonfinite)
                copy_into(codes, ref_codes.reshape(-1).to(codes.device))
            if bad and not self._keep_nonfinite:
                raise_nonfinite(given, bad)  # named as given (a float64's, not its float32 cast's)
        return sum(codes.numel() for _, codes in spans)

    def estimate_serialized_size(self, layout_desc) -> int:
        """Exactly one byte per element, summed over the layout's shapes: no header, no margin."""
        return self.serialized_size(layout_pairs(layout_desc))

    def serialized_size(self, layout: Sequence[tuple[Shape, torch.dtype]]) -> int:
        """The bytes :meth:`serialize_tensors` writes for tensors of these ``(shape, dtype)``."""
        return sum(math.prod(shape) for shape, _ in layout)


class Fp8QuantizationDeserializer(_Fp8Serde):
    """Dequantize fp8 bytes back into the destination tensors' dtype and shape."""

    def deserialize(self, src, dst, key=None) -> None:
        """Read one fp8 byte per element of ``dst``'s tensors from ``src.tensor`` and
        decode them into those tensors. ``key`` is ignored."""
        self.deserialize_tensors(getattr(src, "tensor", None), kv_tensors(dst))

    def deserialize_tensors(self, buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Decode one fp8 byte per element of ``tensors``, from the start of ``buffer`` (a
        contiguous tensor of 1-byte elements), into them in turn."""
        for t in tensors:
            check_dense(t, "dst")
        for t, codes in _code_spans(byte_view(buffer, "src"), tensors, ("src", "dst"), CorruptDataError):
            # A negative view (t.is_neg()) holds its values' negatives: torch's copy_ writes it.
            fast = t.dtype in DTYPES and t.device.type == "cpu" and codes.device.type == "cpu"
            fast = fast and t.is_contiguous() and not t.is_neg()
            if fast:
                cpu.dequantize(codes.numpy(), None, self._fmt, "none", tuple(t.shape), 0, cpu.kernel_array(t))
            else:
                copy_into(t, codes.to(t.device).view(self._fmt.dtype).reshape(t.shape).to(t.dtype))


def make_fp8_serde(kwargs: dict | None = None) -> tuple[Fp8QuantizationSerializer, Fp8QuantizationDeserializer]:
    """The pair LMCache's ``"fp8"`` serde factory builds, from the same kwargs (``fp8_dtype`` by name)."""
    kwargs = kwargs_dict(kwargs)
    name = str(kwargs.get("fp8_dtype", "float8_e4m3fn"))
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidOptionError(f"Unknown torch dtype: {name!r}", field="fp8_dtype")
    nonfinite = str(kwargs.get("nonfinite", "error"))
    return Fp8QuantizationSerializer(dtype, nonfinite), Fp8QuantizationDeserializer(dtype, nonfinite)
