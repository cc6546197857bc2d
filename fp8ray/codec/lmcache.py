"""fp8ray inside LMCache (``lmcache/v1/distributed/serde/``): two serde pairs and the
registration of the second as an LMCache serde type.

LMCache's sync serde interface is ``Serializer.serialize(src, dst, key) -> int``,
``Serializer.estimate_serialized_size(layout_desc) -> int`` and
``Deserializer.deserialize(src, dst, key)``; ``src``/``dst`` are ``MemoryObj`` s (a KV
object, or a flat uint8 byte buffer sized by the estimate) and ``key`` the chunk's
``ObjectKey``. Both pairs here accept the key and ignore it (it may be left out, as in
LMCache's older two-argument calls). An LMCache KV object may hold several tensors, one
per kernel group of its object group (``layout_desc.shapes``/``dtypes``, read through
``get_tensor(i)``); both pairs write them one after the other in that order.

- :class:`Fp8QuantizationSerializer` / :class:`Fp8QuantizationDeserializer`: drop-in
  replacements for LMCache's ``"fp8"`` serde. Headerless, one byte per element, and
  byte-identical to LMCache's plain ``src.to(float8_e4m3fn)`` wherever that cast is
  finite. Where it is not, these differ on purpose: finite values beyond the format's
  range saturate to +-max (the cast gives NaN or inf), and NaN or +-inf input raises
  ``NonFiniteError`` (a ``ValueError``) unless ``nonfinite="keep"`` (then NaN is stored as
  NaN, and +-inf as +-inf in e5m2 or NaN in e4m3fn).
- :class:`Fp8FrameSerializer` / :class:`Fp8FrameDeserializer`: fp8ray's scaled,
  self-describing, checksummed frame (docs/FORMAT.md), one per tensor. The estimate is
  exactly what ``serialize`` writes (``serialize`` also narrows ``dst`` to it with
  ``dst.set_used_size(n)`` where the object has that method); ``deserialize`` verifies
  each frame (checksum, length, dtype and shape against ``dst``) and raises on any
  mismatch, so LMCache's task fails (a cache miss) instead of handing back a wrong
  tensor. Any KV shape is taken: ``[2, L, T, H]``, vLLM's blocks-first fused
  ``[1, L, T, 2H]``, or K and V as separate objects of a group (a tuple, as LMCache's
  ``MultiSerializer``/``MultiDeserializer`` pass them; :class:`Fp8FrameMultiSerializer`
  / :class:`Fp8FrameMultiDeserializer` fix the group's size). A source that is already
  one byte per element (vLLM's ``fp8`` KV cache, as uint8 or a float8 dtype) is refused
  with an error naming its dtype, unless ``fp8_input="passthrough"`` asks to store its
  bytes as they are.
- :func:`register` makes the frame pair LMCache's serde type ``"fp8ray"``: an L2 adapter's
  ``{"serde": {"type": "fp8ray", ...}}`` then builds an ``AsyncSerdeProcessor`` over it
  (:func:`make_serde_processor`). Where the installed LMCache's ``register_serde_factory``
  takes a ``size_contract`` (LMCache after 0.5.6), the serde is registered with
  ``SerdeSizeContract.EXACT``, so every L2 adapter (S3 and Valkey too) accepts it; on
  0.5.6, which has no contract, it is registered as before. ``lmcache`` is imported only
  there, so this module loads without it.

CPU tensors go through fp8ray's numba kernels; CUDA tensors through the torch ops the
kernels equal bit for bit, with the frame bytes staged in host memory.
"""

from __future__ import annotations

import inspect
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..errors import BadInputError, CorruptDataError, CorruptFrameError, InvalidOptionError, MismatchError
from . import cpu, frame, reference
from .formats import (
    DTYPES,
    DTYPES_BY_CODE,
    FORMATS_BY_CODE,
    NONFINITE_POLICIES,
    SCALE_DTYPES_BY_CODE,
    SCALINGS_BY_CODE,
    Fp8Format,
    get_format,
)
from .fp8codec import Fp8Codec, _raise_nonfinite, decode
from .options import CodecOptions

SERDE_TYPE = "fp8ray"  # the name register() gives the frame serde in LMCache by default


@dataclass
class MemoryLayoutDesc:
    """The layout LMCache describes a memory object with: one shape and dtype per tensor
    (kernel group), in order. Like LMCache's, lists of unequal length raise ``ValueError``."""

    shapes: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)

    def __post_init__(self):
        if len(self.shapes) != len(self.dtypes):
            raise ValueError(
                f"MemoryLayoutDesc: shapes and dtypes must have the same length "
                f"(got {len(self.shapes)} shapes and {len(self.dtypes)} dtypes)"
            )


def _layout_pairs(layout_desc) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``(shape, dtype)`` per tensor of a layout (fp8ray's or LMCache's)."""
    shapes, dtypes = list(layout_desc.shapes), list(layout_desc.dtypes)
    if len(shapes) != len(dtypes):
        raise ValueError(f"layout has {len(shapes)} shapes but {len(dtypes)} dtypes")
    return [(tuple(int(d) for d in shape), dtype) for shape, dtype in zip(shapes, dtypes)]


def _kv_tensors(obj) -> list[torch.Tensor]:
    """The tensors of a KV object, one per (shape, dtype) of its layout, in order.

    LMCache's ``MemoryObj.tensor`` views the whole object with its *first* shape, which
    fails when the object holds several kernel groups; those are read with
    ``get_tensor(i)``. Objects with only ``.tensor`` (any duck type) hold one tensor.
    """
    count = 1
    get_shapes = getattr(obj, "get_shapes", None)
    if callable(get_shapes) and callable(getattr(obj, "get_tensor", None)):
        try:
            count = len(get_shapes())
        except (AssertionError, AttributeError, TypeError):  # no per-group layout recorded
            count = 1
    tensors = [obj.get_tensor(i) for i in range(count)] if count > 1 else [getattr(obj, "tensor", None)]
    if any(t is None for t in tensors):
        raise ValueError("Fp8 serde requires src and dst to have tensors")
    return tensors


def _byte_tensor(obj, role: str) -> torch.Tensor:
    """A serialized buffer's bytes: ``obj.tensor`` as a flat uint8 tensor over the same memory."""
    t = getattr(obj, "tensor", None)
    if t is None:
        raise ValueError("Fp8 serde requires src and dst to have tensors")
    if t.element_size() != 1:
        raise ValueError(f"{role} must be a 1-byte buffer (e.g. uint8), got a {t.dtype} tensor")
    if not t.is_contiguous():
        # reshape(-1) of a non-contiguous tensor is a copy: written bytes would be lost.
        raise ValueError(f"{role} tensor must be contiguous, or the written bytes would land in a copy")
    return t.view(torch.uint8).reshape(-1)


def _check_dtype(t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise TypeError(f"src tensor has unsupported dtype {t.dtype}; expected bfloat16, float16 or float32")


# --- the seed-compatible pair: LMCache's "fp8" serde bytes ---------------------------


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
    """Quantize a KV object to fp8, one byte per element, into a byte buffer."""

    def serialize(self, src, dst, key=None) -> int:
        """Cast ``src``'s tensors to fp8 and write their bytes, one after the other, to
        the start of ``dst.tensor``. ``key`` (LMCache's ``ObjectKey``) is ignored.

        Returns the number of bytes written (the element count).
        """
        tensors = _kv_tensors(src)
        for t in tensors:
            _check_dtype(t)
        target = _byte_tensor(dst, "dst")
        n_bytes = sum(t.numel() for t in tensors)
        if target.numel() < n_bytes:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise ValueError(f"dst holds {target.numel()} bytes but src needs {n_bytes} ({shapes})")
        offset = 0
        for t in tensors:
            codes = target[offset : offset + t.numel()]
            if t.device.type == "cpu" and codes.device.type == "cpu":
                bad = cpu.quantize(t.contiguous(), self._fmt, "none", 0, codes.numpy(), None)
            else:
                ref_codes, _, bad = reference.quantize(t, self._fmt, "none", 0, self._keep_nonfinite)
                codes.copy_(ref_codes.reshape(-1).to(codes.device))
            if bad and not self._keep_nonfinite:
                _raise_nonfinite(t, bad)
            offset += t.numel()
        return n_bytes

    def estimate_serialized_size(self, layout_desc) -> int:
        """Exactly one byte per element, summed over the layout's shapes: no header, no margin."""
        return sum(math.prod(shape) for shape, _ in _layout_pairs(layout_desc))


class Fp8QuantizationDeserializer(_Fp8Serde):
    """Dequantize fp8 bytes back into the destination tensors' dtype and shape."""

    def deserialize(self, src, dst, key=None) -> None:
        """Read one fp8 byte per element of ``dst``'s tensors from ``src.tensor`` and
        decode them into those tensors. ``key`` is ignored."""
        tensors = _kv_tensors(dst)
        src_bytes = _byte_tensor(src, "src")
        n_elements = sum(t.numel() for t in tensors)
        if src_bytes.numel() < n_elements:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise ValueError(f"src holds {src_bytes.numel()} bytes but dst needs {n_elements} ({shapes})")
        offset = 0
        for t in tensors:
            codes = src_bytes[offset : offset + t.numel()]
            offset += t.numel()
            fast = t.dtype in DTYPES and t.device.type == "cpu" and codes.device.type == "cpu" and t.is_contiguous()
            if fast:
                cpu.dequantize(codes.numpy(), None, self._fmt, "none", tuple(t.shape), 0, t)
            else:
                t.copy_(codes.to(t.device).view(self._fmt.dtype).reshape(t.shape).to(t.dtype))


def make_fp8_serde(kwargs: dict | None = None) -> tuple[Fp8QuantizationSerializer, Fp8QuantizationDeserializer]:
    """The pair LMCache's ``"fp8"`` serde factory builds, from the same kwargs (``fp8_dtype`` by name)."""
    kwargs = kwargs or {}
    name = str(kwargs.get("fp8_dtype", "float8_e4m3fn"))
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unknown torch dtype: {name!r}")
    nonfinite = str(kwargs.get("nonfinite", "error"))
    return Fp8QuantizationSerializer(dtype, nonfinite), Fp8QuantizationDeserializer(dtype, nonfinite)


# --- the frame pair: fp8ray's scaled, checked frames --------------------------------


FP8_INPUT_POLICIES = ("refuse", "passthrough")  # what the frame pair does with 1-byte sources


def _is_group(obj) -> bool:
    """Whether ``obj`` is a group of objects (LMCache's ``MemoryObjGroup`` or
    ``LayoutDescGroup``: a tuple, one slot per object, e.g. K then V)."""
    return isinstance(obj, (tuple, list))


def _check_group(group, group_size: int | None, role: str) -> None:
    if group_size is not None and len(group) != group_size:
        raise ValueError(f"the {role} group has {len(group)} slots; this serde takes groups of {group_size}")


def _one_byte(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and dtype.itemsize == 1


class _FramePair:
    def __init__(self, options: CodecOptions | None = None, fp8_input: str = "refuse", group_size: int | None = None):
        if fp8_input not in FP8_INPUT_POLICIES:
            raise InvalidOptionError(
                f"fp8_input must be one of {list(FP8_INPUT_POLICIES)}, got {fp8_input!r}", field="fp8_input"
            )
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size must be a positive integer or None, got {group_size!r}")
        self.codec = Fp8Codec(options=options or CodecOptions())
        self.fp8_input = fp8_input
        self._group_size = group_size

    @property
    def options(self) -> CodecOptions:
        return self.codec.options

    def _size(self, shape, dtype: torch.dtype) -> int:
        """The bytes one tensor takes: its frame, or its own bytes when it is 1-byte."""
        if _one_byte(dtype):  # passed through, or refused by serialize: never an estimate error
            return math.prod(int(d) for d in shape)
        return self.codec.encoded_size(shape, dtype)


class Fp8FrameSerializer(_FramePair):
    """Encode a KV object (or a group of them) as fp8ray frames, one per tensor, into a
    byte buffer.

    Takes :class:`~fp8ray.codec.options.CodecOptions` (default: the default mode), and
    ``fp8_input``: ``"refuse"`` (default) fails on a source that is already one byte per
    element (uint8 or a float8 dtype, as vLLM's ``fp8`` KV cache), naming its dtype;
    ``"passthrough"`` stores such a tensor's bytes as they are, unframed and unchecked.
    ``group_size``: None takes single objects and groups of any size; a number (see
    :class:`Fp8FrameMultiSerializer`) takes only groups of that size.
    """

    def frame_sizes(self, layout_desc) -> list[int]:
        """The exact size of each tensor's frame for an object (or a group) of this layout."""
        if _is_group(layout_desc):
            _check_group(layout_desc, self._group_size, "layout")
            sizes = []
            for i, member in enumerate(layout_desc):
                if member is None:
                    raise ValueError(f"slot {i} of the layout group is None: the fp8ray frame serde stores every slot")
                sizes += [self._size(shape, dtype) for shape, dtype in _layout_pairs(member)]
            return sizes
        if self._group_size is not None:
            raise ValueError(f"this serde takes groups of {self._group_size} layouts, got one layout")
        return [self._size(shape, dtype) for shape, dtype in _layout_pairs(layout_desc)]

    def estimate_serialized_size(self, layout_desc) -> int:
        """Exactly the bytes :meth:`serialize` writes for an object of this layout (the
        sum of its tensors' frame sizes): LMCache's adapters store the buffer sized by
        this estimate, so any margin would be stored too. A group of layouts (one per
        slot) gives the sum over its slots."""
        return sum(self.frame_sizes(layout_desc))

    def _source_tensors(self, src) -> list[torch.Tensor]:
        if not _is_group(src):
            if self._group_size is not None:
                raise ValueError(f"this serde takes groups of {self._group_size} objects, got one object")
            return _kv_tensors(src)
        _check_group(src, self._group_size, "src")
        tensors = []
        for i, member in enumerate(src):
            if member is None:
                raise ValueError(f"slot {i} of the src group is None: the fp8ray frame serde stores every slot")
            tensors += _kv_tensors(member)
        return tensors

    def _check_source(self, tensors: list[torch.Tensor]) -> None:
        for i, t in enumerate(tensors):
            if _one_byte(t.dtype):
                if self.fp8_input == "passthrough":
                    continue
                which = f"src tensor {i + 1} of {len(tensors)}" if len(tensors) > 1 else "src tensor"
                raise BadInputError(
                    f"{which} is {t.dtype} {list(t.shape)}: already one byte per element (vLLM's fp8 KV cache?); "
                    f"the fp8ray serde encodes bfloat16, float16 or float32, and stores nothing for this object. "
                    f'Set the serde option "fp8_input": "passthrough" to store its bytes as they are',
                    field="fp8_input",
                )
            _check_dtype(t)

    def serialize(self, src, dst, key=None) -> int:
        """Write one frame per tensor of ``src`` (an object, or a group of objects slot
        by slot), one after the other, to the start of ``dst.tensor``; narrow ``dst`` to
        them (``dst.set_used_size``, where it has it) and return the bytes written.
        ``key`` is ignored."""
        tensors = self._source_tensors(src)
        self._check_source(tensors)
        target = _byte_tensor(dst, "dst")
        sizes = [self._size(t.shape, t.dtype) for t in tensors]
        total = sum(sizes)
        if target.numel() < total:
            raise ValueError(f"dst holds {target.numel()} bytes but the frames of src need {total}")
        # The frames are written in place on the CPU; a CUDA buffer gets them from a
        # host copy (the codec's CUDA path computes on the GPU, then copies to the host).
        host = target[:total].numpy() if target.device.type == "cpu" else np.empty(total, dtype=np.uint8)
        offset = 0
        for t, size in zip(tensors, sizes):
            if _one_byte(t.dtype):  # passthrough (refused above otherwise)
                host[offset : offset + size] = t.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
            else:
                self.codec.encode(t, out=host[offset : offset + size])
            offset += size
        if target.device.type != "cpu":
            target[:total].copy_(torch.from_numpy(host))
        set_used_size = getattr(dst, "set_used_size", None)
        if callable(set_used_size):
            set_used_size(total)
        return total


class Fp8FrameDeserializer(_FramePair):
    """Decode fp8ray frames straight into a KV object's tensors (or a group's), checking each.

    The frames describe themselves (format, scaling, scales); the options given are
    used only to know each frame's length, so they must be the serializer's (LMCache
    sizes the buffer it loads by the same estimate). ``fp8_input`` and ``group_size``
    must be the serializer's too: with ``"passthrough"``, a 1-byte destination tensor
    gets its bytes copied back as they were stored.
    """

    def _destination_tensors(self, dst) -> list[torch.Tensor | None]:
        """``dst``'s tensors in order; for a group, ``None`` for a slot left out (one frame)."""
        if not _is_group(dst):
            if self._group_size is not None:
                raise ValueError(f"this serde takes groups of {self._group_size} objects, got one object")
            return list(_kv_tensors(dst))
        _check_group(dst, self._group_size, "dst")
        tensors: list[torch.Tensor | None] = []
        for member in dst:
            tensors += [None] if member is None else _kv_tensors(member)
        return tensors

    def deserialize(self, src, dst, key=None) -> None:
        """Decode the frames at the start of ``src.tensor`` into ``dst``'s tensors.

        ``dst`` may be a group of objects (LMCache's ``MultiDeserializer``): a ``None``
        slot is left untouched and its frame (one per slot) skipped. Raises
        :class:`~fp8ray.errors.CorruptFrameError` for a corrupt or truncated frame and
        :class:`~fp8ray.errors.MismatchError` when a frame holds another dtype or shape
        than its tensor. ``key`` is ignored.
        """
        tensors = self._destination_tensors(dst)
        src_bytes = _byte_tensor(src, "src")
        if src_bytes.device.type != "cpu":  # frames are parsed and checked on the host
            src_bytes = src_bytes.cpu()
        data = src_bytes.numpy()
        offset = 0
        for i, t in enumerate(tensors):
            where = f"frame {i + 1} of {len(tensors)}" if len(tensors) > 1 else "frame"
            if t is None:  # a slot the caller does not want: skip its frame by its header
                header = read_frame_header(data[offset:])
                if header is None:
                    raise CorruptFrameError(f"{where} (a skipped slot) does not start with a frame header at offset {offset}")
                offset += header.frame_size
                continue
            if _one_byte(t.dtype) and self.fp8_input != "passthrough":
                raise MismatchError(
                    f"{where}: dst tensor is {t.dtype}, one byte per element; the fp8ray serde decodes into "
                    f'bfloat16, float16 or float32 unless "fp8_input" is "passthrough"'
                )
            size = self._size(t.shape, t.dtype)
            if offset + size > data.size:
                raise CorruptFrameError(
                    f"{where} truncated: src holds {data.size - offset} bytes from offset {offset}, "
                    f"a {tuple(t.shape)} {t.dtype} tensor's frame has {size}"
                )
            chunk = data[offset : offset + size]
            if _one_byte(t.dtype):  # passthrough: the bytes as they were stored
                t.copy_(torch.from_numpy(chunk.copy()).view(t.dtype).reshape(t.shape).to(t.device))
            else:
                try:
                    decode(chunk, out=t)
                except CorruptDataError as exc:
                    raise CorruptFrameError(f"{where}: {exc}") from None
                except ValueError as exc:  # a sound frame of another dtype or shape
                    raise MismatchError(f"{where}: {exc}") from None
            offset += size


class Fp8FrameMultiSerializer(Fp8FrameSerializer):
    """:class:`Fp8FrameSerializer` for groups of exactly ``group_size`` objects (default
    2: slot 0 = K, slot 1 = V, each an LMCache ``MemoryObj``), the shape of LMCache's
    ``MultiSerializer``: every slot is required; the frames of slot 0's tensors come
    first, then slot 1's."""

    def __init__(self, options: CodecOptions | None = None, fp8_input: str = "refuse", group_size: int = 2):
        super().__init__(options, fp8_input, group_size)

    @property
    def group_size(self) -> int:
        return self._group_size


class Fp8FrameMultiDeserializer(Fp8FrameDeserializer):
    """:class:`Fp8FrameDeserializer` for groups of exactly ``group_size`` destination
    objects (LMCache's ``MultiDeserializer``): a ``None`` slot is left untouched, its
    frame skipped (each slot is taken to hold one tensor when it is skipped)."""

    def __init__(self, options: CodecOptions | None = None, fp8_input: str = "refuse", group_size: int = 2):
        super().__init__(options, fp8_input, group_size)

    @property
    def group_size(self) -> int:
        return self._group_size


def read_frame_header(prefix) -> frame.FrameHeader | None:
    """The header of the frame that ``prefix`` (bytes-like) starts with, from its first
    ``16 + 8 * ndim`` bytes; ``None`` if it does not start with the frame magic, or is
    too short to hold the header. Raises :class:`~fp8ray.errors.CorruptFrameError` for a
    malformed header. The checksum, which covers the whole frame, is not verified here:
    :func:`~fp8ray.codec.decode` does that."""
    buf = bytes(prefix[: frame.FIXED_HEADER.size + 8 * frame.MAX_NDIM])
    if len(buf) < frame.FIXED_HEADER.size or buf[:4] != frame.MAGIC:
        return None
    _, version, fmt_code, scaling_code, dtype_code, ndim, scale_code, reserved, block_size = frame.FIXED_HEADER.unpack(
        buf[: frame.FIXED_HEADER.size]
    )
    codes = {
        "version": (version, {frame.VERSION}), "fp8 format": (fmt_code, FORMATS_BY_CODE),
        "scaling": (scaling_code, SCALINGS_BY_CODE), "dtype": (dtype_code, DTYPES_BY_CODE),
        "scale dtype": (scale_code, SCALE_DTYPES_BY_CODE),
    }
    for name, (value, known) in codes.items():
        if value not in known:
            raise CorruptFrameError(f"unknown {name} code {value} in frame header")
    if ndim > frame.MAX_NDIM or reserved != b"\0\0":
        raise CorruptFrameError(f"malformed frame header (ndim {ndim}, reserved bytes {reserved.hex()})")
    end = frame.FIXED_HEADER.size + 8 * ndim
    if len(buf) < end:
        return None
    shape = struct.unpack(f"<{ndim}Q", buf[frame.FIXED_HEADER.size : end])
    scaling = SCALINGS_BY_CODE[scaling_code]
    return frame.FrameHeader(
        FORMATS_BY_CODE[fmt_code], scaling, DTYPES_BY_CODE[dtype_code], shape, block_size,
        frame.stored_scale_dtype(scaling, SCALE_DTYPES_BY_CODE[scale_code]),
    )


# --- the registered LMCache serde type ----------------------------------------------

SERDE_KWARGS = (*CodecOptions.names(), "max_workers", "fp8_input")


class SerdeSettings(NamedTuple):
    """What an adapter's ``"serde"`` kwargs ask of the registered type."""

    options: CodecOptions
    max_workers: int = 1
    fp8_input: str = "refuse"


def serde_options(kwargs: Mapping[str, object] | None = None) -> SerdeSettings:
    """The codec options, ``max_workers`` and ``fp8_input`` from an adapter's ``"serde"``
    kwargs (the JSON object less its ``"type"``). None given: the default mode, one
    worker thread, as LMCache's own serdes, and 1-byte sources refused. An unknown key
    or a bad value raises :class:`~fp8ray.errors.InvalidOptionError` (a ``ValueError``)
    naming it."""
    values = dict(kwargs or {})
    for name in values:
        if name not in SERDE_KWARGS:
            raise InvalidOptionError(
                f"unknown option {name!r} of the fp8ray serde; expected some of {list(SERDE_KWARGS)}", field=name
            )
    max_workers = values.pop("max_workers", 1)
    if isinstance(max_workers, str) and max_workers.isascii() and max_workers.isdigit():
        max_workers = int(max_workers)
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise InvalidOptionError(f"max_workers must be a positive integer, got {max_workers!r}", field="max_workers")
    fp8_input = values.pop("fp8_input", "refuse")
    if fp8_input not in FP8_INPUT_POLICIES:
        raise InvalidOptionError(
            f"fp8_input must be one of {list(FP8_INPUT_POLICIES)}, got {fp8_input!r}", field="fp8_input"
        )
    return SerdeSettings(CodecOptions.parse(values), max_workers, fp8_input)


def _lmcache_serde():
    """LMCache's serde package, or an ImportError saying which package is missing."""
    try:
        from lmcache.v1.distributed import serde
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        if missing == "lmcache" or missing.startswith("lmcache."):
            reason = "the 'lmcache' package is not installed (pip install lmcache)"
        else:
            reason = f"the 'lmcache' package failed to import: it needs {missing!r}, which is not installed ({exc})"
        raise ImportError(f"fp8ray's LMCache serde needs LMCache: {reason}") from exc
    return serde


_CLASSES: tuple[type, type] | None = None
_MULTI_CLASSES: tuple[type, type] | None = None


def lmcache_serde_classes() -> tuple[type, type]:
    """The frame pair as subclasses of LMCache's own ``Serializer`` and ``Deserializer``
    (built on first use, as LMCache is optional)."""
    global _CLASSES
    if _CLASSES is None:
        serde = _lmcache_serde()

        class LMCacheFp8FrameSerializer(Fp8FrameSerializer, serde.Serializer):
            """:class:`Fp8FrameSerializer`, an LMCache ``Serializer``."""

        class LMCacheFp8FrameDeserializer(Fp8FrameDeserializer, serde.Deserializer):
            """:class:`Fp8FrameDeserializer`, an LMCache ``Deserializer``."""

        _CLASSES = (LMCacheFp8FrameSerializer, LMCacheFp8FrameDeserializer)
    return _CLASSES


def lmcache_multi_serde_classes() -> tuple[type, type]:
    """The group pair (:class:`Fp8FrameMultiSerializer`, :class:`Fp8FrameMultiDeserializer`)
    as subclasses of LMCache's ``MultiSerializer`` and ``MultiDeserializer``; an
    ``ImportError`` where the installed LMCache has no multi serde interface."""
    global _MULTI_CLASSES
    if _MULTI_CLASSES is None:
        serde = _lmcache_serde()
        multi_ser, multi_de = getattr(serde, "MultiSerializer", None), getattr(serde, "MultiDeserializer", None)
        if multi_ser is None or multi_de is None:
            raise ImportError("fp8ray's group serde needs LMCache's MultiSerializer, which the installed lmcache lacks")

        class LMCacheFp8FrameMultiSerializer(Fp8FrameMultiSerializer, multi_ser):
            """:class:`Fp8FrameMultiSerializer`, an LMCache ``MultiSerializer``."""

        class LMCacheFp8FrameMultiDeserializer(Fp8FrameMultiDeserializer, multi_de):
            """:class:`Fp8FrameMultiDeserializer`, an LMCache ``MultiDeserializer``."""

        _MULTI_CLASSES = (LMCacheFp8FrameMultiSerializer, LMCacheFp8FrameMultiDeserializer)
    return _MULTI_CLASSES


def make_serde_processor(kwargs: Mapping[str, object] | None = None):
    """LMCache serde factory: an ``AsyncSerdeProcessor`` over the frame pair, from the
    adapter's ``"serde"`` kwargs (:func:`serde_options`)."""
    settings = serde_options(kwargs)  # refuse bad options before anything starts
    serializer, deserializer = lmcache_serde_classes()
    serde = _lmcache_serde()
    return serde.AsyncSerdeProcessor(
        serializer(settings.options, settings.fp8_input),
        deserializer(settings.options, settings.fp8_input),
        max_workers=settings.max_workers,
    )


def exact_size_contract(serde=None):
    """What to pass as ``size_contract`` to the installed LMCache's
    ``register_serde_factory``: its ``SerdeSizeContract.EXACT`` where the function takes
    that keyword (LMCache after 0.5.6), else ``None`` (0.5.6: no contract to declare).
    Detected by feature, not by version: ``serde`` is LMCache's serde package (or an
    object shaped like it), imported when not given."""
    serde = serde if serde is not None else _lmcache_serde()
    contract = getattr(serde, "SerdeSizeContract", None)
    if contract is None:
        contract = getattr(getattr(serde, "base", None), "SerdeSizeContract", None)
    exact = getattr(contract, "EXACT", None)
    if exact is None:
        return None
    try:
        params = inspect.signature(serde.register_serde_factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read: do not guess
        return None
    if any((p.name == "size_contract" and p.kind is not p.POSITIONAL_ONLY) or p.kind is p.VAR_KEYWORD for p in params):
        return exact
    return None


def _registered_factory(serde, name: str):
    registry = getattr(getattr(serde, "factory", None), "_SERDE_FACTORY_REGISTRY", None)
    if registry is None:
        registry = getattr(serde, "_SERDE_FACTORY_REGISTRY", {})
    return registry.get(name)


def register(name: str = SERDE_TYPE):
    """Register the frame serde with LMCache as serde type ``name`` (``register_serde_factory``).

    Where the installed LMCache's ``register_serde_factory`` takes ``size_contract``, the
    serde is declared ``SerdeSizeContract.EXACT`` (its estimate is what it writes), so
    LMCache accepts it with every L2 adapter, not only ``fs``; on LMCache 0.5.6 it is
    registered without one, as that version has none. Returns the contract declared, or
    ``None`` where the installed LMCache has none.

    Call it in the LMCache process before its L2 adapters are built (docs/LMCACHE.md);
    a second call with the same name is a no-op. Raises ``ImportError`` naming the
    missing package when LMCache cannot be imported, and ``ValueError`` when ``name``
    is taken by another serde (LMCache's own ``"fp8"``, say).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a serde type name must be a non-empty string, got {name!r}")
    serde = _lmcache_serde()
    contract = exact_size_contract(serde)
    if name in serde.get_registered_serde_types():
        registered = _registered_factory(serde, name)
        if getattr(registered, "__module__", None) == __name__ and getattr(registered, "__name__", None) == "make_serde_processor":
            return contract  # ours already (a second call, or this module loaded again)
        raise ValueError(f"LMCache serde type {name!r} is already registered by another factory; choose another name")
    if contract is None:
        serde.register_serde_factory(name, make_serde_processor)
    else:
        serde.register_serde_factory(name, make_serde_processor, size_contract=contract)
    return contract


__all__ = [
    "FP8_INPUT_POLICIES",
    "SERDE_TYPE",
    "Fp8FrameDeserializer",
    "Fp8FrameMultiDeserializer",
    "Fp8FrameMultiSerializer",
    "Fp8FrameSerializer",
    "Fp8QuantizationDeserializer",
    "Fp8QuantizationSerializer",
    "MemoryLayoutDesc",
    "SerdeSettings",
    "exact_size_contract",
    "lmcache_multi_serde_classes",
    "lmcache_serde_classes",
    "make_fp8_serde",
    "make_serde_processor",
    "read_frame_header",
    "register",
    "serde_options",
]
