"""The encode's cast by way of IEEE half (:mod:`fp8ray.codec.kernels.halfcast`) gives the
reference's codes: every bf16 and fp16 value under scales across (and just outside) the
range where its quotient is exact, every fp32 significand under a few scales, per-column
scales that mix both ways of casting within a pair, and pairs with a chunk left over."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llvmlite import binding as llvm_binding
from numba.core import config as numba_config

from fp8ray.codec import cpu, kernels
from fp8ray.codec.formats import FORMATS, Fp8Format
from fp8ray.codec.kernels import halfcast


def expected_codes(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> np.ndarray:
    """The reference's definition (fp8ray.codec.reference.quantize) under given scales:
    ``x / scale`` in fp32, clamped, cast; non-finite inputs get the NaN/inf codes."""
    flat = x.float()
    codes = (flat / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)
    special = torch.where(flat == float("inf"), fmt.posinf_code, fmt.nan_code)
    special = torch.where(flat == float("-inf"), fmt.neginf_code, special).to(torch.uint8)
    return torch.where(torch.isfinite(flat), codes, special).numpy()


def uniform_codes(x: torch.Tensor, scale: float, fmt: Fp8Format) -> tuple[np.ndarray, int]:
    codes = np.empty(x.numel(), np.uint8)
    bad = kernels.quantize_uniform(cpu.kernel_array(x), codes, 0, x.numel(), np.float32(scale), kernels.FORMAT_TAGS[fmt.name])
    return codes, bad


def scales_across_the_range(fmt: Fp8Format) -> list[float]:
    """Scales whose s' (times 2**(15 - bias)) reach each end of halfcast.SCALE_RANGE, just
    inside and just outside it, the smallest scale, and random ones between."""
    factor = np.float32(2.0 ** (15 - fmt.exponent_bias))
    low, high = (np.float32(bound) / factor for bound in halfcast.SCALE_RANGE)
    edges = [low, high, np.nextafter(low, np.float32(0)), np.nextafter(high, np.float32(np.inf))]
    edges += [np.nextafter(low, np.float32(1)), np.nextafter(high, np.float32(0))]
    rng = np.random.default_rng(7)
    between = (rng.uniform(1, 2, 24) * 2.0 ** rng.integers(-70, 55, 24)).astype(np.float32)
    return [float(s) for s in [*edges, np.float32(2.0**-126), np.float32(1), np.float32(0.37), *between]]


def test_the_half_route_is_taken_where_the_cpu_has_it():
    """On an x86 CPU with AVX-512 BW, F16C and FMA (this project's CI) the half route is
    on; the tests below then check it, not the division's fallback."""
    if numba_config.CPU_NAME is not None or numba_config.CPU_FEATURES is not None:
        pytest.skip("numba compiles for a CPU of its settings, not this host's")
    features = llvm_binding.get_host_cpu_features()
    has_them = all(features.get(name, False) for name in ("avx512f", "avx512bw", "f16c", "fma"))
    x86 = llvm_binding.get_process_triple().startswith("x86_64")
    assert halfcast.HALF_CAST is (has_them and x86)


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_value_under_scales_across_the_range(fmt_name, dtype):
    fmt = FORMATS[fmt_name]
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    for scale in scales_across_the_range(fmt):
        codes, bad = uniform_codes(x, scale, fmt)
        expected = expected_codes(x, torch.tensor(scale, dtype=torch.float32), fmt)
        assert bad == int((~torch.isfinite(x)).sum())
        mismatched = np.flatnonzero(codes != expected)
        assert mismatched.size == 0, f"scale {scale!r}: {mismatched.size} codes differ, first x={x[mismatched[0]].item()!r}"


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_every_fp32_significand_under_a_few_scales(fmt_name):
    """All 2**23 significands, each at a random exponent that puts its quotient anywhere
    from below the smallest subnormal to past the largest code, with random signs."""
    fmt = FORMATS[fmt_name]
    rng = np.random.default_rng(3)
    significands = np.arange(2**23, dtype=np.uint32) | np.uint32(127 << 23)  # [1, 2)
    for scale in (np.float32(0.37), np.float32(1.0) + np.float32(2.0**-23), np.float32(3.9999998), np.float32(2.0**-40) * 1.7):
        low = int(np.floor(np.log2(scale))) - fmt.exponent_bias - fmt.mantissa_bits - 3
        exponents = rng.integers(low, low + fmt.exponent_bias + fmt.mantissa_bits + 15, significands.size).astype(np.uint32)
        signs = rng.integers(0, 2, significands.size).astype(np.uint32) << np.uint32(31)
        bits = (significands & np.uint32(0x807FFFFF)) | ((exponents + np.uint32(127)) << np.uint32(23)) | signs
        x = torch.from_numpy(bits.view(np.float32))
        codes, _ = uniform_codes(x, float(scale), fmt)
        mismatched = np.flatnonzero(codes != expected_codes(x, torch.tensor(scale), fmt))
        assert mismatched.size == 0, f"scale {scale!r}: {mismatched.size} codes differ, first x={x[mismatched[0]].item()!r}"


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_per_column_scales_mixing_both_casts_within_a_pair(fmt_name, dtype):
    """Rows of 80 columns (two pairs and a chunk) under a scale per column, some of them
    outside the half route's range, and non-finite inputs here and there: the pair's
    lanes are reordered for the half route, so each lane must meet its own scale."""
    fmt = FORMATS[fmt_name]
    rows, columns = 64, 80
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((rows, columns), dtype=np.float32) * 2.0 ** rng.integers(-12, 12, (rows, columns)))
    x = x.to(dtype).float()
    x[3, 5], x[9, 40], x[17, 77], x[20, 31] = float("nan"), float("inf"), float("-inf"), float("nan")
    x = x.to(dtype)
    scales = (rng.uniform(1, 2, columns) * 2.0 ** rng.integers(-30, 30, columns)).astype(np.float32)
    scales[[2, 33, 70]] = np.float32(2.0**-126), np.float32(2.0**100), np.float32(2.0**-100)  # outside: divided
    codes = np.empty(x.numel(), np.uint8)
    source = cpu.kernel_array(x).reshape(-1)
    bad = kernels.quantize_columns(source, codes, scales, columns, 0, rows, kernels.FORMAT_TAGS[fmt.name])
    assert bad == 4
    np.testing.assert_array_equal(codes, expected_codes(x, torch.from_numpy(scales), fmt).reshape(-1))


@pytest.mark.parametrize("n", [16, 32, 48, 80, 100])
def test_pairs_with_a_chunk_or_elements_left_over(n):
    fmt = FORMATS["e4m3fn"]
    x = torch.from_numpy(np.random.default_rng(n).standard_normal(n, dtype=np.float32) * 50).to(torch.bfloat16)
    x[n // 2] = float("-inf")
    codes, bad = uniform_codes(x, 0.21, fmt)
    assert bad == 1
    np.testing.assert_array_equal(codes, expected_codes(x, torch.tensor(0.21), fmt))
