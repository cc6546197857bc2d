"""Small blocks against large ones in one process (issue 18 item 4): the same bytes as
``--small`` blocks of 16 KiB and as ``--large`` blocks of 8 MiB, in 8 safetensors files,
compressed and decompressed by one inline worker (``--scaling tensor --scale-dtype
float32 --lossless none``: the codec moves 16 KiB in a few microseconds, so what is left
is the per-block overhead). Best of ``--repeat`` runs, the two interleaved; prints the
work (the reports' seconds) and wall of each, and the extra time per extra block.

    PYTHONPATH=<tree> .venv/bin/python scripts/small_blocks.py [--mib 64] [--repeat 5]

Run it with PYTHONPATH on two trees, one after the other, to compare them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from fp8ray.engine.archives import compress_archive, decompress_archive  # noqa: E402
from fp8ray.engine.pool import PoolSettings  # noqa: E402

MODE = {"scaling": "tensor", "scale_dtype": "float32"}
FILES = 8


def write_source(directory: Path, mib: int, block_kib: int) -> int:
    """``mib`` MiB of float16 blocks of ``block_kib`` KiB in :data:`FILES` files; returns
    the number of blocks."""
    rng = np.random.default_rng(0)
    per_file = mib * 1024 // block_kib // FILES
    elements = block_kib * 1024 // 2
    for f in range(FILES):
        blocks = {f"b{i:06d}": rng.standard_normal(elements, dtype=np.float32).astype(np.float16) for i in range(per_file)}
        save_file(blocks, str(directory / f"f{f}.safetensors"))
    return per_file * FILES


def round_trip(source: Path, scratch: Path) -> tuple[float, float, float, float]:
    """(compress work, compress wall, decompress work, decompress wall), in seconds."""
    pool = PoolSettings(num_workers=1, address="inline")
    archive, out = scratch / "arch", scratch / "out"
    scratch.mkdir(exist_ok=True)
    shutil.rmtree(archive, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    compressed = compress_archive(str(source), str(archive), lossless="none", pool=pool, **MODE)
    middle = time.perf_counter()
    decompressed = decompress_archive(str(archive), str(out), pool=pool)
    end = time.perf_counter()
    return compressed.seconds, middle - start, decompressed.seconds, end - middle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--small", type=int, default=16, help="KiB per small block")
    parser.add_argument("--large", type=int, default=8192, help="KiB per large block")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fp8ray-small-blocks-") as tmp:
        root = Path(tmp)
        counts, best = {}, {}
        for kind, kib in (("small", args.small), ("large", args.large)):
            (root / kind).mkdir()
            counts[kind] = write_source(root / kind, args.mib, kib)
            round_trip(root / kind, root / f"{kind}-out")  # warm: kernels, page cache
        for _ in range(args.repeat):
            for kind in counts:
                times = round_trip(root / kind, root / f"{kind}-out")
                best[kind] = tuple(map(min, zip(best.get(kind, times), times)))
    extra = counts["small"] - counts["large"]
    print(
        f"{args.mib} MiB: {counts['small']} blocks of {args.small} KiB against {counts['large']} of {args.large} KiB, "
        f"best of {args.repeat}"
    )
    for i, what in enumerate(("compress work", "compress wall", "decompress work", "decompress wall")):
        small, large = best["small"][i], best["large"][i]
        per_block = (small - large) / extra * 1e6
        ratio = small / large
        print(f"  {what}: {small * 1e3:.1f} ms against {large * 1e3:.1f} ms, {ratio:.2f}x, {per_block:.1f} us per extra block")


if __name__ == "__main__":
    main()
