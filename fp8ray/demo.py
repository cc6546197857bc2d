"""The demo: the main job end to end on an embedded local Ray, with a short report.

Builds a sample KV cache (chunks of LMCache's layout ``[2, layers, 256, kv_heads *
head_dim]``) as a safetensors file, compresses it with two QuantWorkers, verifies the
archive against the source, decompresses it, and reports sizes, error and throughput.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .operations import compress_archive, decompress_archive, verify_archive
from .sample import sample_kv_chunk


def run_demo(out_dir: Path, chunks: int = 8, fp8: str = "e4m3fn", scaling: str = "token", workers: int = 2) -> str:
    from safetensors.torch import save_file

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    source = out_dir / "kv_cache.safetensors"
    save_file({f"chunk{i:04d}": sample_kv_chunk(seed=i) for i in range(chunks)}, str(source))
    archive, restored = out_dir / "kv_cache.fp8", out_dir / "restored.safetensors"

    import ray

    owns_ray = not ray.is_initialized()
    if owns_ray:  # one Ray for the three steps
        ray.init(address="local", num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    try:
        compressed = compress_archive(str(source), str(archive), fp8=fp8, scaling=scaling, workers=workers, part_bytes=16 << 20)
        verified = verify_archive(str(archive), against=str(source), workers=workers)
        decompressed = decompress_archive(str(archive), str(restored), workers=workers)
    finally:
        if owns_ray:
            ray.shutdown()
    if not verified.ok:
        raise RuntimeError("verification failed: " + "; ".join(verified.errors))
    rel = [m["rel_fro"] for m in verified.metrics.values()]
    snr = [m["snr_db"] for m in verified.metrics.values()]
    return "\n".join(
        [
            f"sample KV cache: {chunks} chunks of [2, 30, 256, 192] bfloat16 -> {source}",
            f"compress ({fp8}, {scaling} scaling, {workers} QuantWorkers on {', '.join(compressed.devices)}): "
            f"{compressed.raw_bytes / 2**20:.1f} MiB -> {compressed.archive_bytes / 2**20:.1f} MiB "
            f"({compressed.ratio:.2f}x) in {compressed.parts} Parquet parts, {compressed.input_gbps:.2f} GB/s of input",
            f"verify against the source: {verified.blocks} blocks ok; relative Frobenius error "
            f"{min(rel):.2%} to {max(rel):.2%}, SNR {min(snr):.1f} to {max(snr):.1f} dB",
            f"decompress: {decompressed.blocks} blocks -> {restored} in {decompressed.seconds:.1f} s",
            f"archive: {archive} (Parquet parts + _manifest.json; `fp8ray inspect {archive}`)",
        ]
    )
