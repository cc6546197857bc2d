"""The frame: fp8ray's self-describing, checksummed byte layout for one encoded tensor.

Specified byte by byte in docs/FORMAT.md; in short (all integers little-endian)::

    0   4        magic b"FP8R"
    4   1        version (1)
    5   1        fp8 format code        (1 e4m3fn, 2 e5m2; 0: stored, below)
    6   1        scaling code           (0 none, 1 tensor, 2 channel, 3 token, 4 block)
    7   1        original dtype code    (1 float32, 2 float16, 3 bfloat16; 4.. stored dtypes)
    8   1        ndim (0..64)
    9   1        scale dtype code       (0 float32, 1 bfloat16; 0 under scaling none)
    10  2        reserved, zero
    12  4        block_size (uint32; 0 unless scaling is block)
    16  8*ndim   shape (uint64 each)
    H   B*S      scales (B = 4 bytes float32 or 2 bytes bfloat16 each; S follows from
                 scaling and shape)
    H+BS N       fp8 codes, row-major (N = product of shape)
    end-4 4      CRC-32C of every byte before it

Byte 9 was reserved (zero) before scale dtypes existed, so every older frame reads as
float32 scales, unchanged.

A stored frame (format code 0) holds a tensor fp8 does not encode (integers, booleans,
float64, complex64, fp8) as its own bytes: scaling none, no scales, then ``N * itemsize`` bytes of
the tensor in place of the codes. Decoding gives the tensor back bit for bit.
"""

from __future__ import annotations

import math
import operator
import struct
import sys
from dataclasses import dataclass

import numpy as np

from ..errors import BadInputError, CorruptFrameError
from . import checksum
from .formats import (
    DTYPE_ITEMSIZES,
    DTYPE_NAMES_BY_CODE,
    FORMATS_BY_CODE,
    FRAME_DTYPE_CODES,
    INFINITY_BITS,
    LARGEST,
    SCALE_BYTES,
    SCALE_DTYPES,
    SCALE_DTYPES_BY_CODE,
    SCALINGS,
    SCALINGS_BY_CODE,
    Fp8Format,
    is_stored,
    num_scales,
    tensor_nbytes,
)

MAGIC = b"FP8R"
VERSION = 1
STORED_CODE = 0  # the fp8 format code of a stored frame: the tensor's own bytes, no fp8
# The limits of what a frame can hold, for the encoder and the decoder alike: the rank
# fits in one byte but is capped at 64 (torch's own limit is 64 too); each dimension is a
# uint64, and the element count must index a numpy array (int64).
MAX_NDIM = 64
MAX_DIM = 2**64 - 1
MAX_NUMEL = 2**63 - 1
FIXED_HEADER = struct.Struct("<4sBBBBBB2sI")  # magic .. block_size: 16 bytes
MAX_HEADER_BYTES = FIXED_HEADER.size + 8 * MAX_NDIM  # a prefix this long holds any frame's header
CHECKSUM_BYTES = 4


@dataclass(frozen=True)
class FrameHeader:
    """The parsed header of a frame, and where its parts lie."""

    fmt: Fp8Format | None  # None: a stored frame (the tensor's own bytes)
    scaling: str
    dtype: str  # the source dtype's name: "float32" | "float16" | "bfloat16", or a stored one
    shape: tuple[int, ...]
    block_size: int
    scale_dtype: str = "float32"  # as stored: always "float32" under scaling none

    @property
    def torch_dtype(self):
        """The source dtype as torch's (``torch.bfloat16``); loads torch."""
        from .formats import torch_dtype

        return torch_dtype(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stored(self) -> bool:
        """Whether the frame holds the tensor's own bytes, not fp8 codes."""
        return self.fmt is None

    @property
    def num_scales(self) -> int:
        return num_scales(self.scaling, self.shape, self.block_size)

    @property
    def scales_offset(self) -> int:
        return FIXED_HEADER.size + 8 * len(self.shape)

    @property
    def codes_offset(self) -> int:
        return self.scales_offset + SCALE_BYTES[self.scale_dtype] * self.num_scales

    @property
    def tensor_nbytes(self) -> int:
        """The bytes of the tensor the frame holds, decoded."""
        return tensor_nbytes(self.dtype, self.shape)

    @property
    def payload_bytes(self) -> int:
        """The bytes of the codes (one per element), or of a stored frame's tensor."""
        return self.tensor_nbytes if self.stored else self.numel

    @property
    def frame_size(self) -> int:
        return self.codes_offset + self.payload_bytes + CHECKSUM_BYTES


def stored_header(dtype: str, shape: tuple[int, ...]) -> FrameHeader:
    """The header of the stored frame of a ``dtype`` tensor (a stored dtype's name) of ``shape``."""
    return FrameHeader(None, "none", dtype, tuple(shape), 0, "float32")


def stored_scale_dtype(scaling: str, scale_dtype: str) -> str:
    """The scale dtype a frame records: float32 (code 0) when there are no scales."""
    return "float32" if scaling == "none" else scale_dtype


def header_for(options, dtype: str, shape: tuple[int, ...]) -> FrameHeader:
    """The header of the frame the codec options ``options`` (a
    :class:`~fp8ray.codec.CodecOptions`) make of a ``dtype`` tensor of ``shape``: a frame
    with another header was written in other options. Every option makes the same stored
    frame of a dtype fp8 does not encode."""
    if is_stored(dtype):
        return stored_header(dtype, shape)
    block_size = options.block_size if options.scaling == "block" else 0
    scale_dtype = stored_scale_dtype(options.scaling, options.scale_dtype)
    return FrameHeader(options.fmt, options.scaling, dtype, tuple(shape), block_size, scale_dtype)


def layout_label(options) -> str:
    """What a frame records of its options (a :class:`FrameHeader`, or the
    :class:`~fp8ray.codec.CodecOptions` that make one), as messages show it: ``e4m3fn,
    block 32, bfloat16 scales`` (a frame does not record how its scales were chosen);
    ``stored as is`` for a stored frame."""
    if options.fmt is None:
        return "stored as is"
    scaling = f"block {options.block_size}" if options.scaling == "block" else options.scaling
    scales = "" if options.scaling == "none" else f", {options.scale_dtype} scales"
    return f"{options.fmt.name}, {scaling}{scales}"


def dimensions(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of ints; a ``TypeError`` naming the dimension for one that is
    not an integer (a float is refused, not truncated)."""
    try:
        given = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of integers, got {shape!r}") from None
    out = []
    for i, d in enumerate(given):
        try:
            if isinstance(d, bool):  # an int to Python, not a size
                raise TypeError
            out.append(operator.index(d))
        except TypeError:
            raise TypeError(f"shape {given}: dimension {i} is {d!r}, not an integer") from None
    return tuple(out)


def check_shape(shape: tuple[int, ...], dtype: str) -> None:
    """Refuse, with a ``ValueError`` naming the limit, a shape no frame can hold (of
    ``dtype``, a source dtype's name: an empty tensor's other dimensions times its item
    size must be a size numpy can make)."""
    if len(shape) > MAX_NDIM:
        raise BadInputError(f"a tensor of {len(shape)} dimensions exceeds the frame's limit of {MAX_NDIM}")
    for i, d in enumerate(shape):
        if not 0 <= d <= MAX_DIM:
            raise BadInputError(f"dimension {i} of shape {list(shape)} is {d}; a frame holds 0 to {MAX_DIM}")
    if math.prod(shape) > MAX_NUMEL:
        raise BadInputError(f"shape {list(shape)} has {math.prod(shape)} elements, more than the frame's limit of {MAX_NUMEL}")
    spanned = math.prod(d for d in shape if d)
    itemsize = DTYPE_ITEMSIZES[dtype]
    if spanned * itemsize > MAX_NUMEL:  # an empty tensor still: numpy multiplies its other dimensions, in bytes
        raise BadInputError(
            f"shape {list(shape)}: its non-zero dimensions multiply to {spanned}, more than {MAX_NUMEL // itemsize} "
            f"for {dtype} (numpy and torch cannot make an array of it{', even empty' if 0 in shape else ''})"
        )


def is_block(dtype, shape) -> bool:
    """Whether ``dtype`` and ``shape``, values read from a file (anything), are a dtype's
    name and a tuple or list of integers that :func:`check_shape` takes."""
    if dtype not in DTYPE_ITEMSIZES or not isinstance(shape, (tuple, list)) or any(type(d) is not int for d in shape):
        return False
    try:
        check_shape(shape, dtype)
    except ValueError:
        return False
    return True


# A frame holds at least a byte for every element (an fp8 code, or a stored dtype's own
# bytes) and an element fp8 encodes is at most 4 bytes: a tensor is at most this many
# times its frame's length. A row asking more was edited, or is damaged.
RAW_BYTES_PER_FRAME_BYTE = 4


def write_header(buf: np.ndarray, header: FrameHeader) -> None:
    """Write the fixed header and shape into the start of ``buf`` (uint8)."""
    block_size = header.block_size if header.scaling == "block" else 0
    fixed = FIXED_HEADER.pack(
        MAGIC,
        VERSION,
        STORED_CODE if header.stored else header.fmt.code,
        SCALINGS[header.scaling],
        FRAME_DTYPE_CODES[header.dtype],
        len(header.shape),
        SCALE_DTYPES[header.scale_dtype],
        b"\0\0",
        block_size,
    )
    shape = struct.pack(f"<{len(header.shape)}Q", *header.shape)
    buf[: header.scales_offset] = np.frombuffer(fixed + shape, dtype=np.uint8)


def seal(buf: np.ndarray, tail: tuple[int, int] | None = None) -> None:
    """Write the CRC-32C of everything before the last 4 bytes into them. ``tail``: ``(offset,
    crc)``, the CRC-32C of the bytes from ``offset`` up to the checksum when the caller has
    it (the encoder's threads take that of the codes they write): only the bytes before
    ``offset`` are read then, and the two CRCs combined (:mod:`.checksum`)."""
    body = buf[:-CHECKSUM_BYTES]
    if tail is None:
        crc = checksum.crc32c(body)
    else:
        offset, tail_crc = tail
        crc = checksum.combine(checksum.crc32c(body[:offset]), tail_crc, body.size - offset)
    buf[-CHECKSUM_BYTES:] = np.frombuffer(struct.pack("<I", crc), dtype=np.uint8)


def as_byte_array(frame) -> np.ndarray:
    """A flat uint8 numpy view of any bytes-like frame (bytes, bytearray, memoryview,
    numpy uint8 array, CPU uint8 torch tensor), without copying."""
    torch = sys.modules.get("torch")  # a frame cannot be a tensor while torch is not loaded
    if torch is not None and isinstance(frame, torch.Tensor):
        if frame.dtype != torch.uint8 or frame.device.type != "cpu":
            raise TypeError(f"a frame tensor must be a CPU uint8 tensor, got {frame.dtype} on {frame.device}")
        return frame.contiguous().reshape(-1).numpy()
    if isinstance(frame, np.ndarray):
        if frame.dtype != np.uint8:
            raise TypeError(f"a frame array must have dtype uint8, got {frame.dtype}")
        return np.ascontiguousarray(frame).reshape(-1)
    try:
        view = memoryview(frame)
    except TypeError:
        raise TypeError(f"a frame must be bytes-like, got {type(frame).__name__}") from None
    if not view.c_contiguous:  # a strided view (memoryview(b)[::2]): its bytes in order, copied
        return np.frombuffer(view.tobytes(), dtype=np.uint8)
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)


def parse_header(prefix) -> FrameHeader | None:
    """The header of the frame that ``prefix`` (bytes-like: a frame's first bytes, or all
    of it) starts with, read from its first ``16 + 8 * ndim`` bytes; ``None`` when
    ``prefix`` does not start with the frame magic or is too short to hold the header.

    Raises :class:`CorruptFrameError` naming the field for a malformed header (version,
    codes, ndim, reserved bytes, block size). Lengths and the checksum, which cover the
    whole frame, are :func:`parse`'s to check.
    """
    buf = bytes(prefix[:MAX_HEADER_BYTES])
    if len(buf) < FIXED_HEADER.size or buf[: len(MAGIC)] != MAGIC:
        return None
    _, version, fmt_code, scaling_code, dtype_code, ndim, scale_dtype_code, reserved, block_size = FIXED_HEADER.unpack(
        buf[: FIXED_HEADER.size]
    )
    if version != VERSION:
        raise CorruptFrameError(f"unsupported frame version {version}; this fp8ray reads version {VERSION}")
    if fmt_code not in FORMATS_BY_CODE and fmt_code != STORED_CODE:
        raise CorruptFrameError(f"unknown fp8 format code {fmt_code} in frame header")
    if scaling_code not in SCALINGS_BY_CODE:
        raise CorruptFrameError(f"unknown scaling code {scaling_code} in frame header")
    if dtype_code not in DTYPE_NAMES_BY_CODE:
        raise CorruptFrameError(f"unknown dtype code {dtype_code} in frame header")
    dtype = DTYPE_NAMES_BY_CODE[dtype_code]
    if (fmt_code == STORED_CODE) != is_stored(dtype):
        kind = "a stored frame" if fmt_code == STORED_CODE else "an fp8 frame"
        raise CorruptFrameError(f"dtype {dtype} (code {dtype_code}) is invalid for {kind}")
    if fmt_code == STORED_CODE and scaling_code != SCALINGS["none"]:
        raise CorruptFrameError(f"scaling code {scaling_code} is invalid for a stored frame, which has no scales")
    if ndim > MAX_NDIM:
        raise CorruptFrameError(f"ndim {ndim} in frame header exceeds {MAX_NDIM}")
    if scale_dtype_code not in SCALE_DTYPES_BY_CODE:
        raise CorruptFrameError(f"unknown scale dtype code {scale_dtype_code} in frame header")
    if reserved != b"\0\0":
        raise CorruptFrameError(f"reserved header bytes are {reserved.hex()}, expected zero")
    scaling = SCALINGS_BY_CODE[scaling_code]
    if (scaling == "block") != (block_size > 0):
        raise CorruptFrameError(f"block_size {block_size} is invalid for scaling {scaling!r}")
    scale_dtype = SCALE_DTYPES_BY_CODE[scale_dtype_code]
    if scaling == "none" and scale_dtype != "float32":
        raise CorruptFrameError(f"scale dtype {scale_dtype!r} is invalid for scaling 'none', which stores no scales")
    shape_end = FIXED_HEADER.size + 8 * ndim
    if len(buf) < shape_end:
        return None
    shape = struct.unpack(f"<{ndim}Q", buf[FIXED_HEADER.size : shape_end])
    return FrameHeader(FORMATS_BY_CODE.get(fmt_code), scaling, dtype, shape, block_size, scale_dtype)


def parse(buf: np.ndarray) -> FrameHeader:
    """Validate a whole frame (structure, lengths, checksum) and return its header.

    Raises :class:`CorruptFrameError` naming the field and the numbers on any problem.
    Nothing is allocated from header values before they are checked against the
    frame's real length.
    """
    header = parse_layout(buf)
    verify(buf, header)
    return header


def parse_layout(buf: np.ndarray) -> FrameHeader:
    """:func:`parse` but for the checksum, which the caller must :func:`verify` before it
    trusts anything read from the frame (the decoder takes the codes' CRC as it decodes them)."""
    size = buf.size
    minimum = FIXED_HEADER.size + CHECKSUM_BYTES
    if size < minimum:
        raise CorruptFrameError(f"frame truncated: {size} bytes, a frame has at least {minimum}")
    header = parse_header(buf[: size - CHECKSUM_BYTES])  # the header ends before the checksum
    if header is None:  # say which of parse_header's two reasons it is
        magic = buf[: len(MAGIC)].tobytes()
        if magic != MAGIC:
            raise CorruptFrameError(f"bad magic {magic!r}, expected {MAGIC!r}: not an fp8ray frame")
        ndim = FIXED_HEADER.unpack(buf[: FIXED_HEADER.size].tobytes())[5]
        needs = FIXED_HEADER.size + 8 * ndim + CHECKSUM_BYTES
        raise CorruptFrameError(f"frame truncated: {size} bytes, its {ndim}-d shape needs {needs}")
    expected = header.frame_size  # Python ints: a corrupt shape cannot overflow here
    if expected != size:
        # Which one cannot be told: a flipped bit in the shape reads as either.
        kind = "truncated" if size < expected else "has trailing bytes"
        raise CorruptFrameError(
            f"frame {kind}, or its header damaged: {size} bytes, but its header (shape {list(header.shape)}) implies {expected}"
        )
    try:  # the encoder's limits; a frame whose size matches its shape is within them
        check_shape(header.shape, header.dtype)
    except ValueError as exc:
        raise CorruptFrameError(f"frame header: {exc}") from None
    return header


def verify(buf: np.ndarray, header: FrameHeader, codes_crc: int | None = None) -> None:
    """Raise :class:`CorruptFrameError` unless the frame's stored CRC-32C is that of its
    bytes. ``codes_crc``: the CRC-32C of its codes where the caller has it (the decoder's
    threads take it): only the bytes before the codes are read then."""
    if codes_crc is None:
        stored, actual = checksums(buf)
    else:
        stored = _stored_checksum(buf)
        actual = checksum.combine(checksum.crc32c(buf[: header.codes_offset]), codes_crc, header.payload_bytes)
    if stored != actual:
        raise CorruptFrameError(f"frame checksum mismatch: stored crc32c {stored:#010x}, computed {actual:#010x}")


def checksums(buf: np.ndarray) -> tuple[int, int]:
    """A whole frame's stored CRC-32C and the one its bytes have."""
    return _stored_checksum(buf), checksum.crc32c(buf[:-CHECKSUM_BYTES])


def _stored_checksum(buf: np.ndarray) -> int:
    return struct.unpack("<I", buf[-CHECKSUM_BYTES:].tobytes())[0]


def _row_checksums(rows: np.ndarray) -> np.ndarray:
    """The CRC-32C of each row of ``rows`` (frames of one size, one a row) but its last 4 bytes."""
    return np.fromiter((checksum.crc32c(row) for row in rows[:, :-CHECKSUM_BYTES]), np.uint32, len(rows))


def seal_rows(rows: np.ndarray) -> None:
    """:func:`seal` each row of ``rows`` (a ``[frames, frame_size]`` uint8 array)."""
    rows[:, -CHECKSUM_BYTES:] = _row_checksums(rows).astype("<u4").view(np.uint8).reshape(len(rows), CHECKSUM_BYTES)


def checksums_hold(rows: np.ndarray) -> bool:
    """Whether each row of ``rows`` (a ``[frames, frame_size]`` uint8 array) holds the
    CRC-32C of its bytes, as :func:`parse` checks one frame's."""
    stored = np.ascontiguousarray(rows[:, -CHECKSUM_BYTES:]).view("<u4").reshape(-1)
    return bool((stored == _row_checksums(rows)).all())


def scales_of(buf: np.ndarray, header: FrameHeader) -> np.ndarray:
    """The frame's scales as fp32, checked to be finite and positive: a view of float32
    scales, a new array for bfloat16 ones (widened exactly: bf16 bits are fp32's top half)."""
    scales = widen_scales(buf[header.scales_offset : header.codes_offset], header.scale_dtype)
    if scales.size and not scales_valid(scales):
        bad = int(np.flatnonzero(~(np.isfinite(scales) & (scales > 0)))[0])
        raise CorruptFrameError(f"scale {bad} of the frame is {float(scales[bad])}, expected a finite positive number")
    return scales


def widen_scales(raw: np.ndarray, scale_dtype: str) -> np.ndarray:
    """Stored scales (their bytes) as fp32: a view of float32 ones where aligned, a new
    array for bfloat16 ones (widened exactly: bf16 bits are fp32's top half)."""
    if scale_dtype == "bfloat16":  # one pass (the old copy, widening and shift took 4)
        return np.left_shift(raw.view("<u2"), 16, dtype=np.uint32).view(np.float32)
    return raw.view(np.float32) if raw.ctypes.data % 4 == 0 else raw.copy().view(np.float32)


def scales_valid(scales: np.ndarray) -> bool:
    """Whether every scale is finite and positive, as every frame's must be: its bits,
    read as an unsigned integer, lie between those of the smallest positive fp32 and of
    the largest finite one (a least and a greatest of the bits, not four array passes)."""
    bits = scales.view(np.uint32)
    return bits.size == 0 or bool(bits.min() >= 1 and bits.max() <= 0x7F7FFFFF)


def may_overflow(header: FrameHeader, scales: np.ndarray) -> bool:
    """Whether a finite code times one of ``scales`` (fp32, checked finite and positive)
    could pass the largest value of the frame's dtype. Never so in a frame fp8ray writes
    (a group's codes decode to at most its amax) but for ``mse`` scales near the dtype's
    range (``amax / c``, ``c`` down to half of finfo.max); then :func:`refuse_overflow`
    looks at what was decoded. Positive floats order as their bits do."""
    return bool(scales.size) and int(scales.view(np.uint32).max()) > _overflow_bits(header)


def suspect_scales(buf: np.ndarray, header: FrameHeader) -> bool:
    """Whether the frame's scales, as stored, are not all finite and positive or
    :func:`may_overflow`: a look at their bits, without widening them, for a reader that
    checks frames without decoding them (``verify``); such a frame is then decoded."""
    raw = buf[header.scales_offset : header.codes_offset]
    if not raw.size:
        return False
    shift = 16 if header.scale_dtype == "bfloat16" else 0  # a bfloat16 scale is fp32's top half
    bits = raw.view("<u2" if shift else "<u4")
    return bool(bits.min() < 1 or int(bits.max()) > _overflow_bits(header) >> shift)


def _overflow_bits(header: FrameHeader) -> int:
    """The bits of the largest fp32 scale that no finite code can take past the dtype's
    largest value (finfo.max times it stays within): any scale above may overflow."""
    bound = LARGEST[header.dtype] / header.fmt.max
    scale = np.float32(bound)
    if float(scale) > bound:  # rounded up: the fp32 below it
        scale = np.nextafter(scale, np.float32(0))
    return int(scale.view(np.uint32))


def refuse_overflow(header: FrameHeader, scales: np.ndarray, codes: np.ndarray, decoded: np.ndarray) -> None:
    """Raise :class:`CorruptFrameError` where a finite code of the frame decoded to an
    infinity (``decoded``: its elements as the kernels write them): a scale too large for
    its codes, which fp8ray never writes (altered, its checksum made to match, or written
    by another encoder); an infinity the source never held is not handed back."""
    if not may_overflow(header, scales):
        return
    flat = decoded.reshape(-1)
    infinite = np.isinf(flat) if header.dtype == "float32" else (flat & 0x7FFF) == INFINITY_BITS[header.dtype]
    overflowed = infinite & (codes != header.fmt.posinf_code) & (codes != header.fmt.neginf_code)
    if overflowed.any():
        first = int(np.flatnonzero(overflowed)[0])
        raise CorruptFrameError(
            f"{int(overflowed.sum())} finite code(s) decode to inf in {header.dtype}, the first (code "
            f"{int(codes[first]):#04x}) at index {element_index(first, header.shape)}: its scale is too large for its "
            "codes, which fp8ray never writes (a scale altered and the checksum made to match, or another encoder's frame)"
        )


def element_index(flat: int, shape: tuple[int, ...]) -> list[int]:
    """The index of element ``flat`` (row-major) of a ``shape`` tensor, as messages name it."""
    return [int(i) for i in np.unravel_index(flat, shape)] if shape else []


def codes_of(buf: np.ndarray, header: FrameHeader) -> np.ndarray:
    """The frame's codes (a stored frame's: the tensor's bytes)."""
    return buf[header.codes_offset : header.codes_offset + header.payload_bytes]


def store_into(buf: np.ndarray, header: FrameHeader, data: np.ndarray) -> None:
    """The stored frame of ``header`` holding ``data`` (the tensor's bytes, a 1-D uint8
    array of ``header.payload_bytes``) into ``buf``, sealed."""
    write_header(buf, header)
    codes_of(buf, header)[:] = data
    seal(buf)
