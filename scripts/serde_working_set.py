"""How the serializers' time per chunk depends on how many distinct chunks a run stores:
LMCache's own ``fp8`` serializer (a torch cast to float8_e4m3fn and a copy into the
buffer) against fp8ray's in the default mode, each called as LMCache calls it
(``serialize(src, dst, key)``, on this thread), on 1 to 32 chunks of the shape
``fp8ray bench lmcache`` uses, each chunk in memory of its own. Few chunks stay in the
CPU's cache from run to run; many do not, as LMCache's do not when it stores them. This
is what chose ``fp8ray bench lmcache --copies``'s default (BENCHMARKS.md, "LMCache serde").

    PYTHONPATH=<tree> .venv/bin/python scripts/serde_working_set.py [--runs 8] [--layers 30 --kv-heads 3 --head-dim 64]

The default chunk is the shipped model's (SmolLM2-135M, 5.9 MB for 256 tokens); an 8B
model's (Llama 3 8B: 32 layers, 8 KV heads of 128) is ``--layers 32 --kv-heads 8
--head-dim 128`` (33.5 MB).
"""

from __future__ import annotations

import argparse
import statistics
import time

from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.distributed.serde.fp8 import Fp8QuantizationSerializer

from fp8ray.bench.lmcache import byte_obj, keys_for, kv_obj
from fp8ray.eval.sample import sample_kv_chunk
from fp8ray.lmcache import Fp8FrameSerializer

COUNTS = (1, 2, 4, 8, 16, 32)


def ms_per_chunk(serializer, srcs: list, dsts: list, keys: list, count: int, runs: int) -> float:
    """The median over ``runs`` (after two warm-ups) of one run's time per chunk, a run
    serializing the first ``count`` chunks in turn."""
    times = []
    for _ in range(runs + 2):
        start = time.perf_counter()
        for src, dst, key in zip(srcs[:count], dsts[:count], keys[:count]):
            serializer.serialize(src, dst, key)
        times.append((time.perf_counter() - start) / count)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8, help="timed runs per figure (default 8)")
    parser.add_argument("--layers", type=int, default=30, help="layers of a chunk (default 30)")
    parser.add_argument("--kv-heads", type=int, default=3, help="KV heads of a chunk (default 3)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension of a chunk (default 64)")
    parser.add_argument("--most", type=int, default=max(COUNTS), help=f"the most chunks a run stores (default {max(COUNTS)})")
    args = parser.parse_args()
    shape = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
    counts = [c for c in COUNTS if c <= args.most]
    chunks = [sample_kv_chunk(seed=i, **shape) for i in range(max(counts))]
    srcs = [kv_obj(c) for c in chunks]
    keys = keys_for(len(chunks))
    serdes = [("LMCache fp8", Fp8QuantizationSerializer()), ("fp8ray default", Fp8FrameSerializer())]
    layout = MemoryLayoutDesc(shapes=[chunks[0].shape], dtypes=[chunks[0].dtype])
    buffers = {name: [byte_obj(s.estimate_serialized_size(layout)) for _ in chunks] for name, s in serdes}
    size = chunks[0].numel() * chunks[0].element_size()
    print(f"chunks {list(chunks[0].shape)} bfloat16, {size / 1e6:.1f} MB each; ms per chunk, median of {args.runs} runs")
    print("| chunks a run | MB of bf16 | " + " | ".join(name for name, _ in serdes) + " | fp8ray / LMCache speed |")
    print("|---:|---:|" + "---:|" * (len(serdes) + 1))
    for count in counts:
        ms = [ms_per_chunk(s, srcs, buffers[name], keys, count, args.runs) for name, s in serdes]
        print(f"| {count} | {count * size / 1e6:.1f} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {ms[0] / ms[1]:.2f}x |")


if __name__ == "__main__":
    main()
