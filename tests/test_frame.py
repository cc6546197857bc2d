"""The frame: every corruption is caught, every truncation refused, nothing over-allocated."""

from __future__ import annotations

import struct

import crc32c
import numpy as np
import pytest
import torch
from _util import SCALINGS, kv_like

import fp8ray
from fp8ray import CorruptFrameError, Fp8Codec, frame


def small_frame(scaling="token") -> bytes:
    return bytes(Fp8Codec("e4m3fn", scaling, block_size=5).encode(kv_like((2, 3, 8), torch.bfloat16, seed=3)))


def reseal(data: bytearray) -> bytearray:
    data[-4:] = struct.pack("<I", crc32c.crc32c(bytes(data[:-4])))
    return data


def test_layout_matches_the_spec():
    x = kv_like((2, 3, 8), torch.bfloat16)
    f = bytes(Fp8Codec("e5m2", "block", block_size=5).encode(x))
    magic, version, fmt, scaling, dtype, ndim, reserved, block = struct.unpack("<4sBBBBB3sI", f[:16])
    assert (magic, version, fmt, scaling, dtype, ndim, reserved, block) == (b"FP8R", 1, 2, 4, 3, 3, b"\0\0\0", 5)
    assert struct.unpack("<3Q", f[16:40]) == (2, 3, 8)
    n_scales = -(-48 // 5)
    assert len(f) == 40 + 4 * n_scales + 48 + 4
    assert struct.unpack("<I", f[-4:])[0] == crc32c.crc32c(f[:-4])


@pytest.mark.parametrize("scaling", SCALINGS)
def test_every_single_byte_corruption_is_detected(scaling):
    """Each byte of the frame replaced by each of several other values: always an error.

    CRC-32C detects every burst of up to 32 bits, so no single-byte change can pass."""
    good = small_frame(scaling)
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


@pytest.mark.parametrize("scaling", SCALINGS)
def test_truncation_at_every_length_is_refused(scaling):
    good = small_frame(scaling)
    for length in range(len(good)):
        with pytest.raises(CorruptFrameError):
            fp8ray.decode(good[:length])
    with pytest.raises(CorruptFrameError, match="trailing bytes"):
        fp8ray.decode(good + b"\0")


def test_huge_shape_in_header_is_refused_before_allocation():
    bad = bytearray(small_frame())
    bad[16:24] = struct.pack("<Q", 2**60)  # a shape claiming an exabyte, correctly checksummed
    with pytest.raises(CorruptFrameError, match=r"truncated: \d+ bytes, but its header .* implies"):
        fp8ray.decode(reseal(bad))


@pytest.mark.parametrize(
    "offset, value, pattern",
    [
        (0, b"XXXX", "bad magic"),
        (4, b"\x02", "unsupported frame version 2"),
        (5, b"\x09", "unknown fp8 format code 9"),
        (6, b"\x07", "unknown scaling code 7"),
        (7, b"\x08", "unknown dtype code 8"),
        (8, b"\xc8", "ndim 200 in frame header exceeds 64"),
        (9, b"\x01", "reserved header bytes"),
        (12, b"\x04", "block_size 4 is invalid for scaling 'token'"),
    ],
)
def test_header_fields_are_validated_by_name(offset, value, pattern):
    bad = bytearray(small_frame())
    bad[offset : offset + len(value)] = value
    with pytest.raises(CorruptFrameError, match=pattern):
        fp8ray.decode(reseal(bad))


def test_nan_scale_is_refused_even_with_a_valid_checksum():
    good = small_frame("token")
    bad = bytearray(good)
    header = frame.parse(np.frombuffer(good, np.uint8))
    bad[header.scales_offset : header.scales_offset + 4] = struct.pack("<f", float("nan"))
    with pytest.raises(CorruptFrameError, match="scale 0 of the frame is nan"):
        fp8ray.decode(reseal(bad))


def test_non_bytes_like_is_a_type_error():
    with pytest.raises(TypeError, match="a frame must be bytes-like, got int"):
        fp8ray.decode(12)
    with pytest.raises(TypeError, match="uint8"):
        fp8ray.decode(np.zeros(30, dtype=np.float32))
