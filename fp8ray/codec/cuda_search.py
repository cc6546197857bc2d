"""The scale search's work per element as one Triton kernel, for the CUDA path.

:func:`fp8ray.codec.reference.error_lanes` written in torch ops emulates each fused
multiply-add in fp64 (a dozen passes over the data per candidate): on an H200 the default
mode's search took 110 ms for 128 Mi elements, 20x the amax mode's whole quantize
(BENCHMARKS.md, "GPU"). Here each element is read once per candidate and the lanes are
summed with the GPU's own fused multiply-add: the same operations in the same order, so
the same bits (``scripts/device_check`` compares every frame with the CPU kernels').
Floating-point contraction is off for the kernel, so that ``round(q) - q`` stays a
subtraction of the rounded product, as the reference computes it.

Where Triton is not installed (it comes with CUDA builds of torch on Linux), the torch
ops run instead.
"""

from __future__ import annotations

import functools

import torch

from . import reference
from .formats import Fp8Format

ROWS = 32  # groups per program


def lanes_for(device: torch.device):
    """The function that computes :func:`~fp8ray.codec.reference.error_lanes` on ``device``."""
    return error_lanes if device.type == "cuda" and _kernel() is not None else reference.error_lanes


def error_lanes(magnitudes: torch.Tensor, recips: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """:func:`fp8ray.codec.reference.error_lanes` of CUDA tensors, in one kernel."""
    import triton

    rows, length = magnitudes.shape
    magnitudes, recips = magnitudes.contiguous(), recips.contiguous()
    lanes = torch.empty(rows, reference.SEARCH_LANES, dtype=torch.float32, device=magnitudes.device)
    if rows:
        shift = 23 - fmt.mantissa_bits  # nearest_with_mantissa on the bits
        with torch.cuda.device(magnitudes.device):  # Triton launches on the current device
            _kernel()[(triton.cdiv(rows, ROWS),)](
                magnitudes,
                recips,
                lanes,
                rows,
                LENGTH=length,  # a constant: one compile per group length (block size, or row length)
                HALF=1 << (shift - 1),
                KEEP=-(1 << shift),
                ROWS=ROWS,
                LANES=reference.SEARCH_LANES,
                enable_fp_fusion=False,
            )
    return lanes


@functools.cache
def _kernel():
    """The Triton kernel, compiled on first use; None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def square_lanes(
        mag_ptr,
        recip_ptr,
        out_ptr,
        rows,
        LENGTH: tl.constexpr,
        HALF: tl.constexpr,
        KEEP: tl.constexpr,
        ROWS: tl.constexpr,
        LANES: tl.constexpr,
    ):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        lane = tl.arange(0, LANES)
        live = row < rows
        recip = tl.load(recip_ptr + row, mask=live, other=1.0)
        base = row.to(tl.int64) * LENGTH
        acc = tl.zeros([ROWS, LANES], dtype=tl.float32)
        for start in range(0, LENGTH, LANES):
            column = start + lane
            inside = live[:, None] & (column < LENGTH)[None, :]
            # Outside the row, 0: its error is 0 and fma(0, 0, acc) is acc, as the reference's padding.
            m = tl.load(mag_ptr + base[:, None] + column[None, :], mask=inside, other=0.0)
            q = m * recip[:, None]
            nearest = ((q.to(tl.int32, bitcast=True) + HALF) & KEEP).to(tl.float32, bitcast=True)
            d = nearest - q
            acc = tl.fma(d, d, acc)
        tl.store(out_ptr + row.to(tl.int64)[:, None] * LANES + lane[None, :], acc, mask=live[:, None])

    return square_lanes
