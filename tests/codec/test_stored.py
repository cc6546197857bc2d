"""Stored frames: a tensor of a dtype fp8 does not encode (integers, booleans, float64,
fp8) is framed as its own bytes, checked like any frame and given back bit for bit."""

from __future__ import annotations

import struct

import crc32c
import numpy as np
import pytest
import torch
from _util import random_bits, tensor_bytes

import fp8ray
from fp8ray import CorruptFrameError, Fp8Codec
from fp8ray.codec import frame
from fp8ray.codec.blocks import Block
from fp8ray.codec.fp8codec import decode_raw
from fp8ray.codec.names import STORED_DTYPE_CODES
from fp8ray.errors import MismatchError

STORED = sorted(STORED_DTYPE_CODES)
# float64 warns that it is stored, not compressed: tested once below, quiet elsewhere.
pytestmark = pytest.mark.filterwarnings("ignore:a float64 tensor is stored")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and tensor_bytes(a) == tensor_bytes(b)


@pytest.mark.parametrize("dtype", STORED)
@pytest.mark.parametrize("shape", [(3, 5), (), (0, 4), (2, 1, 7)], ids=str)
def test_every_stored_dtype_comes_back_bit_for_bit(dtype, shape):
    x = random_bits(dtype, shape)
    codec = Fp8Codec()
    f = codec.encode(x)
    itemsize = getattr(torch, dtype).itemsize
    assert len(f) == codec.encoded_size(shape, dtype) == 16 + 8 * len(shape) + x.numel() * itemsize + 4
    assert same_bits(fp8ray.decode(f), x)
    raw = decode_raw(f, dtype, shape)
    assert raw.tobytes() == tensor_bytes(x)
    assert bytes(codec.encode_raw(raw, dtype, shape)) == bytes(f)  # the same frame from its bytes


@pytest.mark.parametrize("dtype", STORED)
def test_every_codec_option_makes_the_same_stored_frame(dtype):
    x = random_bits(dtype, (4, 64), seed=1)
    frames = {
        bytes(Fp8Codec(fp8, scaling, 16, scale_dtype=sd).encode(x))
        for fp8 in ("e4m3fn", "e5m2")
        for scaling in ("none", "tensor", "channel", "token", "block")
        for sd in ("float32", "bfloat16")
    }
    assert len(frames) == 1


def test_stored_layout_matches_the_spec():
    """Built by hand from docs/FORMAT.md: format code 0, scaling 0, the dtype's code, no
    scales, the tensor's little-endian bytes, the CRC-32C of everything before it."""
    x = torch.tensor([[1, -2, 3], [2**40, 0, -(2**62)]], dtype=torch.int64)
    f = bytes(Fp8Codec().encode(x))
    header = struct.pack("<4sBBBBBB2sI", b"FP8R", 1, 0, 0, 11, 2, 0, b"\0\0", 0) + struct.pack("<2Q", 2, 3)
    body = header + struct.pack("<6q", 1, -2, 3, 2**40, 0, -(2**62))
    assert f == body + struct.pack("<I", crc32c.crc32c(body))
    hand = bytearray(body + struct.pack("<I", crc32c.crc32c(body)))
    assert torch.equal(fp8ray.decode(hand), x)


def test_floats_fp8_does_not_encode_keep_every_bit():
    """float64 is stored, not quantized: NaN payloads, infinities, negative zero and
    subnormals come back as they went in, whatever the non-finite policy (nothing is lost
    to refuse)."""
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 5e-324, 1e308], dtype=torch.float64)
    x[0:1].view(torch.int64)[0] = 0x7FF0_0000_0000_1234  # a NaN with a payload
    y = fp8ray.decode(Fp8Codec(nonfinite="error").encode(x))
    assert same_bits(y, x)


def test_the_dtype_tables_agree_with_each_other_and_with_torch():
    """The dtypes a frame holds are written in three tables (wire codes, item sizes,
    safetensors names): each names the same dtypes, at torch's own item size."""
    from fp8ray.codec.formats import DTYPE_ITEMSIZES, FRAME_DTYPE_CODES
    from fp8ray.io.safetensors import SOURCE_DTYPES

    assert set(DTYPE_ITEMSIZES) == set(FRAME_DTYPE_CODES) == set(SOURCE_DTYPES.values())
    assert len(set(FRAME_DTYPE_CODES.values())) == len(FRAME_DTYPE_CODES)
    assert {name: getattr(torch, name).itemsize for name in DTYPE_ITEMSIZES} == DTYPE_ITEMSIZES


def test_float64_warns_that_it_is_stored_not_compressed_and_nothing_else_does():
    with pytest.warns(UserWarning, match=r"a float64 tensor is stored as it is \(8 bytes per element\).*x.float\(\)"):
        Fp8Codec().encode(np.zeros(4))  # numpy's default dtype
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Fp8Codec().encode(torch.arange(4))
        Fp8Codec().encode_raw(np.zeros(32, np.uint8), "float64", (4,))  # a file's tensor, as it is


def test_conjugate_and_negative_views_are_stored_by_their_values():
    """torch keeps .conj() and ._neg_view() lazily, as a bit: its bytes are not the values."""
    z = torch.randn(3, 4, dtype=torch.complex64)
    for view, values in ((z.conj(), z.conj().resolve_conj()), (torch.arange(6)._neg_view(), -torch.arange(6))):
        assert torch.equal(fp8ray.decode(Fp8Codec().encode(view)), values)
        assert Block.of("k", view).data.tobytes() == tensor_bytes(values)


def test_numpy_arrays_and_strided_tensors_are_stored():
    a = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]  # not contiguous
    assert np.array_equal(fp8ray.decode(Fp8Codec().encode(a)).numpy(), a)
    t = torch.arange(24, dtype=torch.int16).reshape(4, 6).t()
    assert torch.equal(fp8ray.decode(Fp8Codec().encode(t)), t)
    b = np.array([True, False, True])
    assert np.array_equal(fp8ray.decode(Fp8Codec().encode(b)).numpy(), b)


def test_decoding_into_out_and_refusing_another_tensor():
    x = random_bits("int32", (2, 8))
    f = Fp8Codec().encode(x)
    out = torch.empty(2, 8, dtype=torch.int32)
    assert fp8ray.decode(f, out=out) is out and torch.equal(out, x)
    with pytest.raises(MismatchError, match=r"out is a \(2, 8\) torch.int64 tensor, the frame holds \(2, 8\) int32"):
        fp8ray.decode(f, out=torch.empty(2, 8, dtype=torch.int64))
    with pytest.raises(MismatchError, match=r"expected a \(2, 8\) int64 tensor, the frame holds \(2, 8\) int32"):
        decode_raw(f, "int64", (2, 8))


def test_every_corrupted_byte_of_a_stored_frame_is_caught():
    f = bytes(Fp8Codec().encode(random_bits("int64", (3, 4), seed=2)))
    for i in range(len(f)):
        bad = bytearray(f)
        bad[i] ^= 0x40
        with pytest.raises(CorruptFrameError):
            fp8ray.decode(bad)


def reseal(data: bytearray) -> bytearray:
    data[-4:] = struct.pack("<I", crc32c.crc32c(bytes(data[:-4])))
    return data


@pytest.mark.parametrize(
    "source, offset, value, pattern",
    [
        ("int64", 5, 1, r"dtype int64 \(code 11\) is invalid for an fp8 frame"),
        ("bfloat16", 5, 0, r"dtype bfloat16 \(code 3\) is invalid for a stored frame"),
        ("int64", 6, 4, r"scaling code 4 is invalid for a stored frame"),
        ("int64", 7, 9, r"frame has trailing bytes, or its header damaged: .* implies"),  # int32's code: half the bytes
    ],
)
def test_a_stored_frame_header_that_contradicts_itself_is_refused(source, offset, value, pattern):
    """Even with a valid checksum: a reader never takes a stored frame's bytes for codes,
    nor codes for a tensor's bytes."""
    x = random_bits(source, (2, 4)) if source != "bfloat16" else torch.ones(2, 4, dtype=torch.bfloat16)
    bad = bytearray(Fp8Codec(scaling="none").encode(x))
    bad[offset] = value
    if offset == 6 and value == 4:
        bad[12:16] = struct.pack("<I", 4)  # a block size, as block scaling needs
    with pytest.raises(CorruptFrameError, match=pattern):
        fp8ray.decode(reseal(bad))


def test_header_for_gives_the_stored_header_under_any_options():
    header = frame.header_for(Fp8Codec(scaling="token").options, "uint8", (2, 3))
    assert header == frame.stored_header("uint8", (2, 3)) and header.stored
    assert frame.layout_label(header) == "stored as is"
    assert frame.parse(np.frombuffer(bytes(Fp8Codec().encode(torch.zeros(2, 3, dtype=torch.uint8))), np.uint8)) == header


def test_a_torch_without_a_dtype_still_encodes_and_names_the_one_it_lacks(monkeypatch):
    """torch before 2.7 has no float8_e8m0fnu: building the dtype tables raised, and the
    first encode of any tensor failed ("cannot import name 'DTYPE_NAMES'"). The codec works;
    only a block of that dtype, as a tensor, is refused, naming it; its bytes still read."""
    from fp8ray.codec import formats
    from fp8ray.errors import BadInputError

    codes = np.arange(16, dtype=np.uint8)
    stored = bytes(Fp8Codec().encode(torch.from_numpy(codes).view(torch.float8_e8m0fnu)))
    monkeypatch.delattr(torch, "float8_e8m0fnu")
    formats._torch_tables.cache_clear()
    try:
        x = torch.randn(4, 64).bfloat16()
        assert torch.equal(fp8ray.decode(Fp8Codec().encode(x)), fp8ray.decode(Fp8Codec().encode(x)))
        with pytest.raises(BadInputError, match=r"^dtype float8_e8m0fnu is not in this torch \("):
            fp8ray.decode(stored)
        assert decode_raw(stored, "float8_e8m0fnu", (16,)).tobytes() == codes.tobytes()
    finally:
        monkeypatch.undo()
        formats._torch_tables.cache_clear()
