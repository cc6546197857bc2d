"""Helpers shared by the tests: reference comparisons and the derived error bound."""

from __future__ import annotations

import numpy as np
import torch

from fp8ray.codec.formats import FORMATS

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALINGS = ("none", "tensor", "channel", "token", "block")

# Output rounding of the original dtype: unit roundoff u_out, and half its smallest
# subnormal (the absolute error of rounding into its subnormal range).
U_OUT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}
HALF_SUBNORMAL_OUT = {torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25, torch.float32: 2.0**-150}


def bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of a tensor, for bit-exact comparison."""
    t = t.contiguous().reshape(-1)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(view).numpy()


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical, except that any two NaNs count as equal (payloads are not a contract)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = bits(actual), bits(expected)
    nan = torch.isnan(actual.float()).reshape(-1).numpy() & torch.isnan(expected.float()).reshape(-1).numpy()
    mismatch = np.flatnonzero((a != e) & ~nan)
    assert mismatch.size == 0, f"{mismatch.size} elements differ, first at {mismatch[0]}: {a[mismatch[0]]:#x} vs {e[mismatch[0]]:#x}"


def element_scales(scales: torch.Tensor, scaling: str, shape, block_size: int) -> torch.Tensor:
    """The scale that applies to each element, flat, in row-major order."""
    numel = int(np.prod(shape)) if len(shape) else 1
    last = shape[-1] if len(shape) else 1
    if scaling == "none":
        return torch.ones(numel)
    if scaling == "tensor":
        return scales.expand(numel)
    if scaling == "channel":
        return scales.repeat(numel // last if last else 0)
    group = last if scaling == "token" else block_size
    return scales.repeat_interleave(group)[:numel]


def error_bound(x: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """Per-element bound on |deq - x|, derived in docs/ACCURACY.md.

    The issue's bound  (u/(1+u))|x| + scale*2^(emin_sub-1) + u_out|deq|  plus the terms of
    the fp32 arithmetic it leaves out: the roundings of x/scale and of fp8*scale (each at
    most 2^-24 relative, bounded together by 2^-22 (|x| + |deq|)), half the smallest
    subnormal of the output dtype, and 2^-149 for an fp32-subnormal product.
    """
    fmt = FORMATS[fmt_name]
    u = fmt.unit_roundoff
    xa = x.double().abs().reshape(-1)
    da = deq.double().abs().reshape(-1)
    s = scale.double().reshape(-1)
    return (
        (u / (1 + u)) * xa
        + s * 2.0 ** (fmt.min_subnormal_exp - 1)
        + U_OUT[deq.dtype] * da
        + 2.0**-22 * (xa + da)
        + HALF_SUBNORMAL_OUT[deq.dtype]
        + 2.0**-149
    )


def kv_like(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """Random data of many magnitudes: log-uniform over 2^-20..2^12 per channel, random signs."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.empty(shape).uniform_(-20, 12, generator=g)) if len(shape) else torch.tensor(1.5)
    signs = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (mags * signs).to(dtype)
