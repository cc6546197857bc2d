"""The plain modes' kernels alone, on one thread: nanoseconds per element of the encode
(one scale: ``quantize_uniform``; blocks of 32 under amax scales: ``quantize_groups``,
and under the default's search: ``quantize_groups_search``; a scale per column:
``quantize_columns``), of the tensor's and the columns' amax (``amax_span``,
``amax_columns``) and of the decode into bfloat16 and float32 (``dequantize_uniform``,
and blocks of 32: ``dequantize_groups``), on data that fits the CPU's cache and on 11.8M
elements (four LMCache chunks of SmolLM2).

    PYTHONPATH=<tree> .venv/bin/python scripts/plain_kernels.py [--repeat 30]

Run it with PYTHONPATH on two trees, in turns, to compare them. Wall time, the minimum
of ``--repeat`` calls after one that loads the kernel; e4m3fn codes, bf16 ``randn * 3``
input. The kernel figures of BENCHMARKS.md's 2026-12-05 sections come from this script;
the whole codec's are ``fp8ray bench codec``'s.
"""

from __future__ import annotations

import argparse

import numpy as np
from _timing import best_seconds  # scripts/, this script's directory

from fp8ray.codec import kernels
from fp8ray.codec.formats import E4M3FN, SCALE_MASKS, scale_candidates

SIZES = (368_640, 11_796_480)  # a fifth of a chunk (in L2), and four chunks
GROUP = 32
COLUMNS = 192  # SmolLM2's head dimension times its 3 KV heads


def best_ns_per_element(call, n: int, repeat: int) -> float:
    return best_seconds(call, repeat) * 1e9 / n


def kernel_calls(n: int, rng: np.random.Generator) -> dict:
    """The timed calls, by name, on ``n`` elements of bf16 ``randn * 3``."""
    tag, mask = kernels.FORMAT_TAGS[E4M3FN.name], np.int64(SCALE_MASKS["float32"])
    x = ((rng.standard_normal(n, dtype=np.float32) * 3).view(np.uint32) >> 16).astype(np.uint16)
    codes, scales, groups = np.empty(n, np.uint8), np.empty(n // GROUP, np.float32), n // GROUP
    kernels.quantize_groups(x, codes, scales, GROUP, 0, groups, tag, mask)  # codes and scales to decode
    bf16, f32, one = np.empty(n, np.uint16), np.empty(n, np.float32), np.float32(0.37)
    rows, column_scales, column_amax = n // COLUMNS, np.full(COLUMNS, one), np.zeros(COLUMNS, np.float32)
    bf16_mask, divisors = np.int64(SCALE_MASKS["bfloat16"]), kernels.pad_candidates(scale_candidates(E4M3FN, "mse"), E4M3FN.max)
    return {
        "encode, one scale": lambda: kernels.quantize_uniform(x, codes, 0, n, one, tag),
        "encode, blocks of 32": lambda: kernels.quantize_groups(x, codes, scales, GROUP, 0, groups, tag, mask),
        "encode, blocks of 32, the default's search": lambda: kernels.quantize_groups_search(
            x, codes, scales, GROUP, 0, groups, tag, bf16_mask, divisors
        ),
        "tensor amax": lambda: kernels.amax_span(x, 0, n),
        f"channel amax, {COLUMNS} columns": lambda: kernels.amax_columns(x, COLUMNS, 0, rows, column_amax),
        f"encode, a scale per column of {COLUMNS}": lambda: kernels.quantize_columns(
            x, codes, column_scales, COLUMNS, 0, rows, tag
        ),
        "decode to bf16, one scale": lambda: kernels.dequantize_uniform(codes, tag, one, bf16, 0, n),
        "decode to fp32, one scale": lambda: kernels.dequantize_uniform(codes, tag, one, f32, 0, n),
        "decode to bf16, blocks of 32": lambda: kernels.dequantize_groups(codes, tag, scales, GROUP, bf16, 0, groups),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=30, help="timed calls of each kernel (default 30)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for n in SIZES:
        for name, call in kernel_calls(n, rng).items():
            print(f"{n} elements, {name}: {best_ns_per_element(call, n, args.repeat):.3f} ns per element")


if __name__ == "__main__":
    main()
