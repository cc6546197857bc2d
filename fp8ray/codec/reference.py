"""The plain-torch implementation of every scaling mode: the oracle and the CUDA path.

Everything here is written with ordinary torch ops so that it is obviously the
convention of :mod:`fp8ray.codec.formats` and runs on any device. The CPU kernels in
:mod:`fp8ray.codec.kernels` must reproduce these bytes and scales bit for bit; on CUDA the
codec calls these functions directly (one pass for the amax, one fused elementwise
chain for scale-clamp-cast), so the GPU path is the reference by construction.
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
        pad = (-x.numel()) % block_size
        return torch.nn.functional.pad(x, (0, pad)).reshape(-1, block_size)
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


def lane_sums(terms: torch.Tensor) -> torch.Tensor:
    """Row sums of fp32 ``terms`` in the search's fixed order, so that any implementation
    can reproduce them bit for bit with vector adds: the row is zero-padded to a multiple
    of SEARCH_LANES; lane ``j`` adds the terms ``j, j + 16, j + 32, ...`` in that order;
    then ``lane[j] += lane[j + w]`` for w = 8, 4, 2, 1, and lane 0 is the sum."""
    count = -(-terms.shape[1] // SEARCH_LANES)
    padded = torch.nn.functional.pad(terms, (0, count * SEARCH_LANES - terms.shape[1]))
    chunks = padded.reshape(terms.shape[0], count, SEARCH_LANES)
    lanes = torch.zeros(terms.shape[0], SEARCH_LANES, dtype=terms.dtype, device=terms.device)
    for m in range(chunks.shape[1]):
        lanes = lanes + chunks[:, m]
    w = SEARCH_LANES // 2
    while w:
        lanes = lanes[:, :w] + lanes[:, w : 2 * w]
        w //= 2
    return lanes[:, 0]


def search_error(magnitudes: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The mse search's error of each row of ``magnitudes`` (|x|, non-finite as 0) under
    its scale, in fp64: ``scale**2 * lane_sums((fp8(min(q, max)) - q)**2)`` with
    ``q = |x| * (1 / scale)``, every step in fp32 until the product by ``scale**2``.

    It measures in units of the scale, through a reciprocal product, so that a vector unit
    computes it fast; the codes are still ``x / scale`` (see :func:`quantize`).
    """
    q = magnitudes * (torch.ones_like(scales) / scales)[:, None]
    d = q.clamp_max(fmt.max).to(fmt.dtype).float() - q
    wide = scales.double()
    return lane_sums(d * d).double() * (wide * wide)


def choose_scales(groups: torch.Tensor, amax: torch.Tensor, fmt: Fp8Format, scale_dtype: str, scale_choice: str) -> torch.Tensor:
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
    best_error = search_error(magnitudes, best, fmt)
    for c in candidates[1:]:
        scales = amax_to_scale(amax, fmt, c, scale_dtype)
        err = search_error(magnitudes, scales, fmt)
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
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Quantize ``x`` (bf16, fp16 or fp32, any shape).

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
        scales = choose_scales(groups, _finite_amax(groups, dim=1), fmt, scale_dtype, choice)
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
