"""The timing the kernel and codec scripts share (scripts/plain_kernels.py, scripts/codec_best.py)."""

from __future__ import annotations

import time


def best_seconds(call, repeat: int) -> float:
    """The least wall time of ``repeat`` calls, after one that warms up (loads the kernel)."""
    call()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best
