"""One block out of a large archive: what ``fp8ray.open_archive(...).get(key)`` reads
from storage and how long it takes, cold (a reader just opened: manifest, the part's
footer and file/key columns, the block's row group) and warm (the same reader, another
block of a part it has looked into: the row group only). Bytes are counted through a
``pyarrow.fs`` wrapper around the local filesystem; times are wall-clock, with the page
cache warm (the archive was just written), so storage latency is not in them.

    .venv/bin/python scripts/block_read.py [--gib 1] [--block-mib 1] [--dir DIR]

It writes a source of random bf16 blocks and its archive (the default mode, default
lossless stage and part size) under DIR (default: a temporary directory, removed at
the end; a DIR given is kept and its archive reused by the next run). The figures in
BENCHMARKS.md ("One block out of an archive") come from this script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pyarrow.fs as pafs  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import fp8ray  # noqa: E402
from fp8ray.bench.readcount import CountingHandler  # noqa: E402
from fp8ray.engine.pool import PoolSettings  # noqa: E402


def make_archive(base: Path, gib: float, block_mib: float) -> tuple[Path, list[str]]:
    """A source of ``gib`` GiB of bf16 blocks of ``block_mib`` MiB in 4 files, and its archive."""
    archive = base / "kv.fp8"
    elements = int(block_mib * 2**20) // 2
    blocks = int(gib * 1024 / block_mib)
    files = [f"req{i}.safetensors" for i in range(4)]
    if not (archive / "_manifest.json").exists():
        g = torch.Generator().manual_seed(0)
        (base / "src").mkdir(parents=True, exist_ok=True)
        for i, name in enumerate(files):
            count = blocks // 4 + (i < blocks % 4)
            save_file(
                {f"block{j:05d}": torch.randn(elements, generator=g).to(torch.bfloat16) for j in range(count)},
                str(base / "src" / name),
            )
        start = time.perf_counter()
        fp8ray.compress_archive(str(base / "src"), str(archive), pool=PoolSettings(num_workers=2, address="inline"))
        print(f"compressed {gib} GiB in {time.perf_counter() - start:.1f} s")
        shutil.rmtree(base / "src")
    return archive, files


def reads(archive: Path, files: list[str], args, r: int, counting: CountingHandler | None) -> list[tuple[float, int]]:
    """``[(bytes read, seconds)]`` of: opening the archive, a cold get, a warm get, a cold get
    of a file's last block (run ``r`` of the sequence)."""
    fs = pafs.PyFileSystem(counting) if counting is not None else None
    file = files[r % len(files)]
    out = []

    def step(action):
        before, start = counting.read[0] if counting else 0, time.perf_counter()
        result = action()
        out.append((counting.read[0] - before if counting else 0, time.perf_counter() - start))
        return result

    reader = step(lambda: fp8ray.open_archive(str(archive), filesystem=fs))
    step(lambda: reader.get(f"block{3 * r:05d}", file))
    step(lambda: reader.get(f"block{3 * r + 1:05d}", file))  # the same part, another row group
    fresh = fp8ray.open_archive(str(archive), filesystem=fs)
    step(lambda: fresh.get(reader_last_key(args), file))
    return out


def reader_last_key(args) -> str:
    """The key of the last block of the first files (make_archive's names)."""
    return f"block{int(args.gib * 1024 / args.block_mib) // 4 - 1:05d}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="source size in GiB (default 1)")
    parser.add_argument("--block-mib", type=float, default=1.0, help="block size in MiB of bf16 (default 1)")
    parser.add_argument("--dir", type=Path, help="where to keep the archive (default: a temporary directory)")
    parser.add_argument("--repeat", type=int, default=9, help="cold and warm reads to time, each (default 9)")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="fp8ray-block-read-"))
    try:
        archive, files = make_archive(base, args.gib, args.block_mib)
        size = sum(p.stat().st_size for p in archive.iterdir())
        # Bytes are counted through the wrapper; times are taken without it (its reads
        # are Python calls), in the same sequence of reads.
        counted = [reads(archive, files, args, r, CountingHandler()) for r in range(args.repeat)]
        timed = [reads(archive, files, args, r, None) for r in range(args.repeat)]
        mib = 2**20

        def median(rows, step, what, scale):  # what: 0 bytes, 1 seconds
            return statistics.median(row[step][what] for row in rows) / scale

        parts = len(fp8ray.open_archive(str(archive)).manifest.parts)
        print(
            f"archive: {size / mib:.0f} MiB ({args.gib} GiB of bf16 in {args.block_mib} MiB blocks), {parts} parts; "
            f"medians of {args.repeat}"
        )
        names = [
            "open_archive (the manifest)",
            "cold get (a new reader; the block's part's first)",
            "warm get (the same reader, another block of that part)",
            f"cold get (a new reader; a file's last block, after the keys of its {parts // len(files)} parts)",
        ]
        for i, name in enumerate(names):
            print(f"{name}: {median(counted, i, 0, mib):.2f} MiB read, {median(timed, i, 1, 1e-3):.1f} ms")
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
