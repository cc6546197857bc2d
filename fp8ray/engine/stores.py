"""LMCache filesystem stores converted on the Ray engine (names and scanning are in
:mod:`fp8ray.io.lmcache_store`).

``compress_store`` turns a bf16/fp16/fp32 store into exactly the files the fp8 serde would have written (same names, bytes of
:class:`fp8ray.lmcache.Fp8QuantizationSerializer`); ``decompress_store`` does the
reverse with :class:`fp8ray.lmcache.Fp8QuantizationDeserializer`. Both run on
``QuantWorker`` actors, a shard of files per call; docs/LMCACHE.md has the contract.

Nothing is written at the destination until every file is converted: workers write into
a temporary directory beside it, which is renamed into place at the end, and removed if
anything failed.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass

from ..codec.formats import get_format
from ..errors import ArchiveExistsError, DestinationError, SourceError
from ..io.lmcache_store import Layout, parse_layout, scan_store
from ..io.paths import check_apart, temporary_name
from .pool import QuantPool

SHARD_BYTES = 64 << 20  # input bytes per worker call


@dataclass
class StoreReport:
    mode: str  # "compress" | "decompress"
    source: str
    destination: str
    layout: str
    fp8: str
    files: int
    skipped: list[dict]
    bytes_before: int
    bytes_after: int
    seconds: float
    workers: int

    @property
    def input_gbps(self) -> float:
        return self.bytes_before / self.seconds / 1e9 if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "input_gbps": self.input_gbps}


def _check_paths(source: str, destination: str, overwrite: bool) -> tuple[str, str]:
    src, dst = os.path.realpath(source), os.path.realpath(destination)
    if not os.path.isdir(src):
        raise SourceError(f"source {source} is not a directory")
    check_apart(source, destination)
    if os.path.lexists(dst):
        if not overwrite:
            raise ArchiveExistsError(f"destination {destination} exists (pass --overwrite to replace it)")
        if not os.path.isdir(dst) or os.path.islink(destination):
            raise DestinationError(f"destination {destination} exists and is not a directory; not replacing it")
    return src, dst


def _remove_tree(path: str) -> None:
    """Remove a scratch directory; a killed worker may still be finishing a write into it."""
    for _ in range(20):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.1)
    shutil.rmtree(path)  # raises, naming what is left


def _plan_shards(files: list[str], file_bytes: int, workers: int) -> list[list[str]]:
    """Shards of up to SHARD_BYTES of input, and at least two per worker when there are enough files."""
    per_shard = max(1, min(SHARD_BYTES // max(1, file_bytes), -(-len(files) // (2 * workers))))
    return [files[i : i + per_shard] for i in range(0, len(files), per_shard)]


def convert_store(
    mode: str,
    source: str,
    destination: str,
    layout: Layout | str,
    *,
    fp8: str = "e4m3fn",
    workers: int = 2,
    gpus_per_worker: float = 0,
    address: str | None = None,
    overwrite: bool = False,
    progress=None,
    on_scan=None,
) -> StoreReport:
    """Convert every chunk file of an LMCache FS store: ``mode="compress"`` from the
    layout's dtype to fp8, ``"decompress"`` back. Files of another size or name are
    skipped and reported; a file that fails (non-finite values in compress) aborts the
    whole run with an error naming it, leaving no destination.

    ``progress(n)`` is called with the files just converted; ``on_scan(n)`` with the
    number of files to convert, before the work starts.
    """
    if mode not in ("compress", "decompress"):
        raise ValueError(f"mode must be 'compress' or 'decompress', got {mode!r}")
    fmt = get_format(fp8)
    layout = parse_layout(layout) if isinstance(layout, str) else layout
    src, dst = _check_paths(source, destination, overwrite)
    raw, fp8_bytes = layout.raw_bytes, layout.numel
    if mode == "compress":
        scan = scan_store(src, raw, {fp8_bytes: "the layout's size in fp8: already compressed?"})
    else:
        scan = scan_store(src, fp8_bytes, {raw: f"the layout's size in {layout.dtype}: not compressed?"})
    if on_scan is not None:
        on_scan(len(scan.files))

    scratch = temporary_name(dst)
    os.makedirs(scratch)
    before = after = 0
    seconds = 0.0
    try:
        if scan.files:
            shards = _plan_shards(scan.files, raw if mode == "compress" else fp8_bytes, workers)
            with QuantPool(num_workers=workers, gpus_per_worker=gpus_per_worker, address=address) as pool:
                start = time.perf_counter()  # the conversion itself, once the workers are up
                items = ((mode, src, scratch, shard, layout, fmt.name) for shard in shards)
                for done in pool.map("convert_store_files", items):
                    before += sum(f.bytes_in for f in done)
                    after += sum(f.bytes_out for f in done)
                    if progress is not None:
                        progress(len(done))
                seconds = time.perf_counter() - start
        if os.path.lexists(dst):  # --overwrite: swap the old one out only now
            trash = f"{scratch}.old"
            os.rename(dst, trash)
            try:
                os.rename(scratch, dst)
            except BaseException:
                os.rename(trash, dst)  # put the old store back
                raise
            shutil.rmtree(trash, ignore_errors=True)  # the new store is in place either way
        else:
            os.rename(scratch, dst)
    except BaseException:
        _remove_tree(scratch)
        raise
    return StoreReport(
        mode=mode,
        source=source,
        destination=destination,
        layout=str(layout),
        fp8=fmt.name,
        files=len(scan.files),
        skipped=scan.skipped,
        bytes_before=before,
        bytes_after=after,
        seconds=seconds,
        workers=workers,
    )


def compress_store(source: str, destination: str, layout: Layout | str, **options) -> StoreReport:
    """LMCache chunk files in the layout's dtype -> the files LMCache's fp8 serde writes."""
    return convert_store("compress", source, destination, layout, **options)


def decompress_store(source: str, destination: str, layout: Layout | str, **options) -> StoreReport:
    """LMCache fp8-serde chunk files -> raw chunk files in the layout's dtype."""
    return convert_store("decompress", source, destination, layout, **options)
