"""Fp8Codec: round trips, the derived error bound, overflow and non-finite policies, bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from _util import DTYPES, SCALINGS, assert_same_bits, element_scales, error_bound, kv_like

import fp8ray
from fp8ray import CodecOptions, Fp8Codec, NonFiniteError, decode
from fp8ray.codec import frame, reference
from fp8ray.codec.formats import FORMATS, SCALE_CHOICES, SCALE_DTYPES, SEARCHED_SCALINGS
from fp8ray.errors import BadInputError

# Every (scaling, scale_dtype, scale_choice) a codec accepts; OPTION_MODES leaves out the
# plain float32 / amax ones.
ALL_MODES = [
    (scaling, scale_dtype, choice)
    for scaling in SCALINGS
    for scale_dtype in SCALE_DTYPES
    for choice in SCALE_CHOICES
    if (choice == "amax" or scaling in SEARCHED_SCALINGS) and (scaling != "none" or scale_dtype == "float32")
]
OPTION_MODES = [m for m in ALL_MODES if m[1:] != ("float32", "amax")]


def frame_scales(f) -> torch.Tensor:
    buf = frame.as_byte_array(f)
    return torch.from_numpy(frame.scales_of(buf, frame.parse(buf)).copy())


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_within_derived_bound(scaling, fmt_name, dtype):
    fmt = FORMATS[fmt_name]
    x = kv_like((2, 4, 33, 64), dtype, seed=7)
    if scaling == "none":  # no scale: keep the data inside the format's range
        x = (x.float().clamp(-fmt.max, fmt.max)).to(dtype)
    codec = Fp8Codec(fmt_name, scaling, block_size=96)
    f = codec.encode(x)
    assert len(f) == codec.encoded_size(x.shape, dtype)
    y = fp8ray.decode(f)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.isfinite(y).all()
    scale = element_scales(frame_scales(f), scaling, tuple(x.shape), 96)
    err = (y.double() - x.double()).abs().reshape(-1)
    bound = error_bound(x, y, scale, fmt_name)
    worst = int(torch.argmax(err - bound))
    assert (err <= bound).all(), f"element {worst}: |err| {err[worst]:.3e} > bound {bound[worst]:.3e}"


@pytest.mark.parametrize("scaling, scale_dtype, choice", OPTION_MODES)
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_options_round_trip_within_derived_bound(scaling, scale_dtype, choice, fmt_name, dtype):
    """The per-element bound of docs/ACCURACY.md holds with s the stored scale, however chosen."""
    x = kv_like((2, 4, 33, 64), dtype, seed=8)
    codec = Fp8Codec(fmt_name, scaling, block_size=96, scale_dtype=scale_dtype, scale_choice=choice)
    f = codec.encode(x)
    assert len(f) == codec.encoded_size(x.shape, dtype)
    y = fp8ray.decode(f)
    assert y.dtype == dtype and y.shape == x.shape and torch.isfinite(y).all()
    scale = element_scales(frame_scales(f), scaling, tuple(x.shape), 96)
    err = (y.double() - x.double()).abs().reshape(-1)
    bound = error_bound(x, y, scale, fmt_name)
    worst = int(torch.argmax(err - bound))
    assert (err <= bound).all(), f"element {worst}: |err| {err[worst]:.3e} > bound {bound[worst]:.3e}"


def group_squared_errors(x: torch.Tensor, y: torch.Tensor, group: int) -> torch.Tensor:
    """Per group: sum of (y - x)**2, each term and the sum in fp64, left to right."""
    diff = (y.double() - x.double()).reshape(-1, group)
    return (diff * diff).cumsum(dim=1)[:, -1]


@pytest.mark.parametrize("scaling", SEARCHED_SCALINGS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_scale_search_is_never_worse_than_amax_in_any_group(scaling, scale_dtype, fmt_name):
    """The amax scale is the search's first candidate and is replaced only by a strictly
    smaller search error (reference.search_error), so no group's search error can grow.
    The true error differs from the search's by its measuring through a reciprocal: per
    element, |true difference| and |search's difference| are within 2**-21 |x| (the
    quotient's three fp32 roundings, under 2**-22 |x|, plus the decode's rounding of an
    fp32 input), except where the quotient lies below the format's smallest normal: there
    the search rounds to the finer relative grid, and the two differences are within half
    the subnormal spacing, 2**(min_subnormal_exp - 1) scale. The search's fp32 sum of n
    terms is within n 2**-24 relative. So per group, with delta = 2**-21 ||x|| +
    2**(min_subnormal_exp - 1) max(scales) sqrt(k), k the elements below the smallest
    normal under the larger scale, ||true(mse)|| <= (||true(amax)|| + delta)(1 + n 2**-24) + delta.
    Most groups gain: the search has 4 (e5m2) or 8 (e4m3fn) alignments of the grid."""
    x = kv_like((6, 50, 64), torch.float32, seed=13)
    fmt = FORMATS[fmt_name]
    amax = fp8ray.decode(Fp8Codec(fmt_name, scaling, 32, scale_dtype=scale_dtype, scale_choice="amax").encode(x))
    mse_frame = Fp8Codec(fmt_name, scaling, 32, scale_dtype=scale_dtype, scale_choice="mse").encode(x)
    mse = fp8ray.decode(mse_frame)
    group = 64 if scaling == "token" else 32
    groups = x.reshape(-1, group)
    magnitudes = groups.abs()
    amax_scales = reference.amax_to_scale(magnitudes.amax(dim=1), fmt, scale_dtype=scale_dtype)
    mse_scales = torch.from_numpy(
        frame.scales_of(frame.as_byte_array(mse_frame), frame.parse(frame.as_byte_array(mse_frame))).copy()
    )
    assert (reference.search_error(magnitudes, mse_scales, fmt) <= reference.search_error(magnitudes, amax_scales, fmt)).all()
    before, after = group_squared_errors(x, amax, group).sqrt(), group_squared_errors(x, mse, group).sqrt()
    larger_scale = torch.maximum(amax_scales, mse_scales).double()
    below_normal = (magnitudes.double() < 2.0 ** (1 - fmt.exponent_bias) * larger_scale[:, None]).sum(dim=1)
    slack = 2.0**-21 * groups.double().norm(dim=1) + 2.0 ** (fmt.min_subnormal_exp - 1) * larger_scale * below_normal.sqrt()
    assert (after <= (before + slack) * (1 + group * 2.0**-24) + slack).all()
    assert (after < before).any()  # the search is not a no-op


@pytest.mark.parametrize("scale_choice", SCALE_CHOICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bfloat16_scales_never_decode_above_the_group_amax(scale_choice, dtype):
    """A truncated scale s <= amax / c makes every decoded |value| <= c * s <= amax
    (docs/ACCURACY.md), so even the dtype's largest finite value decodes finite."""
    x = kv_like((8, 64), dtype, seed=3).float().clamp(-100, 100)
    x[:, 5] = torch.finfo(dtype).max * torch.tensor([1, -1] * 4)
    x[2] *= 2.0**-30
    x = x.to(dtype)
    codec = Fp8Codec("e4m3fn", "token", scale_dtype="bfloat16", scale_choice=scale_choice)
    y = fp8ray.decode(codec.encode(x))
    assert torch.isfinite(y).all()
    assert (y.double().abs().amax(dim=1) <= x.double().abs().amax(dim=1)).all()


@pytest.mark.parametrize("scaling, scale_dtype, choice", ALL_MODES)
def test_frame_equals_reference_bytes(scaling, scale_dtype, choice):
    x = kv_like((5, 16, 64), torch.bfloat16, seed=11)
    codec = Fp8Codec("e4m3fn", scaling, block_size=50, scale_dtype=scale_dtype, scale_choice=choice)
    buf = frame.as_byte_array(codec.encode(x))
    header = frame.parse(buf)
    assert header.scale_dtype == scale_dtype
    codes, scales, _ = reference.quantize(x, codec.fmt, scaling, 50, False, scale_dtype, choice)
    assert np.array_equal(frame.codes_of(buf, header), codes.numpy())
    assert np.array_equal(frame.scales_of(buf, header).view(np.int32), scales.numpy().view(np.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_group_longer_than_the_tensor_costs_the_tensor_not_the_group(dtype):
    """The search's work and memory follow the elements present, not the block size
    (a block size of 2**32 - 1 once took 17 GB and 29 s for 5 elements, the reference
    more): a block past the tensor's end gives the codes and scales of a block of exactly
    its size, and a token row of 2**36 elements in a tensor of no rows costs nothing."""
    empty = torch.empty(0, 2**36, dtype=dtype)
    assert fp8ray.decode(Fp8Codec(scaling="token").encode(empty)).shape == empty.shape
    codes, scales, _ = reference.quantize(empty, FORMATS["e4m3fn"], "token", 32, False, "bfloat16", "mse")
    assert codes.numel() == scales.numel() == 0
    x = kv_like((37,), dtype, seed=3)
    huge, exact = Fp8Codec(block_size=2**32 - 1), Fp8Codec(block_size=37)
    a, b = frame.as_byte_array(huge.encode(x)), frame.as_byte_array(exact.encode(x))
    ha, hb = frame.parse(a), frame.parse(b)
    assert np.array_equal(frame.codes_of(a, ha), frame.codes_of(b, hb))
    assert np.array_equal(frame.scales_of(a, ha).view(np.int16), frame.scales_of(b, hb).view(np.int16))
    codes, scales, _ = reference.quantize(x, FORMATS["e4m3fn"], "block", 2**32 - 1, False, "bfloat16", "mse")
    assert np.array_equal(frame.codes_of(a, ha), codes.numpy())
    assert np.array_equal(frame.scales_of(a, ha), scales.numpy())


@pytest.mark.parametrize("scaling, scale_dtype, choice", ALL_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_empty_and_0d(scaling, scale_dtype, choice, dtype):
    codec = Fp8Codec("e4m3fn", scaling, block_size=8, scale_dtype=scale_dtype, scale_choice=choice)
    zeros = torch.zeros(3, 5, dtype=dtype)
    zeros[1, 2] = -0.0
    out = fp8ray.decode(codec.encode(zeros))
    assert_same_bits(out, zeros)  # exact zeros, sign included
    if scaling != "none":
        assert (frame_scales(codec.encode(zeros)) == 1).all()
    for shape in [(0,), (4, 0), (0, 3), (2, 0, 5)]:
        empty = torch.empty(shape, dtype=dtype)
        f = codec.encode(empty)
        assert len(f) == codec.encoded_size(shape, dtype)
        assert fp8ray.decode(f).shape == shape
    scalar = torch.tensor(-3.25, dtype=dtype)
    out = fp8ray.decode(codec.encode(scalar))
    assert out.shape == () and out.dtype == dtype
    if (scale_dtype, choice) == ("bfloat16", "amax"):
        # The scale 3.25/448 truncated to bfloat16 is smaller, so 3.25/scale clamps to 448.
        truncated = float((torch.tensor(3.25 / 448).view(torch.int32) & -(2**16)).view(torch.float32))
        assert float(out) == float(torch.tensor(-448 * truncated).to(dtype)) and float(out) != -3.25
    else:
        # 3.25 = 1.101b * 2: exact in e4m3fn, and the scale 3.25/448 inverts exactly; with
        # bfloat16 scales the search finds 3.25/416 = 2**-7, exact as well.
        assert float(out) == -3.25


@pytest.mark.parametrize("scaling", SCALINGS)
def test_non_contiguous_input_equals_contiguous_copy(scaling):
    x = kv_like((6, 40, 64), torch.bfloat16, seed=2)
    view = x.transpose(0, 1)[:, ::2]
    assert not view.is_contiguous()
    codec = Fp8Codec("e4m3fn", scaling, block_size=64)
    assert bytes(codec.encode(view)) == bytes(codec.encode(view.contiguous()))


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("scaling, scale_dtype, choice", ALL_MODES)
def test_overflow_is_clamped_never_nan_or_inf(fmt_name, scaling, scale_dtype, choice):
    fmt = FORMATS[fmt_name]
    codec = Fp8Codec(fmt_name, scaling, scale_dtype=scale_dtype, scale_choice=choice)
    x = torch.tensor([[1e30, -1e30, 3.0e38, 1.0, -fmt.max * 4, 0.5]], dtype=torch.float32)
    y = fp8ray.decode(codec.encode(x))
    assert torch.isfinite(y).all()
    assert ((torch.sign(y) == torch.sign(x)) | (y == 0)).all()  # small values may underflow next to 3e38
    if scaling == "none":
        assert y[0, 0] == fmt.max and y[0, 1] == -fmt.max and y[0, 4] == -fmt.max
    bf = torch.tensor([3.0e38, -3.0e38, 65504.0], dtype=torch.bfloat16)
    assert torch.isfinite(fp8ray.decode(codec.encode(bf))).all()
    half = torch.tensor([65504.0, -65504.0, 1.0], dtype=torch.float16)
    assert torch.isfinite(fp8ray.decode(codec.encode(half))).all()


@pytest.mark.parametrize("scaling", SCALINGS)
def test_nonfinite_error_names_count_and_first_index(scaling):
    x = torch.ones(2, 3, 4)
    x[1, 2, 3] = float("inf")
    x[1, 0, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"2 non-finite value\(s\).*first is nan at index \[1, 0, 1\]"):
        Fp8Codec("e4m3fn", scaling).encode(x)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_nonfinite_keep(scaling):
    x = torch.tensor([[1.0, float("nan"), float("inf"), float("-inf"), -2.0, 4.0]])
    plain = {"scale_dtype": "float32", "scale_choice": "amax"}  # exact scales: 1, -2 and 4 decode exactly
    e5 = fp8ray.decode(Fp8Codec("e5m2", scaling, nonfinite="keep", **plain).encode(x))
    assert torch.isnan(e5[0, 1]) and e5[0, 2] == float("inf") and e5[0, 3] == float("-inf")
    e4 = fp8ray.decode(Fp8Codec("e4m3fn", scaling, nonfinite="keep", **plain).encode(x))
    assert torch.isnan(e4[0, 1:4]).all()  # e4m3fn has no inf: +-inf is stored as NaN
    for y in (e5, e4):  # the finite values are untouched by the non-finite ones
        assert y[0, 0] == 1.0 and y[0, 4] == -2.0 and y[0, 5] == 4.0


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_idempotent_without_scaling(fmt_name, dtype):
    """Scaling none: decoded values are fp8 values, exact in every dtype, so re-encoding is exact."""
    x = kv_like((4, 64), dtype, seed=9).float().clamp(-400, 400).to(dtype)
    codec = Fp8Codec(fmt_name, "none")
    f = codec.encode(x)
    assert bytes(codec.encode(fp8ray.decode(f))) == bytes(f)


@pytest.mark.parametrize("scaling", ["tensor", "channel", "token", "block"])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_idempotent_with_power_of_two_scales(scaling, scale_dtype, dtype):
    """Scaled modes re-encode exactly when each scale is a power of two: then fp8*scale is
    exact in fp32 and the output dtype, and the decoded amax gives back the same scale.
    For other scales fp8*scale rounds (in fp32, then to bf16/fp16), the new amax differs
    in its last bits and so may the scale: a second round trip is then only within the
    bound of the first (next test)."""
    fmt = FORMATS["e4m3fn"]
    x = kv_like((8, 64), torch.float32, seed=4).clamp(-100, 100)
    x = (x / x.abs().amax()).clamp(-1, 1) * fmt.max / 64  # amax = 7 * 2^6 / 64 = 7 -> scale 2^-6
    x[:, 0] = fmt.max / 64  # every row, column and block reaches the amax
    x[0, :] = fmt.max / 64
    x = x.to(dtype)
    codec = Fp8Codec("e4m3fn", scaling, block_size=64, scale_dtype=scale_dtype, scale_choice="amax")  # 2**-6 is a bfloat16 too
    f = codec.encode(x)
    assert (frame_scales(f) == 2.0**-6).all()
    assert bytes(codec.encode(fp8ray.decode(f))) == bytes(f)


@pytest.mark.parametrize("scaling, scale_dtype, choice", ALL_MODES)
def test_second_round_trip_stays_within_bound(scaling, scale_dtype, choice):
    x = kv_like((4, 16, 64), torch.bfloat16, seed=6)
    if scaling == "none":
        x = x.float().clamp(-448, 448).to(torch.bfloat16)
    codec = Fp8Codec("e4m3fn", scaling, block_size=64, scale_dtype=scale_dtype, scale_choice=choice)
    once = fp8ray.decode(codec.encode(x))
    f2 = codec.encode(once)
    twice = fp8ray.decode(f2)
    scale = element_scales(frame_scales(f2), scaling, tuple(x.shape), 64)
    assert ((twice.double() - once.double()).abs().reshape(-1) <= error_bound(once, twice, scale, "e4m3fn")).all()


def test_decode_into_out_and_device():
    x = kv_like((3, 64), torch.float16, seed=1)
    f = Fp8Codec("e4m3fn", "token").encode(x)
    expected = fp8ray.decode(f)
    out = torch.empty(3, 64, dtype=torch.float16)
    assert fp8ray.decode(f, out=out) is out
    assert torch.equal(out, expected)
    strided = torch.empty(64, 3, dtype=torch.float16).t()
    assert fp8ray.decode(f, out=strided) is strided and torch.equal(strided, expected)
    assert torch.equal(fp8ray.decode(f, device="cpu"), expected)
    with pytest.raises(ValueError, match=r"out is a \(64, 3\) torch.float16 tensor, the frame holds \(3, 64\)"):
        fp8ray.decode(f, out=torch.empty(64, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="float32"):
        fp8ray.decode(f, out=torch.empty(3, 64))


@pytest.mark.parametrize("x", [kv_like((4, 8), torch.bfloat16, seed=2), torch.arange(32).reshape(4, 8)], ids=["fp8", "stored"])
def test_decode_into_a_tensor_made_under_inference_mode(x):
    """vLLM and LMCache make their buffers under torch.inference_mode(): decode writes
    them in every layout, outside inference mode too (torch refuses an in-place copy_
    into one there, which only the direct path avoided)."""
    f = Fp8Codec().encode(x)
    with torch.inference_mode():
        contiguous, transposed = torch.empty(4, 8, dtype=x.dtype), torch.empty(8, 4, dtype=x.dtype).t()
    for out in (contiguous, transposed):
        assert fp8ray.decode(f, out=out) is out and torch.equal(out, fp8ray.decode(f))


def test_frame_is_a_zero_copy_bytes_like_view():
    x = kv_like((2, 64), torch.bfloat16)
    f = Fp8Codec().encode(x)
    assert isinstance(f, memoryview) and f.nbytes == len(bytes(f))
    arr = np.frombuffer(f, np.uint8)
    assert np.shares_memory(arr, np.asarray(f.obj))
    for form in (bytes(f), bytearray(f), arr, torch.from_numpy(arr.copy())):
        assert torch.equal(fp8ray.decode(form), fp8ray.decode(f))


def test_numpy_input():
    a = np.linspace(-3, 3, 64, dtype=np.float32).reshape(4, 16)
    y = fp8ray.decode(Fp8Codec("e4m3fn", "token").encode(a))
    assert y.dtype == torch.float32 and (y - torch.from_numpy(a)).abs().max() < 0.2


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("np_dtype", [np.float16, np.float32])
def test_numpy_arrays_keep_their_rank_and_give_the_tensors_frame(scaling, np_dtype):
    """A 0-d array stays 0-d (not made 1-d on the way), and each array's frame is its
    tensor's, byte for byte, of the size encoded_size gives for the array's own dtype."""
    codec = Fp8Codec(scaling=scaling)
    for a in (np.array(2.5, np_dtype), np.linspace(-3, 3, 64, dtype=np_dtype).reshape(4, 16)[:, ::2]):
        f = codec.encode(a)
        assert bytes(f) == bytes(codec.encode(torch.from_numpy(a.copy())))
        assert len(f) == codec.encoded_size(a.shape, a.dtype) == codec.encoded_size(a.shape, np_dtype)
        assert tuple(fp8ray.decode(f).shape) == a.shape


@pytest.mark.parametrize("dtype", [np.complex128, np.dtype("datetime64[s]"), np.dtype(">f4"), np.dtype(">i8")])
def test_encoded_size_names_a_numpy_dtype_it_refuses(dtype):
    with pytest.raises(
        TypeError,
        match="^" + re.escape(f"unsupported numpy dtype {np.dtype(dtype)}; expected one of ['bool', 'complex64', 'float16'"),
    ):
        Fp8Codec().encoded_size((2, 3), dtype)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"fp8": "e3m4"}, ValueError, "unknown fp8 format 'e3m4'"),
        ({"fp8": torch.float16}, ValueError, "unsupported fp8 dtype torch.float16"),
        ({"scaling": "row"}, ValueError, "unknown scaling 'row'"),
        ({"scaling": "block", "block_size": 0}, ValueError, "block_size must be a positive integer"),
        ({"block_size": 2.5}, ValueError, "block_size must be a positive integer"),
        ({"nonfinite": "ignore"}, ValueError, "unknown nonfinite policy 'ignore'"),
        ({"scale_dtype": "float16"}, ValueError, "unknown scale_dtype 'float16'"),
        ({"scale_choice": "best"}, ValueError, "unknown scale_choice 'best'"),
        (
            {"scaling": "tensor", "scale_choice": "mse"},
            ValueError,
            "scale_choice 'mse' needs scaling 'token' or 'block', not 'tensor'",
        ),
        ({"scaling": "channel", "scale_choice": "mse"}, ValueError, "not 'channel'"),
        ({"scaling": "none", "scale_choice": "mse"}, ValueError, "not 'none'"),
    ],
)
def test_bad_options_are_named(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        Fp8Codec(**kwargs)


@pytest.mark.parametrize(
    "value, error, pattern",
    [
        (torch.ones(4, dtype=torch.complex128), TypeError, "unsupported dtype torch.complex128"),
        (np.ones(4, np.complex128), TypeError, "unsupported numpy dtype complex128"),
        (np.arange(4, dtype=">i8"), TypeError, "array dtype >i8 is not in this machine's byte order"),
        ([1.0, 2.0], TypeError, "expected a torch.Tensor or numpy array, got list"),
        (torch.empty(4, device="meta"), ValueError, "meta tensor"),
    ],
)
def test_bad_input_is_named(value, error, pattern):
    with pytest.raises(error, match=pattern):
        Fp8Codec().encode(value)


def test_accepted_format_spellings():
    assert Fp8Codec(torch.float8_e5m2).fmt.name == "e5m2"
    assert Fp8Codec("float8_e4m3fn").fmt.name == "e4m3fn"
    assert fp8ray.encoded_size((2, 3), torch.bfloat16, scaling="token", scale_dtype="float32") == 16 + 16 + 4 * 2 + 6 + 4
    assert fp8ray.encoded_size((2, 3), torch.bfloat16, scaling="token", scale_dtype="bfloat16") == 16 + 16 + 2 * 2 + 6 + 4
    assert fp8ray.encoded_size((2, 3), torch.bfloat16, scaling="none", scale_dtype="bfloat16") == 16 + 16 + 6 + 4


def test_plain_options_write_the_frames_they_always_wrote():
    """With float32 scales chosen by amax (the only ones before scale options existed),
    byte 9 (reserved before scale dtypes) stays 0: readers of older frames see no change."""
    x = kv_like((3, 64), torch.bfloat16, seed=2)
    for scaling in SCALINGS:
        f = bytes(Fp8Codec("e4m3fn", scaling, 32, scale_dtype="float32", scale_choice="amax").encode(x))
        assert f[9:12] == b"\0\0\0"


def test_one_default_mode_and_options_override_only_themselves():
    x = kv_like((3, 64), torch.bfloat16, seed=2)
    default = Fp8Codec()
    assert bytes(default.encode(x)) == bytes(Fp8Codec("e4m3fn", "block", 32, "error", "bfloat16", "mse").encode(x))
    assert repr(default) == (
        "Fp8Codec(fp8='e4m3fn', scaling='block', block_size=32, scale_dtype='bfloat16', scale_choice='mse', nonfinite='error')"
    )
    assert Fp8Codec(fp8="e5m2").options == CodecOptions(
        fp8="e5m2", scaling="block", block_size=32, scale_dtype="bfloat16", scale_choice="mse"
    )
    # scale_choice left out follows the scaling: mse where it can search, amax elsewhere.
    assert Fp8Codec(scaling="token").scale_choice == "mse" and Fp8Codec(scaling="tensor").scale_choice == "amax"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("scaling, scale_dtype, choice", ALL_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_path_equals_cpu_bytes(scaling, scale_dtype, choice, dtype):
    x = kv_like((4, 33, 64), dtype, seed=12)
    codec = Fp8Codec("e4m3fn", scaling, block_size=64, scale_dtype=scale_dtype, scale_choice=choice)
    f_cpu, f_gpu = codec.encode(x), codec.encode(x.cuda())
    assert bytes(f_cpu) == bytes(f_gpu)
    assert_same_bits(fp8ray.decode(f_gpu, device="cuda").cpu(), fp8ray.decode(f_cpu))


def test_encode_into_slices_of_one_buffer_equals_separate_frames():
    """``encode(out=...)`` lays frames end to end (as archive parts do) with the same
    bytes as separate encodes; a buffer of the wrong size or kind is refused."""
    codec = Fp8Codec("e4m3fn", "block", 32, scale_dtype="bfloat16", scale_choice="mse")
    tensors = [kv_like((2, 3, 5, 64), torch.bfloat16, seed=i) for i in range(3)] + [torch.randn(7, 9)]
    sizes = [codec.encoded_size(t.shape, t.dtype) for t in tensors]
    buf = np.full(sum(sizes), 0xAA, dtype=np.uint8)
    start = 0
    for t, size in zip(tensors, sizes):
        codec.encode(t, out=buf[start : start + size])
        start += size
    assert bytes(buf) == b"".join(bytes(codec.encode(t)) for t in tensors)
    for bad in (np.empty(sizes[0] + 1, np.uint8), np.empty(sizes[0], np.int8), np.empty((1, sizes[0]), np.uint8)):
        with pytest.raises(ValueError, match=f"{sizes[0]} bytes"):
            codec.encode(tensors[0], out=bad)


def test_the_cuda_paths_scale_bytes_are_the_frames():
    """The CUDA path narrows bfloat16 scales on the GPU (fp8codec._scale_bytes, run here
    on the CPU): the same bytes as the CPU path's narrowing on the host."""
    from fp8ray.codec.fp8codec import _scale_bytes

    scales = torch.exp2(torch.empty(1000).uniform_(-126, 127)).bfloat16().float()
    bits = scales.numpy().view(np.uint32)
    assert np.array_equal(_scale_bytes(scales, "bfloat16").numpy(), (bits >> 16).astype("<u2").view(np.uint8))
    assert np.array_equal(_scale_bytes(scales, "float32").numpy(), bits.astype("<u4").view(np.uint8))


def test_a_tensor_that_requires_grad_encodes_as_its_values():
    """A model's K/V taken outside no_grad, or a Parameter: encoding takes no gradient."""
    x = torch.randn(4, 64, requires_grad=True)
    parameter = torch.nn.Parameter(torch.randn(8, 32, dtype=torch.bfloat16))
    codec = Fp8Codec()
    assert bytes(codec.encode(x)) == bytes(codec.encode(x.detach()))
    assert bytes(codec.encode(parameter)) == bytes(codec.encode(parameter.detach()))


@pytest.mark.parametrize("threads", [0, -1, 1.5, "2", True])
def test_threads_must_be_a_positive_whole_number(threads):
    x = torch.randn(4, 64)
    codec = Fp8Codec()
    with pytest.raises(BadInputError, match=r"threads must be a whole number of at least 1, or None"):
        codec.encode(x, threads=threads)
    with pytest.raises(BadInputError, match=r"threads must be a whole number of at least 1, or None"):
        decode(codec.encode(x), threads=threads)
    assert bytes(codec.encode(x, threads=3)) == bytes(codec.encode(x, threads=None))
