"""The scale search's kernel against its plain twin, alone, on one thread: nanoseconds per
group of the default mode's search (``quantize_groups_search``) and of the same groups
under amax scales (``quantize_groups``), and their ratio, for blocks of 32 and rows of 192
(the shapes of the default mode and of token scaling on LMCache's chunks).

    .venv/bin/python scripts/search_kernel.py [--mib 2] [--repeat 30]

Times are thread CPU time (``time.thread_time_ns``), which other processes' load inflates
less than wall time; the two kernels alternate, and the minimum of each is printed. The
kernel figures of BENCHMARKS.md's issue 17 sections come from this script; the whole
codec's are ``fp8ray bench codec``'s.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fp8ray.codec import kernels
from fp8ray.codec.formats import E4M3FN, SCALE_MASKS, scale_candidates


def per_group_ns(x: np.ndarray, group: int, repeat: int) -> tuple[float, float]:
    """Minimum thread CPU time per group of the search and of its plain twin over ``x``
    (bfloat16 bits), the two taken in turns, after a call of each to load them."""
    groups = x.size // group
    codes, scales = np.empty(x.size, np.uint8), np.empty(groups, np.float32)
    tag, mask = kernels.FORMAT_TAGS[E4M3FN.name], np.int64(SCALE_MASKS["bfloat16"])
    divisors = kernels.pad_candidates(scale_candidates(E4M3FN, "mse"), E4M3FN.max)
    calls = {
        "search": lambda: kernels.quantize_groups_search(x, codes, scales, group, 0, groups, tag, mask, divisors),
        "plain": lambda: kernels.quantize_groups(x, codes, scales, group, 0, groups, tag, mask),
    }
    times = {name: [] for name in calls}
    for round_ in range(repeat + 1):
        for name, call in calls.items():
            start = time.thread_time_ns()
            call()
            if round_:  # the first round loads the kernels
                times[name].append(time.thread_time_ns() - start)
    return min(times["search"]) / groups, min(times["plain"]) / groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=2, help="bfloat16 input per call, MiB (default 2)")
    parser.add_argument("--repeat", type=int, default=30, help="timed calls of each kernel (default 30)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(args.mib << 19, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    for group in (32, 192):
        search, plain = per_group_ns(x, group, args.repeat)
        print(f"groups of {group}: search {search:.1f} ns per group, plain {plain:.1f}, plain / search {plain / search:.3f}")


if __name__ == "__main__":
    main()
