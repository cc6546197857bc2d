"""The plain-torch implementation of every scaling mode: the oracle and the CUDA path.

Everything here is written with ordinary torch ops so that it is obviously the
convention of :mod:`fp8ray.formats` and runs on any device. The CPU kernels in
:mod:`fp8ray.kernels` must reproduce these bytes and scales bit for bit; on CUDA the
codec calls these functions directly (one pass for the amax, one fused elementwise
chain for scale-clamp-cast), so the GPU path is the reference by construction.
"""

from __future__ import annotations

import math

import torch

from .formats import SMALLEST_NORMAL_SCALE, Fp8Format


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
    raise ValueError(f"unknown scaling {scaling!r}")


def _finite_amax(groups: torch.Tensor, dim: int) -> torch.Tensor:
    mags = torch.where(torch.isfinite(groups), groups.abs(), torch.zeros((), device=groups.device))
    if mags.shape[dim] == 0:
        out_shape = list(mags.shape)
        del out_shape[dim]
        return torch.zeros(out_shape, dtype=torch.float32, device=groups.device)
    return mags.amax(dim=dim)


def amax_to_scale(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """``scale = amax / finfo.max`` in fp32; 1 for a zero group, at least 2**-126 otherwise."""
    scale = (amax.float() / fmt.max).clamp_min(SMALLEST_NORMAL_SCALE)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def quantize(
    x: torch.Tensor, fmt: Fp8Format, scaling: str, block_size: int, keep_nonfinite: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Quantize ``x`` (bf16, fp16 or fp32, any shape).

    Returns ``(codes, scales, nonfinite)``: the flat uint8 codes in row-major order,
    the flat fp32 scales, and the number of non-finite inputs. Non-finite inputs get
    the format's NaN/inf codes when ``keep_nonfinite``; otherwise the caller raises.
    """
    shape = tuple(x.shape)
    flat = x.contiguous().reshape(-1).float()
    groups = _grouped(flat, scaling, shape, block_size)
    if scaling == "none":
        scales = torch.empty(0, dtype=torch.float32, device=x.device)
        scaled = groups
    elif scaling == "channel":
        scales = amax_to_scale(_finite_amax(groups, dim=0), fmt)
        scaled = groups / scales
    else:
        scales = amax_to_scale(_finite_amax(groups, dim=1), fmt)
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
