"""The CPU path between raw bytes and frames (``Fp8Codec.encode_raw`` and ``decode_raw``,
what ``fp8ray compress`` and ``decompress`` run): the same frames and the same decoded
bytes as the tensor path, bit for bit, the same errors, and no torch; the format
constants it needs without torch equal torch's own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8ray import CodecOptions, Fp8Codec, NonFiniteError, decode
from fp8ray.codec import formats
from fp8ray.codec.blocks import tensor_to_bytes
from fp8ray.codec.fp8codec import decode_raw, raise_nonfinite
from fp8ray.codec.names import DTYPE_CODES, SCALINGS
from fp8ray.errors import BadInputError, CorruptFrameError, MismatchError

REPO = Path(__file__).resolve().parents[2]
DTYPES = [getattr(torch, name) for name in DTYPE_CODES]
MODES = [
    CodecOptions(fp8=fp8, scaling=scaling, block_size=48, scale_dtype=scale_dtype)
    for fp8 in ("e4m3fn", "e5m2")
    for scaling in SCALINGS
    for scale_dtype in ("float32", "bfloat16")
] + [CodecOptions(), CodecOptions(scaling="token", scale_choice="amax"), CodecOptions(nonfinite="keep")]


def adversarial(dtype: torch.dtype, shape=(6, 40)) -> torch.Tensor:
    """Random values over many binades, with zeros, the dtype's extremes and subnormals."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    info = torch.finfo(dtype)
    x = x.clamp(-info.max, info.max).to(dtype)
    flat = x.reshape(-1)
    special = torch.tensor([0.0, -0.0, info.max, -info.max, info.smallest_normal / 4]).to(dtype)
    flat[: min(5, flat.numel())] = special[: flat.numel()]
    return x


@pytest.mark.parametrize("options", MODES, ids=lambda o: o.label())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(6, 40), (), (0, 5), (3, 1, 96)], ids=str)
def test_the_frame_from_raw_bytes_is_the_tensors_frame(options, dtype, shape):
    codec = Fp8Codec(options=options)
    x = adversarial(dtype, shape) if 0 not in shape else torch.zeros(shape, dtype=dtype)
    expected = bytes(codec.encode(x))
    name = formats.dtype_name(dtype)
    assert bytes(codec.encode_raw(tensor_to_bytes(x), name, shape)) == expected
    out = np.full(len(expected), 0xAB, np.uint8)  # into a caller's buffer, every byte written
    assert codec.encode_raw(tensor_to_bytes(x), name, list(shape), out=out).obj is out
    assert out.tobytes() == expected
    decoded = tensor_to_bytes(decode(expected)).tobytes()
    assert decode_raw(expected, name, shape).tobytes() == decoded
    into = np.full(len(decoded), 0xCD, np.uint8)
    assert decode_raw(out, name, shape, out=into) is into and into.tobytes() == decoded


def test_decoding_to_raw_bytes_refuses_another_tensor_and_damage_by_name():
    codec = Fp8Codec()
    good = bytes(codec.encode(torch.ones(4, 64, dtype=torch.bfloat16)))
    with pytest.raises(MismatchError, match=r"expected a \(4, 64\) float16 tensor, the frame holds \(4, 64\) bfloat16"):
        decode_raw(good, "float16", (4, 64))
    with pytest.raises(MismatchError, match=r"expected a \(64, 4\) bfloat16 tensor") as caught:
        decode_raw(good, "bfloat16", (64, 4))
    assert caught.value.field == "shape"
    damaged = bytearray(good)
    damaged[-10] ^= 1
    with pytest.raises(CorruptFrameError, match="checksum mismatch"):
        decode_raw(bytes(damaged), "bfloat16", (4, 64))
    with pytest.raises(BadInputError, match="out must be a writable contiguous 1-D uint8 array of 512 bytes"):
        decode_raw(good, "bfloat16", (4, 64), out=np.empty(511, np.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_nonfinite_value_is_named_as_the_tensor_path_names_it(dtype):
    x = adversarial(dtype)
    x[4, 33] = float("-inf")
    x[5, 2] = float("nan")
    codec = Fp8Codec()
    with pytest.raises(NonFiniteError) as from_tensor:
        codec.encode(x)
    with pytest.raises(NonFiniteError) as from_bytes:
        codec.encode_raw(tensor_to_bytes(x), formats.dtype_name(dtype), x.shape)
    with pytest.raises(NonFiniteError) as found_by_torch:  # as the CUDA path and LMCache's serde name it
        raise_nonfinite(x, 2)
    assert str(from_bytes.value) == str(from_tensor.value) == str(found_by_torch.value)
    assert "2 non-finite value(s)" in str(from_bytes.value) and "-inf at index [4, 33]" in str(from_bytes.value)


def test_raw_bytes_that_do_not_fit_are_refused_by_name():
    codec = Fp8Codec()
    data = np.zeros(2 * 3 * 2, np.uint8)
    with pytest.raises(BadInputError, match=r"data holds 12 bytes, a \[2, 4\] bfloat16 tensor has 16"):
        codec.encode_raw(data, "bfloat16", (2, 4))
    with pytest.raises(TypeError, match=r"unsupported dtype 'complex128'; expected one of"):
        codec.encode_raw(data, "complex128", (2, 6))
    with pytest.raises(TypeError, match=r"data must be a 1-D uint8 array, got a 1-D int16 array"):
        codec.encode_raw(data.view(np.int16), "bfloat16", (2, 3))
    with pytest.raises(TypeError, match=r"^shape \(2, 3.0\): dimension 1 is 3.0, not an integer$"):
        codec.encode_raw(data, "bfloat16", (2, 3.0))  # refused, not truncated
    with pytest.raises(TypeError, match=r"^shape \('2', 3\): dimension 0 is '2', not an integer$"):
        decode_raw(codec.encode_raw(data, "bfloat16", (2, 3)), "bfloat16", ("2", 3))
    with pytest.raises(TypeError, match=r"^shape \(True, 3\): dimension 0 is True, not an integer$"):
        codec.encoded_size((True, 3), "bfloat16")  # a bool is an int to Python: it was taken as 1
    with pytest.raises(TypeError, match=r"^shape must be a sequence of integers, got 6$"):
        codec.encoded_size(6, "bfloat16")
    with pytest.raises(BadInputError, match=r"out must be a writable contiguous 1-D uint8 array"):
        codec.encode_raw(data, "bfloat16", (2, 3), out=np.empty(3, np.uint8))


@pytest.mark.parametrize("fmt", formats.FORMATS.values(), ids=lambda f: f.name)
def test_the_format_constants_taken_without_torch_are_torchs(fmt):
    """Every code's value from the format's bits (finite ones exact, NaN and inf codes
    above max), the search's candidates and the code of max, against torch's fp8 dtypes."""
    values = torch.arange(128, dtype=torch.uint8).view(fmt.dtype).double().numpy()
    ours = formats.positive_values(fmt)
    finite = np.isfinite(values)
    assert np.array_equal(ours[finite], values[finite]) and (ours[~finite] > fmt.max).all()
    grid = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    top = grid[torch.isfinite(grid) & (grid > fmt.max / 2) & (grid <= fmt.max)]
    assert formats.scale_candidates(fmt, "mse") == tuple(sorted((float(v) for v in top), reverse=True))
    assert formats.max_code(fmt) == int(torch.tensor(fmt.max).to(fmt.dtype).view(torch.uint8))
    assert formats.get_format(fmt.dtype) is fmt and formats.FORMATS_BY_DTYPE[fmt.dtype] is fmt


def test_encoding_and_decoding_raw_bytes_loads_no_torch():
    """The whole CPU path from bytes to a checked frame and back, in a process without torch."""
    code = """
import sys
import numpy as np
from fp8ray.codec import Fp8Codec, frame
from fp8ray.codec.fp8codec import decode_raw, raise_nonfinite
codec = Fp8Codec()
data = np.arange(64 * 48, dtype=np.float32).view(np.uint8)
f = np.frombuffer(codec.encode_raw(data, "float32", (64, 48)), np.uint8)
header = frame.parse(f)
back = decode_raw(f, "float32", (64, 48))
print(header.dtype, header.shape, codec.encoded_size((64, 48), "float32") == f.size, back.size, "torch" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["float32", "(64,", "48)", "True", str(64 * 48 * 4), "False"], result.stdout
