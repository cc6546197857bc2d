"""The encode's cast by way of IEEE half (:mod:`fp8ray.codec.kernels.halfcast`) gives the
reference's codes: every bf16 and fp16 value under scales across (and just outside) the
range where its quotient is exact, every fp32 significand under a few scales, per-column
scales that mix both ways of casting within a pair, and pairs with a chunk left over."""

from __future__ import annotations

import os
import subprocess
import sys

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
    """On an x86 CPU with F16C, FMA and AVX2 or AVX-512 BW (this project's CI machines
    have one or the other) the half route is on; the tests below then check it, not the
    division's fallback."""
    if numba_config.CPU_NAME is not None or numba_config.CPU_FEATURES is not None:
        pytest.skip("numba compiles for a CPU of its settings, not this host's")
    features = llvm_binding.get_host_cpu_features()
    wide = features.get("avx512f", False) and features.get("avx512bw", False)
    has_them = features.get("f16c", False) and features.get("fma", False) and (wide or features.get("avx2", False))
    x86 = llvm_binding.get_process_triple().startswith("x86_64")
    assert halfcast.HALF_CAST is (has_them and x86)
    assert halfcast.WIDE is (wide and x86)


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


HASWELL = "+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+lzcnt,+movbe,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3"
AVX2_ROUTE_CHECK = """
import numpy as np, torch
from fp8ray.codec import cpu, kernels, reference
from fp8ray.codec.formats import FORMATS
from fp8ray.codec.kernels import halfcast
assert halfcast.HALF_CAST and not halfcast.WIDE
x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
for fmt in FORMATS.values():
    for scaling, choice in [(s, "amax") for s in ("none", "tensor", "channel", "token", "block")] + [
        ("token", "mse"), ("block", "mse")
    ]:
        expected_codes, expected_scales, _ = reference.quantize(x.reshape(256, 256), fmt, scaling, 32, True, "bfloat16", choice)
        codes, scales = np.empty(x.numel(), np.uint8), np.empty(expected_scales.numel(), np.float32)
        cpu.quantize(cpu.kernel_array(x.reshape(256, 256)), fmt, scaling, 32, codes, scales, "bfloat16", choice)
        assert np.array_equal(codes, expected_codes.numpy()), (fmt.name, scaling, choice)
        assert np.array_equal(scales, expected_scales.numpy()), (fmt.name, scaling, choice)
print("avx2 route ok")
"""


@pytest.mark.slow
def test_the_avx2_route_gives_the_reference_codes(tmp_path):
    """The route's AVX2 form (two 256-bit conversions a vector; one scale a pair only),
    compiled for a Haswell in a subprocess wherever the host can run one, so that a CI
    machine with AVX-512 checks it too: every bf16 value, in every scaling and choice."""
    features = llvm_binding.get_host_cpu_features()
    if not llvm_binding.get_process_triple().startswith("x86_64") or not all(
        features.get(name[1:], False) for name in HASWELL.split(",")
    ):
        pytest.skip("the host cannot run code compiled for a Haswell (AVX2, F16C, FMA)")
    # Numba takes the host's features unless told them (an AVX-512 host's would stay on).
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": HASWELL, "NUMBA_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", AVX2_ROUTE_CHECK], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "avx2 route ok" in result.stdout
