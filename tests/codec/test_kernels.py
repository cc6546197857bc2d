"""The CPU fast path equals the plain-torch reference bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _util import DTYPES, SCALINGS, assert_same_bits, kv_like

from fp8ray.codec import cpu, reference
from fp8ray.codec.formats import FORMATS, SCALE_CHOICES, SCALE_DTYPES, SEARCHED_SCALINGS, num_scales

# (scaling, scale_dtype, scale_choice) beyond the plain float32 / amax modes: every
# combination a codec accepts.
OPTION_MODES = [
    (scaling, scale_dtype, choice)
    for scaling in SCALINGS
    if scaling != "none"
    for scale_dtype in SCALE_DTYPES
    for choice in SCALE_CHOICES
    if (scale_dtype, choice) != ("float32", "amax") and (choice == "amax" or scaling in SEARCHED_SCALINGS)
]
ALL_MODES = [(scaling, "float32", "amax") for scaling in SCALINGS] + OPTION_MODES


def fast_quantize(x, fmt, scaling, block_size=64, scale_dtype="float32", scale_choice="amax"):
    codes = np.empty(x.numel(), dtype=np.uint8)
    scales = np.empty(num_scales(scaling, tuple(x.shape), block_size), dtype=np.float32)
    bad = cpu.quantize(x.contiguous(), fmt, scaling, block_size, codes, scales, scale_dtype, scale_choice)
    return torch.from_numpy(codes), torch.from_numpy(scales), bad


def fast_dequantize(codes, scales, fmt, scaling, shape, dtype, block_size=64):
    out = torch.empty(shape, dtype=dtype)
    cpu.dequantize(codes.numpy(), scales.numpy(), fmt, scaling, tuple(shape), block_size, out)
    return out


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_input_rounds_like_torch(fmt_name, dtype):
    """All 65536 bf16/fp16 bit patterns (NaN and inf included) through the clamped cast."""
    fmt = FORMATS[fmt_name]
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    codes, _, bad = fast_quantize(x, fmt, "none")
    ref_codes, _, ref_bad = reference.quantize(x, fmt, "none", 0, keep_nonfinite=True)
    assert bad == ref_bad == int((~torch.isfinite(x)).sum())
    assert torch.equal(codes, ref_codes)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_random_fp32_bit_patterns_round_like_torch(fmt_name):
    """2**20 random fp32 bit patterns, plus every rounding tie near each fp8 value."""
    fmt = FORMATS[fmt_name]
    rng = np.random.default_rng(1)
    random_bits = rng.integers(0, 2**32, size=2**20, dtype=np.uint64).astype(np.uint32)
    values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32: the ties
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), values])
    x = torch.cat([torch.from_numpy(random_bits.view(np.float32)), near, near * 2.0**-30, near * 2.0**30])
    codes, _, _ = fast_quantize(x, fmt, "none")
    ref_codes, _, _ = reference.quantize(x, fmt, "none", 0, keep_nonfinite=True)
    assert torch.equal(codes, ref_codes)


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_decodes_like_torch_and_reencodes(fmt_name, dtype):
    fmt = FORMATS[fmt_name]
    codes = torch.arange(256, dtype=torch.uint8)
    out = fast_dequantize(codes, torch.empty(0), fmt, "none", (256,), dtype)
    expected = codes.view(fmt.dtype).to(dtype)
    assert_same_bits(out, expected)
    # Every finite fp8 value is exact in bf16, fp16 and fp32:
    finite = torch.isfinite(expected)
    assert torch.equal(out[finite].float(), codes.view(fmt.dtype).float()[finite])
    back, _, _ = fast_quantize(out, fmt, "none")
    nan = torch.isnan(out)
    assert torch.equal(back[~nan], codes[~nan])
    assert (back[nan] == fmt.nan_code).all()


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_decode_of_every_code_matches_reference(fmt_name, dtype):
    """Every code times scales spanning fp32's range (the fp32 product, then the output rounding)."""
    fmt = FORMATS[fmt_name]
    rng = np.random.default_rng(2)
    scales = torch.from_numpy(np.exp2(rng.uniform(-126, 100, size=64)).astype(np.float32))
    scales[0] = 2.0**-126
    codes = torch.arange(256, dtype=torch.uint8).repeat(64)
    out = fast_dequantize(codes, scales, fmt, "token", (64, 256), dtype)
    ref = reference.dequantize(codes, scales, fmt, "token", (64, 256), dtype, 0)
    assert_same_bits(out, ref)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_modes_match_reference(scaling, fmt_name, dtype):
    fmt = FORMATS[fmt_name]
    x = kv_like((3, 37, 64), dtype, seed=hash((scaling, fmt_name, str(dtype))) % 1000)
    x[1, 5] = 0  # a zero row: scale 1 under token scaling
    x[..., 7] = 0  # a zero channel
    codes, scales, _ = fast_quantize(x, fmt, scaling)
    ref_codes, ref_scales, _ = reference.quantize(x, fmt, scaling, 64, keep_nonfinite=False)
    assert torch.equal(codes, ref_codes)
    assert_same_bits(scales, ref_scales)
    out = fast_dequantize(codes, scales, fmt, scaling, x.shape, dtype)
    assert_same_bits(out, reference.dequantize(ref_codes, ref_scales, fmt, scaling, tuple(x.shape), dtype, 64))


@pytest.mark.parametrize("scaling, scale_dtype, choice", OPTION_MODES)
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_options_match_reference(scaling, scale_dtype, choice, fmt_name, dtype):
    """bfloat16 scales and the least-squares scale search, bit for bit. Rows of 150 and
    blocks of 130 (the last one short) span several of the search's 64-element chunks."""
    fmt = FORMATS[fmt_name]
    x = kv_like((3, 9, 150), dtype, seed=hash((scaling, scale_dtype, choice, fmt_name, str(dtype))) % 1000)
    x[1, 5] = 0  # a zero row: scale 1 under token scaling, whatever the options
    x[..., 7] = 0  # a zero channel
    x[2, 3, :40] = x[2, 3, 0]  # a run of equal values: candidates may tie
    codes, scales, _ = fast_quantize(x, fmt, scaling, 130, scale_dtype, choice)
    ref_codes, ref_scales, _ = reference.quantize(x, fmt, scaling, 130, False, scale_dtype, choice)
    assert torch.equal(codes, ref_codes)
    assert_same_bits(scales, ref_scales)
    if scale_dtype == "bfloat16":
        assert (scales.view(torch.int32) & 0xFFFF == 0).all()
    out = fast_dequantize(codes, scales, fmt, scaling, x.shape, dtype, 130)
    assert_same_bits(out, reference.dequantize(ref_codes, ref_scales, fmt, scaling, tuple(x.shape), dtype, 130))


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_scale_search_ties_keep_the_first_candidate(fmt_name, scale_dtype):
    """Exact ties: a row holding only finfo.max has zero error under the first candidate
    (scale 1, exact) and under every candidate that is finfo.max over a power of two
    (e4m3fn: 448/256 = 1.75), so the first must be kept; constant rows and one-hot rows
    of other values tie or nearly tie too, and must choose as the reference does."""
    fmt = FORMATS[fmt_name]
    x = torch.zeros(6, 40)
    x[0, 3] = fmt.max
    x[1, :] = fmt.max
    x[2, :] = 1.0
    x[3, 5] = -3.0
    x[4, ::2] = 2.0**-20
    x[5, :20], x[5, 20:] = 5.0, -5.0
    codes, scales, _ = fast_quantize(x, fmt, "token", 0, scale_dtype, "mse")
    ref_codes, ref_scales, _ = reference.quantize(x, fmt, "token", 0, False, scale_dtype, "mse")
    assert torch.equal(codes, ref_codes)
    assert_same_bits(scales, ref_scales)
    assert scales[0] == scales[1] == 1.0


def test_reference_error_sums_add_left_to_right():
    """The search's sums are defined in element order (the kernels add them so); the
    reference's CPU shortcut, torch's cumsum, must give those very bits. Terms of widely
    spread magnitudes make any other association round differently."""
    rng = np.random.default_rng(4)
    terms = torch.from_numpy(np.exp2(rng.uniform(-60, 60, size=(64, 300))) * rng.random((64, 300)))
    expected = terms[:, 0].clone()
    for j in range(1, terms.shape[1]):
        expected = expected + terms[:, j]
    assert torch.equal(reference._sum_left_to_right(terms).view(torch.int64), expected.view(torch.int64))
    pairwise = terms.sum(dim=1)  # torch's own reduction associates differently: the check can fail
    assert not torch.equal(pairwise, expected)


@pytest.mark.parametrize("scaling, scale_dtype, choice", ALL_MODES)
def test_multithreaded_split_matches_reference(scaling, scale_dtype, choice, monkeypatch):
    """Tensors larger than one task's chunk are split across threads; the bytes do not change."""
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setenv("FP8RAY_NUM_THREADS", "3")
    fmt = FORMATS["e4m3fn"]
    x = kv_like((4, 100, 96), torch.bfloat16, seed=5)
    codes, scales, _ = fast_quantize(x, fmt, scaling, 100, scale_dtype, choice)
    ref_codes, ref_scales, _ = reference.quantize(x, fmt, scaling, 100, False, scale_dtype, choice)
    assert torch.equal(codes, ref_codes)
    assert_same_bits(scales, ref_scales)
    out = fast_dequantize(codes, scales, fmt, scaling, x.shape, torch.bfloat16, block_size=100)
    assert_same_bits(out, reference.dequantize(ref_codes, ref_scales, fmt, scaling, tuple(x.shape), torch.bfloat16, 100))


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_nonfinite_codes_match_reference_in_every_mode(fmt_name):
    fmt = FORMATS[fmt_name]
    x = kv_like((4, 8, 16), torch.float32, seed=3)
    x[0, 0, 0], x[1, 2, 3], x[2, 3, 4], x[3, 7, 15] = float("nan"), float("inf"), float("-inf"), float("nan")
    for scaling, scale_dtype, choice in ALL_MODES:
        codes, scales, bad = fast_quantize(x, fmt, scaling, 64, scale_dtype, choice)
        ref_codes, ref_scales, ref_bad = reference.quantize(x, fmt, scaling, 64, True, scale_dtype, choice)
        assert bad == ref_bad == 4
        assert torch.equal(codes, ref_codes), (scaling, scale_dtype, choice)
        assert_same_bits(scales, ref_scales)
        assert torch.isfinite(scales).all()


PORTABLE_HALF_CHECK = """
import numpy as np, torch
from fp8ray.codec import cpu, kernels, reference
from fp8ray.codec.formats import E4M3FN
assert not kernels.bits._NATIVE_HALF
x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
codes = np.empty(x.numel(), np.uint8)
cpu.quantize(x, E4M3FN, "none", 0, codes, None)
ref, _, _ = reference.quantize(x, E4M3FN, "none", 0, True)
assert np.array_equal(codes, ref.numpy())
scales = torch.exp2(torch.linspace(-30, 30, 64))
c = torch.arange(256, dtype=torch.uint8).repeat(64)
out = torch.empty(64, 256, dtype=torch.float16)
cpu.dequantize(c.numpy(), scales.numpy(), E4M3FN, "token", (64, 256), 0, out)
expected = reference.dequantize(c, scales, E4M3FN, "token", (64, 256), torch.float16, 0)
nan = torch.isnan(expected)
assert torch.equal(out[~nan], expected[~nan]) and torch.isnan(out[nan]).all()
print("portable half ok")
"""


@pytest.mark.slow
def test_portable_half_conversions_match_torch(tmp_path):
    """The bit-level fp16 conversions, used where the CPU has no F16C: compiled for a
    generic x86-64 target in a subprocess, then checked like the native ones."""
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() != "x86_64":
        pytest.skip("the portable path is only forced on x86_64")
    env = dict(os.environ, NUMBA_CPU_NAME="x86-64", NUMBA_CPU_FEATURES="+sse2", NUMBA_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", PORTABLE_HALF_CHECK], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "portable half ok" in result.stdout
