"""The CPU fast path equals the plain-torch reference bit for bit."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from _util import DTYPES, SCALINGS, assert_same_bits, kv_like

from fp8ray.codec import cpu, kernels, reference
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
    bad = cpu.quantize(cpu.kernel_array(x.contiguous()), fmt, scaling, block_size, codes, scales, scale_dtype, scale_choice)
    return torch.from_numpy(codes), torch.from_numpy(scales), bad


def fast_dequantize(codes, scales, fmt, scaling, shape, dtype, block_size=64):
    out = torch.empty(shape, dtype=dtype)
    cpu.dequantize(codes.numpy(), scales.numpy(), fmt, scaling, tuple(shape), block_size, cpu.kernel_array(out))
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


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_by_scales_about_the_bf16_narrowing_floor_matches_reference(fmt_name, dtype):
    """Every code times scales just below, at and above the least whose products are all
    fp32 normals (``bf16_narrowing_floor``), in each decode kernel (one scale, a scale per
    column, a scale per row): the CPU's bf16 narrowing, which makes subnormals zeros, may
    only be used at and above it, and the products just below it are subnormals."""
    fmt = FORMATS[fmt_name]
    floor = np.float32(kernels.bits.bf16_narrowing_floor(fmt))
    scales = np.array([np.nextafter(floor, 0), floor, np.nextafter(floor, 1), floor / 2, floor * 2, 2.0**-126, 1], np.float32)
    assert float(scales[0]) * 2.0**fmt.min_subnormal_exp < 2.0**-126  # the first scale's products are subnormals
    codes = torch.arange(256, dtype=torch.uint8)
    for scale in scales:
        one = torch.tensor([scale])
        out = fast_dequantize(codes, one, fmt, "tensor", (256,), dtype)
        assert_same_bits(out, reference.dequantize(codes, one, fmt, "tensor", (256,), dtype, 0))
    rows = codes.repeat(len(scales))
    out = fast_dequantize(rows, torch.from_numpy(scales), fmt, "token", (len(scales), 256), dtype)
    assert_same_bits(out, reference.dequantize(rows, torch.from_numpy(scales), fmt, "token", (len(scales), 256), dtype, 0))
    for columns in (np.full(16, floor), np.concatenate([np.full(15, floor), scales[:1]])):  # least at, and below, the floor
        grid = codes.repeat_interleave(16)
        out = fast_dequantize(grid, torch.from_numpy(columns), fmt, "channel", (256, 16), dtype)
        expected = reference.dequantize(grid, torch.from_numpy(columns), fmt, "channel", (256, 16), dtype, 0)
        assert_same_bits(out, expected)


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


def correctly_rounded_fma(d: float, acc: float) -> np.float32:
    """fp32 ``d * d + acc`` rounded once, to nearest even, from the exact rational value."""
    exact = Fraction(float(d)) ** 2 + Fraction(float(acc))
    near = np.float32(float(exact))
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.float32(c).view(np.uint32)) & 1))


def test_fused_square_add_rounds_once():
    """reference.fused_square_add equals a correctly rounded fp32 fma, computed exactly
    from rationals, over values whose squares and sums spread across 200 binades, and
    differs from the unfused fp32 ``d * d + acc`` (two roundings) somewhere: the check can fail."""
    rng = np.random.default_rng(7)
    d = (np.exp2(rng.uniform(-70, 60, 4000)) * rng.uniform(0.5, 1, 4000)).astype(np.float32)
    acc = (np.exp2(rng.uniform(-140, 120, 4000)) * rng.random(4000)).astype(np.float32)
    acc[::7] = 0
    got = reference.fused_square_add(torch.from_numpy(d), torch.from_numpy(acc)).numpy()
    expected = np.array([correctly_rounded_fma(a, b) for a, b in zip(d, acc)], dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert not np.array_equal(got, (d * d + acc).astype(np.float32))


def test_reference_lane_square_sums_follow_the_defined_order():
    """The search's sums are defined lane by lane, by fused multiply-adds, then halved
    (reference.lane_square_sums); the kernels add them so. Values of widely spread
    magnitudes make any other association round differently, and rows whose length is
    not a multiple of the lanes are padded."""
    rng = np.random.default_rng(4)
    for width in (1, 15, 16, 32, 300):
        d = torch.from_numpy(np.exp2(rng.uniform(-30, 30, size=(16, width))) * rng.random((16, width))).float()
        expected = []
        for row in d.tolist():
            lanes = [np.float32(0.0)] * 16
            for i, v in enumerate(row):
                lanes[i % 16] = correctly_rounded_fma(v, lanes[i % 16])
            w = 8
            while w:
                lanes = [np.float32(lanes[j] + lanes[j + w]) for j in range(w)]
                w //= 2
            expected.append(lanes[0])
        got = reference.lane_square_sums(d)
        assert torch.equal(got, torch.tensor(expected, dtype=torch.float32)), width
    sequential = d[:, 0] * d[:, 0]
    for j in range(1, d.shape[1]):
        sequential = sequential + d[:, j] * d[:, j]
    assert not torch.equal(sequential, reference.lane_square_sums(d))  # the order matters: the check can fail


def test_search_rounding_is_the_format_grid_above_its_smallest_normal():
    """reference.nearest_with_mantissa (the search's rounding on the bits) gives every
    non-negative fp32 quotient from the format's smallest normal up to finfo.max (1 + 2**-6)
    the distance to the fp8 grid that torch's cast gives (ties may go either way, their
    distance is the same), and a finer one only below: the search's measure differs
    from the codes' error only there."""
    for fmt in FORMATS.values():
        smallest_normal = 2.0 ** (1 - fmt.exponent_bias)
        top = torch.tensor(fmt.max * (1 + 2.0**-6), dtype=torch.float32)  # the largest quotient (pad_candidates)
        grid = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
        grid = grid[torch.isfinite(grid) & (grid >= 0)].sort().values
        ties = (grid[:-1] + grid[1:]) / 2  # exact midpoints between neighbouring fp8 values
        spread = torch.from_numpy(np.random.default_rng(1).uniform(0, 1, 200_000).astype(np.float32)) * top
        q = torch.cat([spread, grid, ties, top[None], torch.linspace(fmt.max, float(top), 1000)])
        assert (q > fmt.max).any()  # quotients above finfo.max, which the cast clamps, are in
        cast = q.clamp_max(fmt.max).to(fmt.dtype).float()
        bits = reference.nearest_with_mantissa(q, fmt)
        normal = q >= smallest_normal
        assert torch.equal((bits - q).abs()[normal], (cast - q).abs()[normal])
        assert ((bits - q).abs() <= (cast - q).abs())[~normal].all()
        assert (bits != cast)[~normal].any()  # below the smallest normal the measures differ


ADVERSARIAL_GROUPS = {
    "zeros": lambda fmt: torch.zeros(37),
    "one huge element": lambda fmt: torch.cat([torch.full((1,), 3e38), torch.full((40,), 1e-3)]),
    "all equal": lambda fmt: torch.full((48,), 0.3),
    "fp8 grid values": lambda fmt: torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float().nan_to_num(0, 0, 0)[:64],
    "fp32 subnormals": lambda fmt: torch.tensor([2.0**-149 * k for k in range(1, 34)]),
    "fp8 subnormal quotients": lambda fmt: torch.cat([torch.ones(1), torch.linspace(0, 2.0**-14, 47)]),
    "ties at grid midpoints": lambda fmt: torch.tensor(
        [fmt.max] + [1.0 + (2 * k + 1) * 2.0 ** -(fmt.mantissa_bits + 1) for k in range(31)]
    ),
    "signs mixed": lambda fmt: torch.tensor([(-1.0) ** k * (k + 0.5) for k in range(70)]),
}


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group", ADVERSARIAL_GROUPS)
@pytest.mark.parametrize("choice", SCALE_CHOICES)
def test_group_kernels_match_reference_on_adversarial_groups(fmt_name, dtype, scale_dtype, group, choice):
    """Groups chosen to break a search: zeros, a lone huge value, equal values (ties
    between candidates), the fp8 grid itself, fp32 subnormals, quotients in fp8's
    subnormal range, rounding ties, alternating signs; as token rows and as blocks of 16,
    32 and 37 (the whole-group vector path, rows that do not fill the 16 lanes, and a
    short last block); under the search and under amax scales."""
    fmt = FORMATS[fmt_name]
    x = ADVERSARIAL_GROUPS[group](fmt)
    if dtype != torch.float32:
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    x = x.to(dtype)
    for scaling, block in (("token", 0), ("block", 16), ("block", 32), ("block", 37)):
        codes, scales, bad = fast_quantize(x, fmt, scaling, block, scale_dtype, choice)
        ref_codes, ref_scales, ref_bad = reference.quantize(x, fmt, scaling, block, False, scale_dtype, choice)
        assert torch.equal(codes, ref_codes), (scaling, block)
        assert bad == ref_bad
        assert_same_bits(scales, ref_scales)


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("choice", SCALE_CHOICES)
def test_groups_encoded_four_at_a_time_match_reference_whatever_their_neighbours(fmt_name, dtype, choice):
    """Whole groups are encoded four at a time, in the same loops: every
    adversarial group beside every other (and itself), a NaN and an inf beside finite
    groups, an odd number of groups (the last ones alone), each as blocks of 32 and of 16,
    equals the reference."""
    fmt = FORMATS[fmt_name]
    groups = [ADVERSARIAL_GROUPS[name](fmt)[:32] for name in ADVERSARIAL_GROUPS]
    groups = [torch.cat([g, g.flip(0)])[:32] for g in groups]  # each 32 elements
    groups.append(torch.cat([torch.tensor([float("nan"), float("inf")]), torch.linspace(-2, 2, 30)]))
    x = torch.cat([torch.cat([a, b]) for a in groups for b in groups] + [groups[1]])  # an odd count of groups
    if dtype != torch.float32:
        x = torch.where(x.isfinite(), x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max), x)
    x = x.to(dtype)
    for block in (32, 16):
        codes, scales, bad = fast_quantize(x, fmt, "block", block, "bfloat16", choice)
        ref_codes, ref_scales, ref_bad = reference.quantize(x, fmt, "block", block, True, "bfloat16", choice)
        assert torch.equal(codes, ref_codes), block
        assert bad == ref_bad == 2 * 2 * len(groups)  # the NaN and inf group: once in each pair with it
        assert_same_bits(scales, ref_scales)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_group_kernels_match_reference_on_every_bf16_value(fmt_name):
    """Every finite bf16 value, shuffled into blocks of 32 under each scale dtype: every
    exponent the search's rounding meets, in groups of every spread."""
    fmt = FORMATS[fmt_name]
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)][torch.randperm(int(torch.isfinite(x).sum()), generator=torch.Generator().manual_seed(0))]
    for scale_dtype, choice in [(d, c) for d in SCALE_DTYPES for c in SCALE_CHOICES]:
        codes, scales, _ = fast_quantize(x, fmt, "block", 32, scale_dtype, choice)
        ref_codes, ref_scales, _ = reference.quantize(x, fmt, "block", 32, False, scale_dtype, choice)
        assert torch.equal(codes, ref_codes)
        assert_same_bits(scales, ref_scales)


def test_frames_written_by_the_first_search_decode_unchanged():
    """A frame the first mse search (fp64 errors, summed in element order) wrote, and what
    it decoded to then: the search is the encoder's choice, not part of the format."""
    from pathlib import Path

    from fp8ray.codec import decode

    data = Path(__file__).parent / "data"
    frame = (data / "mse_search_v1_frame.bin").read_bytes()
    expected = torch.frombuffer(bytearray((data / "mse_search_v1_decoded.bf16").read_bytes()), dtype=torch.bfloat16)
    out = decode(frame)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (2, 2, 16, 64)
    assert_same_bits(out.reshape(-1), expected)


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


@pytest.mark.parametrize("scaling, block", [("block", 32), ("block", 48), ("token", 0), ("channel", 0)])
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_paths_with_tails_and_tasks_that_start_mid_tensor_match_reference(scaling, block, fmt_name, dtype, monkeypatch):
    """The 16-lane paths next to their scalar rest: blocks of 32 and 48 with a short last
    one, rows of 40 (two chunks and 8 more, a scale per column under channel scaling),
    split into tasks that start mid-tensor."""
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 1000)
    monkeypatch.setenv("FP8RAY_NUM_THREADS", "3")
    fmt = FORMATS[fmt_name]
    x = kv_like((7, 37, 40), dtype, seed=11)  # 10360 elements: 323 blocks of 32 and 24 more, 215 of 48 and 40 more
    codes, scales, _ = fast_quantize(x, fmt, scaling, block)
    ref_codes, ref_scales, _ = reference.quantize(x, fmt, scaling, block, keep_nonfinite=False)
    assert torch.equal(codes, ref_codes)
    assert_same_bits(scales, ref_scales)
    out = fast_dequantize(codes, scales, fmt, scaling, x.shape, dtype, block)
    assert_same_bits(out, reference.dequantize(ref_codes, ref_scales, fmt, scaling, tuple(x.shape), dtype, block))


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
cpu.quantize(cpu.kernel_array(x), E4M3FN, "none", 0, codes, None)
ref, _, _ = reference.quantize(x, E4M3FN, "none", 0, True)
assert np.array_equal(codes, ref.numpy())
scales = torch.exp2(torch.linspace(-30, 30, 64))
c = torch.arange(256, dtype=torch.uint8).repeat(64)
out = torch.empty(64, 256, dtype=torch.float16)
cpu.dequantize(c.numpy(), scales.numpy(), E4M3FN, "token", (64, 256), 0, cpu.kernel_array(out))
expected = reference.dequantize(c, scales, E4M3FN, "token", (64, 256), torch.float16, 0)
nan = torch.isnan(expected)
assert torch.equal(out[~nan], expected[~nan]) and torch.isnan(out[nan]).all()
finite = x[torch.isfinite(x)][:61440]  # the scale search's vector path on fp16, blocks of 32
codes = np.empty(finite.numel(), np.uint8)
scales = np.empty(finite.numel() // 32, np.float32)
cpu.quantize(cpu.kernel_array(finite), E4M3FN, "block", 32, codes, scales, "bfloat16", "mse")
ref, ref_scales, _ = reference.quantize(finite, E4M3FN, "block", 32, False, "bfloat16", "mse")
assert np.array_equal(codes, ref.numpy()) and np.array_equal(scales, ref_scales.numpy())
import fp8ray  # whole frames: the checksum taken apart from the kernels (no SSE 4.2 assumed)
assert not kernels.CRC_IN_KERNELS
y = torch.randn(64, 48).to(torch.bfloat16)
frame = bytearray(fp8ray.Fp8Codec().encode(y))
codes, scales, _ = reference.quantize(y, E4M3FN, "block", 32, False, "bfloat16", "mse")
expected = reference.dequantize(codes, scales, E4M3FN, "block", (64, 48), torch.bfloat16, 32)
assert torch.equal(fp8ray.decode(frame).view(torch.int16), expected.view(torch.int16))
frame[-10] ^= 1
try:
    fp8ray.decode(frame)
    raise AssertionError("a damaged frame decoded")
except fp8ray.CorruptFrameError:
    pass
print("portable half ok")
"""


@pytest.mark.slow
def test_portable_half_conversions_match_torch(tmp_path):
    """The bit-level fp16 conversions, used where the CPU has no F16C: compiled for a
    generic x86-64 target in a subprocess, then checked like the native ones."""
    if platform.machine() != "x86_64":
        pytest.skip("the portable path is only forced on x86_64")
    env = {"NUMBA_CPU_NAME": "x86-64", "NUMBA_CPU_FEATURES": "+sse2", "NUMBA_CACHE_DIR": str(tmp_path)}
    assert "portable half ok" in python_output(PORTABLE_HALF_CHECK, env)


def python_output(script: str, env: dict, cwd=None) -> str:
    """What ``python -c script`` prints, run with these environment variables changed (a
    value None: unset); it must exit 0."""
    changed = {**os.environ, **{name: value for name, value in env.items() if value is not None}}
    for name in (name for name, value in env.items() if value is None):
        changed.pop(name, None)
    result = subprocess.run([sys.executable, "-c", script], env=changed, capture_output=True, text=True, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


GENERIC_CPU_CHECK = """
import numpy as np, torch, fp8ray
from fp8ray.codec import cpu, kernels, reference
from fp8ray.codec.formats import E4M3FN, num_scales
assert not (kernels.CRC_IN_KERNELS or kernels.bits.NATIVE_BF16 or kernels.bits._NATIVE_HALF)
assert not kernels.halfcast.HALF_CAST
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    x = (torch.randn(64, 48) * 5).to(dtype)
    frame = fp8ray.Fp8Codec().encode(x)
    assert fp8ray.decode(frame).dtype == dtype
    for scaling in ("none", "tensor", "channel", "block"):  # the division's codes, as the reference's
        codes, scales = np.empty(x.numel(), np.uint8), np.empty(num_scales(scaling, (64, 48), 32), np.float32)
        cpu.quantize(cpu.kernel_array(x), E4M3FN, scaling, 32, codes, scales)
        assert np.array_equal(codes, reference.quantize(x, E4M3FN, scaling, 32, False)[0].numpy()), (dtype, scaling)
print("generic ok")
"""


@pytest.mark.slow
def test_a_generic_cpu_target_takes_the_portable_paths(tmp_path):
    """Under ``NUMBA_CPU_NAME=generic`` numba compiles for no CPU features at all, so the
    kernels must not take the host's (F16C, AVX-512 BF16, SSE 4.2's crc32): LLVM could not
    select them and the process died on its first decode."""
    if platform.machine() != "x86_64":
        pytest.skip("an x86_64 host's features are what a generic target lacks")
    env = {"NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": None, "NUMBA_CACHE_DIR": str(tmp_path)}
    assert "generic ok" in python_output(GENERIC_CPU_CHECK, env)


NAN_BITS_CHECK = """
import numpy as np
from fp8ray.codec import cpu
from fp8ray.codec.formats import E4M3FN
out = np.empty(32, np.float32)
cpu.dequantize(np.full(32, 0x7F, np.uint8), np.empty(0, np.float32), E4M3FN, "none", (32,), 0, out)
print(hex(out.view(np.uint32)[0]))
"""


@pytest.mark.slow
def test_a_kernel_compiles_again_when_only_the_ir_it_is_built_from_changes(tmp_path):
    """Numba keys a cached kernel on its own file (decode.py), but its IR comes from
    bits.py too: an edit there alone must not leave the old machine code in use."""
    if not kernels.bits._NATIVE_HALF:
        pytest.skip("the canonical NaN is the fp16 path's")
    package = Path(__file__).resolve().parents[2] / "fp8ray"
    shutil.copytree(package, tmp_path / "fp8ray", ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PYTHONPATH": str(tmp_path), "NUMBA_CACHE_DIR": None}  # the copy's own in-tree cache
    assert python_output(NAN_BITS_CHECK, env, cwd=tmp_path).strip() == "0x7fc00000"  # compiled and cached
    copied = tmp_path / "fp8ray" / "codec" / "kernels" / "bits.py"
    copied.write_text(copied.read_text().replace("CANONICAL_NAN = 0x7FC00000", "CANONICAL_NAN = 0x7FC00001"))
    assert python_output(NAN_BITS_CHECK, env, cwd=tmp_path).strip() == "0x7fc00001"


@pytest.mark.parametrize("dtype", DTYPES)
def test_span_amax_is_the_largest_finite_magnitude(dtype):
    """kernels.amax_span over spans whose whole chunks go through vectors and whose last
    elements do not: the largest is placed in each part in turn, beside inf and NaN
    (each larger in its bits than any finite value)."""
    rng = np.random.default_rng(11)
    for n in (0, 7, 16, 37, 1000):
        for largest_at in {0, n // 2, n - 1} if n else {None}:
            x = torch.from_numpy(rng.uniform(-1, 1, n).astype(np.float32)).to(dtype)
            if largest_at is not None:
                x[largest_at] = -3.5
            for position, value in ((n // 3, float("inf")), (n - 2, float("nan")), (n // 5, float("-inf"))):
                if 0 <= position < n and position != largest_at:
                    x[position] = value
            src = cpu.kernel_array(x)
            for start, stop in ((0, n), (n // 4, n), (0, n - n // 3)):
                part = x[start:stop].float()
                finite = part[torch.isfinite(part)].abs()
                expected = float(finite.max()) if finite.numel() else 0.0
                assert kernels.amax_span(src, start, stop) == np.float32(expected), (n, largest_at, start, stop)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("columns", [7, 16, 40, 192])
def test_column_amax_is_each_columns_largest_finite_magnitude(dtype, columns):
    """kernels.amax_columns, whose whole 16-column chunks go by the source's bits and the
    rest by fp32 values: inf, NaN and the largest value are placed in both parts."""
    rng = np.random.default_rng(columns)
    x = torch.from_numpy(rng.uniform(-5, 5, (300, columns)).astype(np.float32)).to(dtype)
    for row, column, value in ((3, 0, float("inf")), (7, columns - 1, float("nan")), (9, columns // 2, float("-inf"))):
        x[row, column] = value
    x[11, columns - 1], x[13, 0] = -300.0, 250.0
    amax = np.zeros(columns, np.float32)
    kernels.amax_columns(cpu.kernel_array(x).reshape(-1), columns, 0, 300, amax)
    finite = torch.where(torch.isfinite(x.float()), x.float().abs(), 0.0)
    np.testing.assert_array_equal(amax, finite.amax(dim=0).numpy())
