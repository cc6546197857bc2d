"""The demo: compress a sample KV cache with every scaling mode and report size, error and speed.

Until the Ray engine lands this runs the codec alone, in this process: each chunk is
encoded to a frame file, read back from disk, checked and decoded.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .codec import Fp8Codec, decode
from .formats import SCALINGS
from .metrics import error_metrics
from .sample import sample_kv_chunk


def run_demo(out_dir: Path, chunks: int = 8, fp8: str = "e4m3fn") -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = [sample_kv_chunk(seed=i) for i in range(chunks)]
    raw_bytes = sum(c.numel() * c.element_size() for c in cache)
    lines = [
        f"sample KV cache: {chunks} chunks of {list(cache[0].shape)} bfloat16, {raw_bytes / 2**20:.1f} MiB",
        "",
        f"| scaling ({fp8}) | stored MiB | ratio | K rel err | V rel err | V SNR dB | encode GB/s | decode GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scaling in SCALINGS:
        codec = Fp8Codec(fp8, scaling, block_size=128)
        decode(codec.encode(cache[0][:, :1, :8]))  # compile the kernels (or load them from cache) untimed
        start = time.perf_counter()
        paths = []
        for i, chunk in enumerate(cache):
            path = out_dir / f"{scaling}-{i:04d}.fp8"
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(codec.encode(chunk))
            tmp.replace(path)  # atomic: a reader never sees half a frame
            paths.append(path)
        encode_s = time.perf_counter() - start
        stored = sum(p.stat().st_size for p in paths)
        start = time.perf_counter()
        decoded = [decode(p.read_bytes()) for p in paths]
        decode_s = time.perf_counter() - start
        keys = error_metrics(torch.stack([c[0] for c in cache]), torch.stack([d[0] for d in decoded]))
        values = error_metrics(torch.stack([c[1] for c in cache]), torch.stack([d[1] for d in decoded]))
        lines.append(
            f"| {scaling} | {stored / 2**20:.2f} | {raw_bytes / stored:.2f}x | {keys.rel_fro:.2%} | "
            f"{values.rel_fro:.2%} | {values.snr_db:.1f} | {(raw_bytes + stored) / encode_s / 1e9:.2f} | "
            f"{(raw_bytes + stored) / decode_s / 1e9:.2f} |"
        )
    lines += ["", f"frames written to {out_dir} (each one checked by its CRC-32C when read back)"]
    return "\n".join(lines)
