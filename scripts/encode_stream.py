"""One part's encode as a compress worker does it, on data streamed from memory: 64
blocks of 8 MiB bf16 (512 MiB) end to end in one buffer, ``encode_data_into`` on 2
threads, best of 7. Small benchmarks that fit the caches can rank kernel changes
differently; this is the archive's path.

    .venv/bin/python scripts/encode_stream.py [tensor|block|...] [--blocks 64]

The mode: ``tensor`` (default: bfloat16 scales, as ``fp8ray bench startup``'s compress),
or any other scaling with float32 scales by amax. The figures of BENCHMARKS.md's "After
the merge" paragraph (issue 17 goal 3) come from it, run on each tree in turn.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fp8ray from this checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fp8ray.codec import CodecOptions, Fp8Codec  # noqa: E402
from fp8ray.codec.blocks import BlockSpec, encode_data_into, frame_sizes  # noqa: E402

SHAPE = (2, 4, 1024, 512)  # 8 MiB of bfloat16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scaling", nargs="?", default="tensor")
    parser.add_argument("--blocks", type=int, default=64)
    args = parser.parse_args()
    tensor = args.scaling == "tensor"
    options = (
        CodecOptions(scaling="tensor")
        if tensor
        else CodecOptions(scaling=args.scaling, scale_choice="amax", scale_dtype="float32")
    )
    codec = Fp8Codec(options=options)
    joined = torch.randn(args.blocks, *SHAPE).bfloat16().view(torch.uint8).numpy().reshape(-1)
    per = joined.size // args.blocks
    data = [joined[i * per : (i + 1) * per] for i in range(args.blocks)]
    specs = [BlockSpec(f"k{i}", "bfloat16", SHAPE) for i in range(args.blocks)]
    sizes = frame_sizes(codec, specs)
    out = np.empty(sum(sizes), np.uint8)
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        encode_data_into(codec, specs, data, out, sizes, threads=2, joined=joined)
        best = min(best, time.perf_counter() - start)
    gbps = joined.size / best / 1e9
    print(f"{options.label()}: {args.blocks} blocks of 8 MiB in {best * 1e3:.1f} ms ({gbps:.2f} GB/s of input), best of 7")
    return 0


if __name__ == "__main__":
    sys.exit(main())
