"""The plain-torch implementation of every scaling mode: the oracle and the CUDA path.

Everything here is written with ordinary torch ops so that it is obviously the
convention of :mod:`fp8ray.codec.formats` and runs on any device. The CPU kernels in
:mod:`fp8ray.codec.kernels` must reproduce these bytes and scales bit for bit; on CUDA the
codec calls these functions directly (one pass for the amax, one fused elementwise
chain for scale-clamp-cast), so the GPU path is the reference by construction, but for
the mse search's work per element (:func:`error_lanes`), which runs there as one Triton
kernel of the same operations (:mod:`fp8ray.codec.cuda_search`; ``scripts/device_check``
compares the two).
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidOptionError
from .formats import SCALE_MASKS, SMALLEST_NORMAL_SCALE, Fp8Format, scale_candidates


def _grouped(x: torch.Tensor, scaling: str, shape: tuple[int, ...], block_size: int) -> torch.Tensor:
    """View the flat fp32 tensor as [groups, group_len] (or [rows, channels] for channel)."""
    last = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if shape else 1
    if scaling in ("none", "tensor"):
        return x.reshape(1, -1)
    if scaling in ("token", "channel"):
        return x.reshape(rows, last)
    if scaling == "block":
        # A block past the end is padded only as far as the elements present: zeros change
        # neither its amax nor its search error, and a block size may be 2**32 - 1.
        length = min(block_size, x.numel()) or block_size
        pad = (-x.numel()) % length
        return torch.nn.functional.pad(x, (0, pad)).reshape(-1, length)
    raise InvalidOptionError(f"unknown scaling {scaling!r}", field="scaling")


def _finite_amax(groups: torch.Tensor, dim: int) -> torch.Tensor:
    mags = torch.where(torch.isfinite(groups), groups.abs(), torch.zeros((), device=groups.device))
    if mags.shape[dim] == 0:
        out_shape = list(mags.shape)
        del out_shape[dim]
        return torch.zeros(out_shape, dtype=torch.float32, device=groups.device)
    return mags.amax(dim=dim)


def amax_to_scale(amax: torch.Tensor, fmt: Fp8Format, divisor: float | None = None, scale_dtype: str = "float32") -> torch.Tensor:
    """``scale = amax / divisor`` in fp32 (divisor finfo.max unless given); 1 for a zero
    group, at least 2**-126 otherwise; then truncated to ``scale_dtype``."""
    # A 0-d tensor, not a Python number: CUDA divides by a CPU scalar as a product with
    # its reciprocal, which can differ from the division in the last bit.
    divisor = torch.tensor(fmt.max if divisor is None else divisor, dtype=torch.float32, device=amax.device)
    scale = (amax.float() / divisor).clamp_min(SMALLEST_NORMAL_SCALE)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    mask = SCALE_MASKS[scale_dtype]
    if mask != 0xFFFFFFFF:  # round toward zero to the stored dtype (positive numbers: drop the low bits)
        scale = (scale.view(torch.int32) & (mask - 2**32)).view(torch.float32)
    return scale


SEARCH_LANES = 16  # partial sums per candidate in the mse search


def fused_square_add(d: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """fp32 ``d * d + acc`` rounded once, as a fused multiply-add computes it (``acc >= 0``).

    In fp64 ``d * d`` is exact and the sum is rounded to odd (TwoSum gives the sum's
    error; an inexact even result moves to its odd neighbour), and a round-to-odd result
    with 53 >= 24 + 2 bits rounds to fp32 as the exact value would (Boldo and Melquiond).
    """
    a = d.double() * d.double()
    b = acc.double()
    s = a + b
    b_part = s - a
    err = (a - (s - b_part)) + (b - b_part)
    bits = s.view(torch.int64)
    toward_exact = torch.where(err > 0, 1, -1)  # s > 0 wherever err != 0
    bits = torch.where((err != 0) & ((bits & 1) == 0), bits + toward_exact, bits)
    return bits.view(torch.float64).float()


def lane_square_sums(d: torch.Tensor) -> torch.Tensor:
    """Row sums of the squares of fp32 ``d`` in the search's fixed order, so that any
    implementation can reproduce them bit for bit with vector fused multiply-adds: the
    row is zero-padded to a multiple of SEARCH_LANES; lane ``j`` takes ``lane =
    fma(d, d, lane)`` (one rounding, :func:`fused_square_add`) for ``d_j, d_(j+16),
    d_(j+32), ...`` in that order, from 0 (:func:`square_lanes`); then ``lane[j] +=
    lane[j + w]`` for w = 8, 4, 2, 1 in fp32, and lane 0 is the sum (:func:`halve_lanes`)."""
    return halve_lanes(square_lanes(d))


def square_lanes(d: torch.Tensor) -> torch.Tensor:
    """The ``[rows, SEARCH_LANES]`` lanes of :func:`lane_square_sums` before they are added."""
    lanes = torch.zeros(d.shape[0], SEARCH_LANES, dtype=torch.float32, device=d.device)
    if not d.shape[0]:  # no rows: nothing to add, however long a row would be
        return lanes
    count = -(-d.shape[1] // SEARCH_LANES)
    padded = torch.nn.functional.pad(d, (0, count * SEARCH_LANES - d.shape[1]))
    chunks = padded.reshape(d.shape[0], count, SEARCH_LANES)
    for m in range(chunks.shape[1]):
        lanes = fused_square_add(chunks[:, m], lanes)
    return lanes


def halve_lanes(lanes: torch.Tensor) -> torch.Tensor:
    """Lane 0 of ``lanes[:, j] += lanes[:, j + w]`` for w = 8, 4, 2, 1, in fp32."""
    w = SEARCH_LANES // 2
    while w:
        lanes = lanes[:, :w] + lanes[:, w : 2 * w]
        w //= 2
    return lanes[:, 0]


def nearest_with_mantissa(q: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Non-negative fp32 ``q`` rounded to ``fmt``'s mantissa bits, relative at every
    magnitude (no subnormal floor, no clamp), ties away from zero: two integer operations
    on the bits. For the squared error that the search measures, a tie's direction does
    not matter; below the format's smallest normal it measures the finer relative grid,
    which changes only terms under ``2**(min_subnormal_exp - 1)`` in units of the scale."""
    shift = 23 - fmt.mantissa_bits
    return ((q.view(torch.int32) + (1 << (shift - 1))) & -(1 << shift)).view(torch.float32)


def error_lanes(magnitudes: torch.Tensor, recips: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The :func:`square_lanes` of ``nearest_with_mantissa(q) - q``, ``q = magnitudes *
    recips[:, None]`` in fp32: the search's work per element, which the CUDA path may
    run as one kernel instead (:mod:`fp8ray.codec.cuda_search`, the same bits)."""
    q = magnitudes * recips[:, None]
    return square_lanes(nearest_with_mantissa(q, fmt) - q)


def search_error(magnitudes: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format, lanes_of=error_lanes) -> torch.Tensor:
    """The mse search's error of each row of ``magnitudes`` (|x|, non-finite as 0) under
    its scale, in fp64: ``scale**2 * lane_square_sums(nearest_with_mantissa(q) - q)`` with
    ``q = |x| * (1 / scale)``, every step in fp32 until the product by ``scale**2``.
    ``lanes_of``: :func:`error_lanes`, or a function that gives the same bits.

    It measures in units of the scale, through a reciprocal, with the grid's rounding
    done on the bits and the squares summed by fused multiply-adds, so that a vector unit
    computes it in five operations per element and candidate; the codes are still
    ``x / scale`` (see :func:`quantize`). ``|x| / scale`` never exceeds the format's
    largest value by more than its half-spacing there (:func:`fp8ray.codec.kernels.pad_candidates`),
    so the unclamped rounding equals the clamped one.
    """
    lanes = lanes_of(magnitudes, torch.ones_like(scales) / scales, fmt)
    wide = scales.double()
    return halve_lanes(lanes).double() * (wide * wide)


def choose_scales(
    groups: torch.Tensor, amax: torch.Tensor, fmt: Fp8Format, scale_dtype: str, scale_choice: str, lanes_of=error_lanes
) -> torch.Tensor:
    """One scale per row of ``groups`` (fp32, padded with zeros), as :mod:`fp8ray.codec.formats` specifies.

    Under ``"mse"``: each candidate divisor ``c`` in turn gives the scales
    ``amax_to_scale(amax, c)`` and their :func:`search_error`; a later candidate
    replaces the best only if its error is strictly smaller.
    """
    candidates = scale_candidates(fmt, scale_choice)
    best = amax_to_scale(amax, fmt, candidates[0], scale_dtype)
    if len(candidates) == 1:
        return best
    magnitudes = torch.where(torch.isfinite(groups), groups.abs(), torch.zeros((), device=groups.device))
    best_error = search_error(magnitudes, best, fmt, lanes_of)
    for c in candidates[1:]:
        scales = amax_to_scale(amax, fmt, c, scale_dtype)
        err = search_error(magnitudes, scales, fmt, lanes_of)
        better = err < best_error
        best = torch.where(better, scales, best)
        best_error = torch.where(better, err, best_error)
    return best


def quantize(
    x: torch.Tensor,
    fmt: Fp8Format,
    scaling: str,
    block_size: int,
    keep_nonfinite: bool,
    scale_dtype: str = "float32",
    scale_choice: str = "amax",
    lanes_of=error_lanes,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Quantize ``x`` (bf16, fp16 or fp32, any shape). ``lanes_of``: the search's work per
    element, :func:`error_lanes` or one that gives the same bits (:func:`search_error`).

    Returns ``(codes, scales, nonfinite)``: the flat uint8 codes in row-major order,
    the flat fp32 scales (values of ``scale_dtype``), and the number of non-finite
    inputs. Non-finite inputs get the format's NaN/inf codes when ``keep_nonfinite``;
    otherwise the caller raises. ``scale_choice="mse"`` applies to token and block scaling.
    """
    shape = tuple(x.shape)
    flat = x.contiguous().reshape(-1).float()
    groups = _grouped(flat, scaling, shape, block_size)
    if scaling == "none":
        scales = torch.empty(0, dtype=torch.float32, device=x.device)
        scaled = groups
    elif scaling == "channel":
        scales = amax_to_scale(_finite_amax(groups, dim=0), fmt, scale_dtype=scale_dtype)
        scaled = groups / scales
    else:
        choice = scale_choice if scaling in ("token", "block") else "amax"
        scales = choose_scales(groups, _finite_amax(groups, dim=1), fmt, scale_dtype, choice, lanes_of)
        scaled = groups / scales[:, None]
    codes = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8).reshape(-1)[: flat.numel()]
    nonfinite_mask = ~torch.isfinite(flat)
    nonfinite = int(nonfinite_mask.sum())
    if nonfinite and keep_nonfinite:
        special = torch.full_like(codes, fmt.nan_code)
        special = torch.where(flat == float("inf"), fmt.posinf_code, special)
        special = torch.where(flat == float("-inf"), fmt.neginf_code, special).to(torch.uint8)
        codes = torch.where(nonfinite_mask, special, codes)
    return codes, scales, nonfinite


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: Fp8Format,
    scaling: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    block_size: int,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``fp32(code) * scale`` rounded to ``dtype``, in ``shape``."""
    values = codes.reshape(-1).view(fmt.dtype).float()
    if scaling != "none":
        numel = values.numel()
        groups = _grouped(values, scaling, shape, block_size)
        groups = groups * (scales if scaling == "channel" else scales[:, None])
        values = groups.reshape(-1)[:numel]
    return values.to(dtype).reshape(shape)
