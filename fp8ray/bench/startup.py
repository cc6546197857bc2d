"""``fp8ray bench startup``: the wall time of ``fp8ray --help`` beside the interpreter's own
start (``python -c pass``), best of several runs each, and their ratio."""

from __future__ import annotations

import subprocess
import sys
import time


def best_wall(argv: list[str], runs: int) -> float:
    """The shortest wall time of ``runs`` runs of ``argv`` (each must exit 0)."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        best = min(best, time.perf_counter() - start)
    return best


def bench_startup(runs: int) -> str:
    bare = best_wall([sys.executable, "-c", "pass"], runs)
    help_ = best_wall([sys.executable, "-m", "fp8ray.cli", "--help"], runs)
    return (
        f"fp8ray bench startup (best of {runs}): fp8ray --help {help_ * 1000:.0f} ms, "
        f"python -c pass {bare * 1000:.0f} ms: {help_ / bare:.1f}x the interpreter's own start"
    )
