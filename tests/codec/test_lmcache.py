"""fp8ray.lmcache matches LMCache's fp8 serde byte for byte where the seed's cast is finite."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _util import DTYPES, kv_like

from fp8ray.lmcache import (
    Fp8QuantizationDeserializer,
    Fp8QuantizationSerializer,
    MemoryLayoutDesc,
    make_fp8_serde,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def obj(t):
    return SimpleNamespace(tensor=t)


def seed_serialize(src: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """What the seed writes: ``src.to(fp8).contiguous().view(uint8).flatten()``."""
    return src.to(fp8_dtype).contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_serialize_matches_seed_bytes_in_range(fp8_dtype, dtype):
    fmax = torch.finfo(fp8_dtype).max
    src = kv_like((2, 4, 32, 64), dtype, seed=1).float().clamp(-fmax, fmax).to(dtype)
    dst = torch.full((src.numel() + 100,), 0xAB, dtype=torch.uint8)
    n = Fp8QuantizationSerializer(fp8_dtype).serialize(obj(src), obj(dst))
    assert n == src.numel()
    assert torch.equal(dst[:n], seed_serialize(src, fp8_dtype))
    assert (dst[n:] == 0xAB).all()  # nothing written past the payload


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_out_of_range_saturates(fp8_dtype):
    fmax = torch.finfo(fp8_dtype).max
    src = torch.tensor([fmax * 1.5, -fmax * 8, 1e30, -1e30, 1.0])
    dst = torch.empty(5, dtype=torch.uint8)
    Fp8QuantizationSerializer(fp8_dtype).serialize(obj(src), obj(dst))
    assert dst.view(fp8_dtype).float().tolist() == [fmax, -fmax, fmax, -fmax, 1.0]


def test_nonfinite_input_raises_unless_kept():
    src = torch.tensor([1.0, float("nan"), float("inf")])
    dst = torch.empty(3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"2 non-finite value\(s\).*index \[1\]"):
        Fp8QuantizationSerializer().serialize(obj(src), obj(dst))
    Fp8QuantizationSerializer(torch.float8_e5m2, nonfinite="keep").serialize(obj(src), obj(dst))
    back = dst.view(torch.float8_e5m2).float()
    assert back[0] == 1 and torch.isnan(back[1]) and back[2] == float("inf")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_deserialize_matches_seed(fp8_dtype, dtype):
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)
    src = torch.cat([codes, torch.zeros(10, dtype=torch.uint8)])  # a longer buffer, as LMCache pads
    dst = torch.empty(4, 256, dtype=dtype)
    Fp8QuantizationDeserializer(fp8_dtype).deserialize(obj(src), obj(dst))
    expected = codes.view(fp8_dtype).reshape(4, 256).to(dtype)
    nan = torch.isnan(expected)
    assert torch.isnan(dst[nan]).all()
    assert torch.equal(dst[~nan], expected[~nan])


def test_deserialize_into_non_contiguous_dst():
    src = seed_serialize(kv_like((8, 16), torch.float32).clamp(-400, 400), torch.float8_e4m3fn)
    dst = torch.empty(16, 8, dtype=torch.bfloat16).t()
    Fp8QuantizationDeserializer().deserialize(obj(src), obj(dst))
    assert torch.equal(dst, src.view(torch.float8_e4m3fn).reshape(8, 16).to(torch.bfloat16))


def test_round_trip_through_both():
    src = kv_like((2, 30, 16, 64), torch.bfloat16, seed=4).float().clamp(-448, 448).to(torch.bfloat16)
    ser, de = make_fp8_serde({"fp8_dtype": "float8_e4m3fn"})
    layout = MemoryLayoutDesc(shapes=[src.shape], dtypes=[src.dtype])
    buf = torch.empty(ser.estimate_serialized_size(layout), dtype=torch.uint8)
    assert ser.serialize(obj(src), obj(buf)) == buf.numel()
    out = torch.empty_like(src)
    de.deserialize(obj(buf), obj(out))
    assert torch.equal(out, src.to(torch.float8_e4m3fn).to(torch.bfloat16))


def test_estimate_is_one_byte_per_element():
    layout = MemoryLayoutDesc(shapes=[torch.Size([2, 30, 256, 192]), (3, 5)], dtypes=[torch.bfloat16] * 2)
    assert Fp8QuantizationSerializer().estimate_serialized_size(layout) == 2 * 30 * 256 * 192 + 15


def test_sizes_are_checked_and_named():
    with pytest.raises(ValueError, match="dst holds 10 bytes but src needs 12"):
        Fp8QuantizationSerializer().serialize(obj(torch.ones(3, 4)), obj(torch.empty(10, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="src holds 5 bytes but dst needs 6"):
        Fp8QuantizationDeserializer().deserialize(obj(torch.zeros(5, dtype=torch.uint8)), obj(torch.empty(2, 3)))


def test_missing_tensors_and_bad_buffers():
    with pytest.raises(ValueError, match="requires src and dst to have tensors"):
        Fp8QuantizationSerializer().serialize(obj(None), obj(torch.empty(3, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="requires src and dst to have tensors"):
        Fp8QuantizationDeserializer().deserialize(obj(torch.empty(3, dtype=torch.uint8)), SimpleNamespace())
    with pytest.raises(ValueError, match="dst must be a 1-byte buffer"):
        Fp8QuantizationSerializer().serialize(obj(torch.ones(3)), obj(torch.empty(3)))
    with pytest.raises(ValueError, match="must be contiguous"):
        Fp8QuantizationSerializer().serialize(obj(torch.ones(3)), obj(torch.empty(3, 2, dtype=torch.uint8).t()))
    with pytest.raises(TypeError, match="unsupported dtype torch.int32"):
        Fp8QuantizationSerializer().serialize(obj(torch.ones(3, dtype=torch.int32)), obj(torch.empty(3, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="Unknown torch dtype: 'float8_e9m9'"):
        make_fp8_serde({"fp8_dtype": "float8_e9m9"})
