"""What the parts' footer, metadata-column and frames' CRCs (fp8ray.io.part_checks) cost:
on compress, the three CRCs of a part of 4000 small blocks against writing the part (the
frames' CRC is taken again by decompress and verify as they read the part); on
``get``, a reader's first block of a part and a later one, with the CRCs recorded and
with them removed from the manifest (as an archive written before them reads).

    PYTHONPATH=<tree> RAY_AUTH_MODE=disabled .venv/bin/python scripts/part_checks_cost.py
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pyarrow.fs as pafs  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import fp8ray  # noqa: E402
from fp8ray.engine.archives import compress_archive  # noqa: E402
from fp8ray.engine.pool import PoolSettings  # noqa: E402
from fp8ray.io import archive, part_checks  # noqa: E402

BLOCKS = 4000


def mean_ms(fn, runs: int) -> float:
    start = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - start) / runs * 1e3


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fp8ray-part-checks-") as d:
        save_file({f"layer{i}.kv": torch.randn(8, 64).to(torch.bfloat16) for i in range(BLOCKS)}, f"{d}/src.safetensors")
        compress_archive(f"{d}/src.safetensors", f"{d}/new", lossless="none", pool=PoolSettings(num_workers=1, address="inline"))
        part = f"{d}/new/part-00000.parquet"
        table = pq.read_table(part)
        data = Path(part).read_bytes()
        columns = mean_ms(lambda: part_checks.columns_crc32c(table.select(archive.METADATA_COLUMNS).to_pydict()), 10)
        footer = mean_ms(lambda: part_checks.footer_crc32c(data), 100)
        frames = mean_ms(lambda: part_checks.frames_crc32c(table.column("frame")), 100)
        rows = {c: table.column(c).to_pylist() for c in table.column_names}
        written = mean_ms(lambda: archive.write_part(pafs.LocalFileSystem(), f"{d}/new", 9, rows), 3)
        print(
            f"compress, a part of {table.num_rows} blocks: columns CRC {columns:.2f} ms, footer CRC {footer:.3f} ms, "
            f"frames' CRC {frames:.3f} ms, write_part (all three included) {written:.1f} ms"
        )
        shutil.copytree(f"{d}/new", f"{d}/old")
        manifest_path = Path(d) / "old" / "_manifest.json"
        manifest = json.loads(manifest_path.read_text())
        for entry in manifest["parts"]:
            del entry["footer_crc32c"], entry["columns_crc32c"]
        manifest_path.write_text(json.dumps(manifest))
        for name in ("old", "new", "old", "new"):  # taking turns
            firsts, later = [], []
            for _ in range(20):
                reader = fp8ray.open_archive(f"{d}/{name}")
                start = time.perf_counter()
                reader.block("layer100.kv")
                firsts.append(time.perf_counter() - start)
                start = time.perf_counter()
                reader.block(f"layer{BLOCKS // 2}.kv")
                later.append(time.perf_counter() - start)
            label = "without the CRCs" if name == "old" else "with the CRCs"
            print(
                f"get, {label}: first block of a part {statistics.median(firsts) * 1e3:.2f} ms, "
                f"a later one {statistics.median(later) * 1e3:.3f} ms (medians of 20)"
            )


if __name__ == "__main__":
    main()
