"""The frame: every corruption is caught, every truncation refused, nothing over-allocated."""

from __future__ import annotations

import struct

import crc32c
import numpy as np
import pytest
import torch
from _util import SCALINGS, assert_same_bits, kv_like

import fp8ray
from fp8ray import CorruptFrameError, Fp8Codec
from fp8ray.codec import cpu, frame, reference
from fp8ray.codec.formats import FORMATS


def small_frame(scaling="token", scale_dtype="float32") -> bytes:
    codec = Fp8Codec("e4m3fn", scaling, block_size=5, scale_dtype=scale_dtype)
    return bytes(codec.encode(kv_like((2, 3, 8), torch.bfloat16, seed=3)))


# Every scaling with float32 scales, and the scaled ones with bfloat16 scales.
LAYOUTS = [(s, "float32") for s in SCALINGS] + [(s, "bfloat16") for s in SCALINGS if s != "none"]


def reseal(data: bytearray) -> bytearray:
    data[-4:] = struct.pack("<I", crc32c.crc32c(bytes(data[:-4])))
    return data


def test_layout_matches_the_spec():
    x = kv_like((2, 3, 8), torch.bfloat16)
    f = bytes(Fp8Codec("e5m2", "block", block_size=5, scale_dtype="float32").encode(x))
    magic, version, fmt, scaling, dtype, ndim, scale_dtype, reserved, block = struct.unpack("<4sBBBBBB2sI", f[:16])
    assert (magic, version, fmt, scaling, dtype, ndim, scale_dtype, reserved, block) == (b"FP8R", 1, 2, 4, 3, 3, 0, b"\0\0", 5)
    assert struct.unpack("<3Q", f[16:40]) == (2, 3, 8)
    n_scales = -(-48 // 5)
    assert len(f) == 40 + 4 * n_scales + 48 + 4
    assert struct.unpack("<I", f[-4:])[0] == crc32c.crc32c(f[:-4])


def test_bfloat16_scales_layout_matches_the_spec():
    """Byte 9 is 1 and each scale takes 2 bytes: the top half of the fp32 scale the
    reference computes (which has zero low bits)."""
    x = kv_like((2, 3, 8), torch.bfloat16)
    f = bytes(Fp8Codec("e4m3fn", "block", block_size=5, scale_dtype="bfloat16", scale_choice="amax").encode(x))
    assert f[9] == 1 and f[10:12] == b"\0\0"
    n_scales = -(-48 // 5)
    assert len(f) == 40 + 2 * n_scales + 48 + 4
    _, ref_scales, _ = reference.quantize(x, FORMATS["e4m3fn"], "block", 5, False, "bfloat16")
    bits = ref_scales.numpy().view(np.uint32)
    assert (bits & 0xFFFF == 0).all()
    assert struct.unpack(f"<{n_scales}H", f[40 : 40 + 2 * n_scales]) == tuple(int(b) >> 16 for b in bits)


def test_a_frame_built_from_the_spec_decodes():
    """A frame assembled by hand from docs/FORMAT.md (the version-1 layout as first
    written, reserved bytes zero) decodes to fp8 * scale: older frames read unchanged."""
    codes = np.arange(0, 256, 16, dtype=np.uint8)  # 16 e4m3fn codes, NaN-free
    scales = np.array([0.5, 3.0], dtype=np.float32)
    body = struct.pack("<4sBBBBB3sI", b"FP8R", 1, 1, 3, 1, 2, b"\0\0\0", 0) + struct.pack("<2Q", 2, 8)
    body += scales.tobytes() + codes.tobytes()
    out = fp8ray.decode(body + struct.pack("<I", crc32c.crc32c(body)))
    expected = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().reshape(2, 8) * torch.from_numpy(scales)[:, None]
    assert out.dtype == torch.float32 and torch.equal(out, expected)


@pytest.mark.parametrize("scaling, scale_dtype", LAYOUTS)
def test_every_single_byte_corruption_is_detected(scaling, scale_dtype):
    """Each byte of the frame replaced by each of several other values: always an error.

    CRC-32C detects every burst of up to 32 bits, so no single-byte change can pass."""
    good = small_frame(scaling, scale_dtype)
    expected = fp8ray.decode(good)
    for pos in range(len(good)):
        for delta in (0x01, 0x80, 0xFF, 0x5A):
            bad = bytearray(good)
            bad[pos] ^= delta
            try:
                out = fp8ray.decode(bad)
            except CorruptFrameError:
                continue
            assert torch.equal(out, expected), f"byte {pos} ^ {delta:#x} decoded to different data"
            pytest.fail(f"byte {pos} ^ {delta:#x} went unnoticed")


@pytest.mark.parametrize("scaling", ["none", "tensor", "channel", "token", "block"])
def test_corrupt_codes_are_caught_in_every_decode_task(scaling):
    """A frame of several decode tasks (the CPU decoder checks the codes' CRC in pieces,
    one per task): a flipped byte in the first, a middle and the last task's codes, or in
    the header, raises, into a new tensor and into ``out``."""
    x = kv_like((3, cpu.CHUNK_ELEMENTS // 64, 64), torch.bfloat16, seed=5)  # 3 tasks' worth, at least
    good = bytes(Fp8Codec("e4m3fn", scaling, block_size=32).encode(x))
    header = frame.parse(np.frombuffer(good, np.uint8))
    assert torch.equal(fp8ray.decode(good, threads=2), fp8ray.decode(good, threads=1))
    # The format byte, the dtype byte turned into another valid dtype (bfloat16 3 to
    # float16 2: the frame keeps its length, and must read as damage, not as a mismatch
    # with out), then codes and checksum.
    codes = header.codes_offset
    for pos, flip in ((5, 0x10), (7, 0x01), (codes, 0x10), (codes + header.numel // 2 + 7, 0x10), (len(good) - 1, 0x10)):
        bad = bytearray(good)
        bad[pos] ^= flip
        for threads in (1, 2):
            with pytest.raises(CorruptFrameError):
                fp8ray.decode(bad, threads=threads)
            with pytest.raises(CorruptFrameError):
                fp8ray.decode(bad, out=torch.empty_like(x), threads=threads)


@pytest.mark.parametrize("scaling, scale_dtype", LAYOUTS)
def test_truncation_at_every_length_is_refused(scaling, scale_dtype):
    good = small_frame(scaling, scale_dtype)
    for length in range(len(good)):
        with pytest.raises(CorruptFrameError):
            fp8ray.decode(good[:length])
    with pytest.raises(CorruptFrameError, match="trailing bytes"):
        fp8ray.decode(good + b"\0")


def test_huge_shape_in_header_is_refused_before_allocation():
    bad = bytearray(small_frame())
    bad[16:24] = struct.pack("<Q", 2**60)  # a shape claiming an exabyte, correctly checksummed
    with pytest.raises(CorruptFrameError, match=r"truncated, or its header damaged: \d+ bytes, but its header .* implies"):
        fp8ray.decode(reseal(bad))


@pytest.mark.parametrize("dtype_code, itemsize", [(1, 4), (2, 2), (3, 2)])  # float32, float16, bfloat16
def test_an_empty_shape_numpy_cannot_make_is_a_corrupt_frame(dtype_code, itemsize):
    """[2**62, 0] of float32: its non-zero dimensions times 4 bytes pass what numpy can
    make, even empty. A frame of it (36 bytes, checksum right) raised numpy's own
    ValueError from decode; the encoder never writes one."""
    for first, refused in ((2**63 // itemsize, True), ((2**63 - 1) // itemsize, False)):
        body = struct.pack("<4sBBBBB3sI", b"FP8R", 1, 1, 0, dtype_code, 2, b"\0\0\0", 0) + struct.pack("<2Q", first, 0)
        data = body + struct.pack("<I", crc32c.crc32c(body))
        if refused:
            with pytest.raises(CorruptFrameError, match=f"frame header: shape \\[{first}, 0\\]: its non-zero dimensions"):
                fp8ray.decode(data)
        else:
            assert fp8ray.decode(data).shape == (first, 0)


@pytest.mark.parametrize(
    "offset, value, pattern",
    [
        (0, b"XXXX", "bad magic"),
        (4, b"\x02", "unsupported frame version 2"),
        (5, b"\x09", "unknown fp8 format code 9"),
        (6, b"\x07", "unknown scaling code 7"),
        (7, b"\x63", "unknown dtype code 99"),
        (7, b"\x08", r"dtype uint16 \(code 8\) is invalid for an fp8 frame"),
        (8, b"\xc8", "ndim 200 in frame header exceeds 64"),
        (9, b"\x07", "unknown scale dtype code 7"),
        (10, b"\x01", "reserved header bytes"),
        (11, b"\x80", "reserved header bytes"),
        (12, b"\x04", "block_size 4 is invalid for scaling 'token'"),
    ],
)
def test_header_fields_are_validated_by_name(offset, value, pattern):
    bad = bytearray(small_frame())
    bad[offset : offset + len(value)] = value
    with pytest.raises(CorruptFrameError, match=pattern):
        fp8ray.decode(reseal(bad))


def test_scale_dtype_under_scaling_none_is_refused():
    bad = bytearray(small_frame("none"))
    bad[9] = 1
    with pytest.raises(CorruptFrameError, match="scale dtype 'bfloat16' is invalid for scaling 'none'"):
        fp8ray.decode(reseal(bad))


@pytest.mark.parametrize("scale_dtype, nan_bytes", [("float32", struct.pack("<f", float("nan"))), ("bfloat16", b"\xc0\x7f")])
def test_nan_scale_is_refused_even_with_a_valid_checksum(scale_dtype, nan_bytes):
    good = small_frame("token", scale_dtype)
    bad = bytearray(good)
    header = frame.parse(np.frombuffer(good, np.uint8))
    second = header.scales_offset + len(nan_bytes)  # scale 1
    bad[second : second + len(nan_bytes)] = nan_bytes
    with pytest.raises(CorruptFrameError, match="scale 1 of the frame is nan"):
        fp8ray.decode(reseal(bad))


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), 0.0, -0.0, -1.0, -(2.0**-130)])
def test_every_scale_not_finite_and_positive_is_refused(scale_dtype, value):
    """The check on the scales' bits (between the smallest positive fp32 and the largest
    finite one) refuses each kind, and accepts a subnormal positive scale."""
    good = small_frame("token", scale_dtype)
    header = frame.parse(np.frombuffer(good, np.uint8))
    width = 4 if scale_dtype == "float32" else 2
    second = header.scales_offset + width  # scale 1

    def with_scale(x: float) -> bytes:
        bad = bytearray(good)
        bad[second : second + width] = struct.pack("<f", x)[4 - width :]
        return reseal(bad)

    with pytest.raises(CorruptFrameError, match=f"scale 1 of the frame is {value}, expected a finite positive number"):
        fp8ray.decode(with_scale(value))
    assert torch.isfinite(fp8ray.decode(with_scale(2.0**-130))).all()


def test_non_bytes_like_is_a_type_error():
    with pytest.raises(TypeError, match="a frame must be bytes-like, got int"):
        fp8ray.decode(12)
    with pytest.raises(TypeError, match="uint8"):
        fp8ray.decode(np.zeros(30, dtype=np.float32))


def test_parse_header_reads_a_prefix_with_parses_checks():
    """One header parser: from a prefix (no checksum, no codes) it gives parse's header;
    a prefix too short for the header, or not a frame, gives None; a malformed field
    raises what parse raises."""
    good = small_frame("token")
    whole = frame.parse(np.frombuffer(good, np.uint8))
    assert frame.parse_header(good[: whole.scales_offset]) == whole
    assert frame.parse_header(good[: whole.scales_offset - 1]) is None
    assert frame.parse_header(good[:15]) is None and frame.parse_header(b"XXXX" + good[4:]) is None
    bad = bytearray(good)
    bad[12:16] = struct.pack("<I", 4)  # a block size under token scaling
    with pytest.raises(CorruptFrameError, match="block_size 4 is invalid for scaling 'token'"):
        frame.parse_header(bytes(bad[: whole.scales_offset]))


def _with_scale(good: bytes, index: int, value: float, scale_dtype: str) -> bytes:
    """``good`` with scale ``index`` set to ``value`` (as the frame stores it), resealed."""
    header = frame.parse(np.frombuffer(good, np.uint8))
    width = 4 if scale_dtype == "float32" else 2
    at = header.scales_offset + index * width
    bad = bytearray(good)
    bad[at : at + width] = struct.pack("<f", value)[4 - width :]
    return bytes(reseal(bad))


# A scale each dtype's largest code of a group cannot be multiplied by without passing the
# dtype's largest value (bfloat16's 3e38 is bfloat16-exact enough: truncated, still > 1e38).
TOO_LARGE = {torch.float16: 1e5, torch.bfloat16: 3e38, torch.float32: 3e38}


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_scale_too_large_for_its_codes_is_refused_not_decoded_to_inf(dtype, scale_dtype):
    """A frame whose checksum holds but one of whose scales makes finite codes decode past
    the dtype's range (fp8ray never writes one: a group decodes to at most its amax) is
    refused naming the first such element, by every CPU decode path, not handed back
    holding infinities the source never had."""
    from fp8ray.codec.blocks import decode_rows_into
    from fp8ray.codec.runs import decode_run

    x = kv_like((2, 3, 8), dtype, seed=5)
    good = bytes(Fp8Codec("e4m3fn", "token", scale_dtype=scale_dtype).encode(x))
    bad = _with_scale(good, 1, TOO_LARGE[dtype], scale_dtype)
    header = frame.parse(np.frombuffer(bad, np.uint8))
    scale = float(frame.scales_of(np.frombuffer(bad, np.uint8), header)[1])
    codes = frame.codes_of(np.frombuffer(bad, np.uint8), header)
    # Token scaling: scale 1 covers elements 8..15 (the second row of 8); the first of them
    # whose fp8 value times the scale, in fp32, rounds to inf in the dtype.
    products = (torch.from_numpy(codes[8:16].copy()).view(torch.float8_e4m3fn).float() * scale).to(dtype)
    first = 8 + int(torch.nonzero(torch.isinf(products))[0, 0])
    said = f"decode to inf in {header.dtype}, the first \\(code {int(codes[first]):#04x}\\) at index \\[0, 1, {first - 8}\\]"
    with pytest.raises(CorruptFrameError, match=said):
        fp8ray.decode(bad)
    with pytest.raises(CorruptFrameError, match=said):
        fp8ray.decode_raw(bad, header.dtype, header.shape)
    out = np.empty(2 * x.numel() * x.element_size(), np.uint8)
    run = np.stack([np.frombuffer(good, np.uint8)] * 2)
    assert decode_run(run, header, out)  # two such frames are decoded as one run
    run[1] = np.frombuffer(bad, np.uint8)
    with pytest.raises(CorruptFrameError, match=f"block 'b'.*{said}"):
        decode_rows_into(["a", "b"], run, out, header.dtype, header.shape)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("scaling", ["token", "block"])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_mse_frames_near_float16s_range_decode_as_the_reference(fmt, scaling, scale_dtype):
    """``mse`` scales can be as large as amax / (finfo.max / 2): for float16 groups near
    65504 a finite code times the scale may pass the range, so their decoded values are
    looked at; none of fp8ray's own frames is refused, each decodes bit for bit as the
    reference does, and the infinities ``nonfinite='keep'`` stored (e5m2's own codes;
    NaN in e4m3fn) are not taken for an overflow."""
    codec = Fp8Codec(fmt, scaling, block_size=32, scale_dtype=scale_dtype, scale_choice="mse", nonfinite="keep")
    g = torch.Generator().manual_seed(11)
    looked_at = 0
    for _ in range(40):
        x = ((torch.rand(16, 64, generator=g) * 2 - 1) * 65504).to(torch.float16)
        x[3, 7], x[9, 40] = float("inf"), float("-inf")
        f = codec.encode(x)
        buf = np.frombuffer(bytes(f), np.uint8)
        header = frame.parse(buf)
        scales = frame.scales_of(buf, header)
        looked_at += frame.may_overflow(header, scales)
        y = fp8ray.decode(f)
        expected = reference.dequantize(
            torch.from_numpy(frame.codes_of(buf, header).copy()),
            torch.from_numpy(scales.copy()),
            header.fmt,
            scaling,
            header.shape,
            torch.float16,
            32,
        )
        assert_same_bits(y, expected)
        assert torch.isfinite(y).sum() == x.numel() - 2
        if fmt == "e5m2":
            assert torch.equal(torch.isinf(y), torch.isinf(x)) and torch.equal(y[torch.isinf(y)], x[torch.isinf(x)])
    assert looked_at > 0  # the check on decoded values ran


def test_the_range_tables_are_torchs():
    """The largest value and the bits of +inf of each dtype fp8 encodes, as torch has them."""
    from fp8ray.codec.formats import INFINITY_BITS, KERNEL_TYPES, LARGEST

    assert set(LARGEST) == set(KERNEL_TYPES)
    assert {name: torch.finfo(getattr(torch, name)).max for name in KERNEL_TYPES} == LARGEST
    assert {
        name: int(torch.tensor(float("inf"), dtype=getattr(torch, name)).view(torch.int16)) for name in INFINITY_BITS
    } == INFINITY_BITS


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_overflow_look_on_bits_is_the_products(dtype, scale_dtype):
    """may_overflow and suspect_scales (verify's look at the stored bits) say a frame may
    overflow exactly where its largest scale times finfo.max passes the dtype's largest
    value, scales on each side of that edge included; suspect_scales also for a scale
    that is not finite and positive."""
    from fp8ray.codec.formats import LARGEST

    x = kv_like((2, 3, 8), dtype, seed=3)
    good = bytes(Fp8Codec("e4m3fn", "token", scale_dtype=scale_dtype).encode(x))
    header = frame.parse(np.frombuffer(good, np.uint8))
    edge = np.float32(LARGEST[header.dtype] / header.fmt.max)
    candidates = [edge, np.nextafter(edge, np.float32(0)), np.nextafter(edge, np.float32(np.inf)), np.float32(1.0)]
    candidates += [np.float32(v) for v in np.geomspace(edge / 4, edge * 4, 41)]
    for value in candidates:
        buf = np.frombuffer(_with_scale(good, 1, float(value), scale_dtype), np.uint8)
        scales = frame.scales_of(buf, header)
        expected = float(scales.max()) * header.fmt.max > LARGEST[header.dtype]
        assert frame.may_overflow(header, scales) == expected == frame.suspect_scales(buf, header), float(value)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert frame.suspect_scales(np.frombuffer(_with_scale(good, 1, bad, scale_dtype), np.uint8), header), bad
