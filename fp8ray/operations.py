"""Archive operations on the Ray engine: compress, decompress, verify, inspect.

Each returns a report object; the CLI and the Ray jobs are thin wrappers around these.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import pyarrow.fs as pafs
import ray

from . import __version__, archive
from .codec import Fp8Codec
from .formats import resolve_options
from .errors import Fp8rayError
from .pool import QuantPool
from .sources import BlockRef, SafetensorsWriter, SourceError, list_blocks, redact, resolve

DEFAULT_PART_BYTES = 64 << 20
PLAN_NAME = "_plan.json"

Progress = Callable[[int], None]  # called with the number of blocks just finished


class ArchiveExistsError(Fp8rayError, FileExistsError):
    """The destination already exists."""


@dataclass
class CompressReport:
    source: str
    archive: str
    blocks: int
    parts: int
    parts_reused: int
    raw_bytes: int
    frame_bytes: int
    archive_bytes: int
    seconds: float
    workers: int
    workers_replaced: int
    devices: list[str]
    nodes: int  # distinct Ray nodes that wrote parts in this run

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.archive_bytes if self.archive_bytes else 0.0

    @property
    def input_gbps(self) -> float:
        return self.raw_bytes / self.seconds / 1e9 if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "input_gbps": self.input_gbps}


@dataclass
class DecompressReport:
    archive: str
    output: str
    blocks: int
    raw_bytes: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class VerifyReport:
    archive: str
    blocks: int
    parts: int
    errors: list[str] = field(default_factory=list)
    metrics: dict[str, dict] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def plan_parts(refs: list[BlockRef], part_bytes: int) -> list[list[BlockRef]]:
    """Consecutive blocks grouped into parts of about ``part_bytes`` of input (at least one
    block each). Depends only on the source, so any number of workers writes the same parts."""
    parts: list[list[BlockRef]] = []
    size = 0
    for ref in refs:
        if not parts or size >= part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(ref)
        size += ref.nbytes
    return parts


def _prepare_destination(fs: pafs.FileSystem, path: str, uri: str, resume: bool, overwrite: bool) -> None:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        raise ArchiveExistsError(f"destination {uri} exists and is a file")
    if info.type == pafs.FileType.Directory:
        has_manifest = fs.get_file_info(f"{path}/{archive.MANIFEST_NAME}").type == pafs.FileType.File
        entries = fs.get_file_info(pafs.FileSelector(path))
        if overwrite:
            fs.delete_dir_contents(path)
        elif has_manifest:
            raise ArchiveExistsError(f"destination {uri} already holds an archive (pass --overwrite to replace it)")
        elif entries and not resume:
            raise ArchiveExistsError(f"destination {uri} exists and is not empty (pass --resume to continue, --overwrite to replace)")
    fs.create_dir(path, recursive=True)


def _plan_record(source: str, options: dict, parts: list[list[BlockRef]]) -> dict:
    return {
        "source": redact(source),
        "codec": options,
        "parts": [[r.key for r in part] for part in parts],
    }


def compress_archive(
    source: str,
    destination: str,
    *,
    fp8: str | None = None,
    scaling: str | None = None,
    block_size: int | None = None,
    scale_dtype: str | None = None,
    scale_choice: str | None = None,
    workers: int = 2,
    gpus_per_worker: float = 0,
    address: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    part_bytes: int = DEFAULT_PART_BYTES,
    progress: Progress | None = None,
) -> CompressReport:
    """Compress a safetensors file, a directory of them or a raw-block Parquet archive
    into an fp8ray archive directory on the Ray engine.

    Each worker reads its part's blocks from the source and writes the part itself; the
    driver moves only metadata and writes the manifest last. With ``resume``, parts a
    previous run finished (same source, options and plan) are kept as they are.

    Codec options left ``None`` follow :data:`fp8ray.formats.KV_DEFAULTS` (see
    :func:`fp8ray.formats.resolve_options`); all five are recorded in the manifest.
    """
    options = resolve_options(fp8, scaling, block_size, scale_dtype, scale_choice)
    Fp8Codec(**options)  # validate before any work
    refs = list_blocks(source)
    parts = plan_parts(refs, part_bytes)
    fs, path = resolve(destination)
    _prepare_destination(fs, path, destination, resume, overwrite)
    plan = _plan_record(source, options, parts)
    plan_path = f"{path}/{PLAN_NAME}"
    reused: dict[int, archive.PartInfo] = {}
    if resume and fs.get_file_info(plan_path).type == pafs.FileType.File:
        with fs.open_input_stream(plan_path) as f:
            previous = json.loads(f.read())
        if previous != plan:
            raise ArchiveExistsError(
                f"cannot resume {redact(destination)}: it was started from another source, options or plan "
                f"({previous.get('source')}, {previous.get('codec')})"
            )
        for i in range(len(parts)):
            info = archive.read_sidecar(fs, path, i)
            if info is not None:
                reused[i] = info
    else:
        archive.write_atomic(fs, plan_path, json.dumps(plan, sort_keys=True).encode())

    infos: dict[int, dict] = {i: {**asdict(info), "device": None, "node_id": None} for i, info in reused.items()}
    if progress:
        progress(sum(info.blocks for info in reused.values()))
    todo = [i for i in range(len(parts)) if i not in reused]
    with QuantPool(num_workers=workers, gpus_per_worker=gpus_per_worker, address=address) as pool:
        start = time.perf_counter()
        tasks = ((parts[i], options, destination, i) for i in todo)
        for i, info in zip(todo, pool.map("compress_part", tasks)):
            infos[i] = info
            if progress:
                progress(info["blocks"])
        replaced = pool.replaced
    seconds = time.perf_counter() - start

    part_entries = [{k: v for k, v in infos[i].items() if k not in ("device", "node_id")} for i in range(len(parts))]
    manifest = {
        "format": archive.ARCHIVE_FORMAT,
        "version": archive.ARCHIVE_VERSION,
        "fp8ray_version": __version__,
        "codec": options,
        "source": redact(source),  # never the credentials a URI may carry
        "blocks": len(refs),
        "raw_bytes": sum(p["raw_bytes"] for p in part_entries),
        "frame_bytes": sum(p["frame_bytes"] for p in part_entries),
        "archive_bytes": sum(p["file_bytes"] for p in part_entries),
        "parts": part_entries,
    }
    archive.write_manifest(fs, path, manifest)
    _clean_scratch(fs, path)
    return CompressReport(
        source=redact(source),
        archive=redact(destination),
        blocks=len(refs),
        parts=len(parts),
        parts_reused=len(reused),
        raw_bytes=manifest["raw_bytes"],
        frame_bytes=manifest["frame_bytes"],
        archive_bytes=manifest["archive_bytes"],
        seconds=seconds,
        workers=workers,
        workers_replaced=replaced,
        devices=sorted({str(i["device"]) for i in infos.values() if i["device"]}),
        nodes=len({i["node_id"] for i in infos.values() if i["node_id"]}),
    )


def _clean_scratch(fs: pafs.FileSystem, path: str) -> None:
    """After the manifest: drop the plan, the sidecars and temporaries of killed writers."""
    for entry in fs.get_file_info(pafs.FileSelector(path)):
        name = entry.base_name
        if name == PLAN_NAME or (name.startswith("_part-") and name.endswith(".json")) or ".tmp-" in name:
            fs.delete_file(entry.path)


def _archive_entries(fs: pafs.FileSystem, path: str, manifest: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    entries = []
    for part in manifest["parts"]:
        # Only the small metadata columns; the worker decoding the part checks its CRC-32C.
        table = archive.pq.read_table(f"{path}/{part['name']}", filesystem=fs, columns=["key", "dtype", "shape"])
        entries += [(k, d, tuple(s)) for k, d, s in zip(*(table.column(c).to_pylist() for c in ("key", "dtype", "shape")))]
    return entries


def decompress_archive(
    archive_uri: str,
    output: str,
    *,
    workers: int = 2,
    gpus_per_worker: float = 0,
    address: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> DecompressReport:
    """Decode an archive into one ``.safetensors`` file with the original keys, dtypes
    and shapes. Every part and frame is checked first; a damaged one aborts the whole
    output (nothing is left at ``output``)."""
    fs, path = resolve(archive_uri)
    manifest = archive.read_manifest(fs, path)
    out_fs, out_path = resolve(output)
    if out_fs.get_file_info(out_path).type != pafs.FileType.NotFound and not overwrite:
        raise ArchiveExistsError(f"output {output} exists (pass --overwrite to replace it)")
    start = time.perf_counter()
    entries = _archive_entries(fs, path, manifest)
    writer = SafetensorsWriter(output, entries, metadata={"fp8ray_archive": json.dumps(manifest["codec"])})
    try:
        with QuantPool(num_workers=workers, gpus_per_worker=gpus_per_worker, address=address) as pool:
            tasks = ((archive_uri, part) for part in manifest["parts"])
            for blocks in pool.map("decompress_part", tasks):
                for _key, raw in blocks:
                    writer.write(raw)
                if progress:
                    progress(len(blocks))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return DecompressReport(archive_uri, output, len(entries), manifest["raw_bytes"], time.perf_counter() - start)


def verify_archive(
    archive_uri: str,
    *,
    against: str | None = None,
    workers: int = 2,
    address: str | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check every part's CRC-32C and every frame; with ``against``, error metrics per
    key against the original source. Damage is reported, naming the block (or the part
    where it lies outside every block), not raised."""
    fs, path = resolve(archive_uri)
    manifest = archive.read_manifest(fs, path)
    refs = {r.key: r for r in list_blocks(against)} if against else None
    report = VerifyReport(redact(archive_uri), 0, len(manifest["parts"]))
    seen: set[str] = set()
    with QuantPool(num_workers=workers, address=address) as pool:
        # The source's block map goes to the object store once, not with every part.
        shared_refs = ray.put(refs)
        tasks = ((archive_uri, part, shared_refs) for part in manifest["parts"])
        for part_report in pool.map("verify_part", tasks):
            report.blocks += part_report["blocks"]
            report.errors += part_report["errors"]
            report.metrics.update(part_report["metrics"])
            seen.update(part_report["keys"])
            if progress:
                progress(part_report["blocks"])
    if report.blocks != manifest["blocks"] and not report.errors:
        report.errors.append(f"the manifest records {manifest['blocks']} blocks, the parts hold {report.blocks}")
    if refs is not None:
        missing = sorted(set(refs) - seen)
        if missing:
            report.errors.append(f"{len(missing)} source key(s) are not in the archive, e.g. {missing[0]!r}")
    return report


def inspect_archive(archive_uri: str) -> dict:
    """The manifest, with the compression ratio; no part is read."""
    fs, path = resolve(archive_uri)
    manifest = archive.read_manifest(fs, path)
    return {**manifest, "ratio": manifest["raw_bytes"] / manifest["archive_bytes"] if manifest["archive_bytes"] else 0.0}


__all__ = [
    "ArchiveExistsError",
    "CompressReport",
    "DecompressReport",
    "SourceError",
    "VerifyReport",
    "compress_archive",
    "decompress_archive",
    "inspect_archive",
    "verify_archive",
]
