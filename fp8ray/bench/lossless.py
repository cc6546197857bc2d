"""``fp8ray bench lossless``: what each lossless stage over the frames gives on a real KV
cache (archive size against the bf16 source) and costs (compress and decompress
throughput with the pool up), each beside ``none`` measured in the same run.

The source is a capture of the shipped model (``fp8ray capture``), made once into the
given path when it is missing.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile

from ..codec import CodecOptions
from ..engine.archives import compress_archive, decompress_archive
from ..engine.pool import QuantPool
from ..engine.runtime import connect_ray, disconnect_ray
from .codec import describe_machine

DEFAULT_STAGES = ("none", "lz4", "zstd:1", "zstd:3", "zstd:6")


def bench_lossless(
    source: str,
    stages=DEFAULT_STAGES,
    options: CodecOptions | None = None,
    workers: int = 2,
    repeat: int = 5,
    address: str | None = None,
) -> str:
    options = options or CodecOptions()
    raw = os.path.getsize(source)
    owns = connect_ray(address, max(workers, os.cpu_count() or 1), inline_possible=True) if address != "inline" else False
    tmp = tempfile.mkdtemp(prefix="fp8ray-lossless-")
    rows = {}
    try:
        with QuantPool(num_workers=workers, address=address) as pool:
            for _ in range(repeat):  # stages interleaved, so that drifts of the machine fall on all
                for stage in stages:
                    arch, out = os.path.join(tmp, "arch"), os.path.join(tmp, "out.safetensors")
                    os.sync()
                    c = compress_archive(source, arch, options=options, lossless=stage, pool=pool)
                    os.sync()
                    d = decompress_archive(arch, out, pool=pool)
                    rows.setdefault(stage, []).append((c.archive_bytes, c.seconds, d.seconds))
                    shutil.rmtree(arch)
                    os.unlink(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if owns:
            disconnect_ray()
    base_c = statistics.median(r[1] for r in rows["none"]) if "none" in rows else None
    base_d = statistics.median(r[2] for r in rows["none"]) if "none" in rows else None
    lines = [
        f"fp8ray bench lossless: {os.path.basename(source)} ({raw / 2**20:.2f} MiB bf16), codec {options.label()}, "
        f"{workers} workers, median of {repeat}",
        describe_machine(),
        "",
        "| lossless | archive / bf16 | compress GB/s | vs none | decompress GB/s | vs none |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for stage, runs in rows.items():
        size = runs[0][0]
        c, d = statistics.median(r[1] for r in runs), statistics.median(r[2] for r in runs)
        lines.append(
            f"| {stage} | {size / raw:.4f} | {raw / c / 1e9:.3f} | {base_c / c if base_c else float('nan'):.2f} "
            f"| {raw / d / 1e9:.3f} | {base_d / d if base_d else float('nan'):.2f} |"
        )
    return "\n".join(lines)
