"""The whole codec's encode and decode of the plain modes, best of ``--repeat`` calls:
``Fp8Codec.encode(x, out=frame)`` and ``fp8ray.decode(frame, out=...)`` of four sample
KV chunks (11.8M bf16 elements, as ``fp8ray bench codec``), GB/s of bytes read plus
written, beside the best of a preallocated copy of the input's bytes (torch's, as the
bench's baseline).

    PYTHONPATH=<tree> .venv/bin/python scripts/codec_best.py [--repeat 25]

``fp8ray bench codec`` prints medians, mode after mode, and its copy moves with the
machine's load between modes; the best of many calls is steadier for comparing two trees
(run this with PYTHONPATH on each, in turns). BENCHMARKS.md's 2026-12-05 "encode by way
of IEEE half" section quotes it.
"""

from __future__ import annotations

import argparse

import torch
from _timing import best_seconds  # scripts/, this script's directory

from fp8ray.codec import CodecOptions, Fp8Codec, decode
from fp8ray.eval.sample import sample_kv_chunk

SCALINGS = ("none", "tensor", "channel", "token", "block")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=25, help="timed calls of each (default 25)")
    args = parser.parse_args()
    x = torch.cat([sample_kv_chunk(tokens=256, seed=i, dtype=torch.bfloat16) for i in range(4)], dim=1)
    for scaling in SCALINGS:
        codec = Fp8Codec(options=CodecOptions(scaling=scaling, scale_choice="amax", scale_dtype="float32"))
        frame = torch.empty(codec.encoded_size(x.shape, x.dtype), dtype=torch.uint8).numpy()
        moved = x.numel() * x.element_size() + frame.size
        encode = best_seconds(lambda: codec.encode(x, out=frame), args.repeat)  # noqa: B023
        out = torch.empty_like(x)
        decoded = best_seconds(lambda: decode(frame, out=out), args.repeat)  # noqa: B023
        print(f"{scaling}: encode {moved / encode / 1e9:.2f} GB/s, decode {moved / decoded / 1e9:.2f} GB/s")
    src = torch.ones(x.numel() * x.element_size(), dtype=torch.uint8)  # as the bench's copy: torch's, on its threads
    dst = torch.empty_like(src)
    print(f"copy: {2 * src.numel() / best_seconds(lambda: dst.copy_(src), args.repeat) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
