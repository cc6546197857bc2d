"""The Triton kernel of :mod:`fp8ray.codec.cuda_search` (importing this imports Triton)."""

import triton
import triton.language as tl


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
    """``reference.error_lanes`` of ``ROWS`` rows of ``LENGTH`` magnitudes: lane ``j`` of a
    row takes ``fma(d, d, lane)`` for its elements ``j, j + LANES, ...`` in order, ``d``
    the rounding error of ``q = m * recip`` on the grid of ``KEEP``'s mantissa bits."""
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
