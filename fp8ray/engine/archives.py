"""Archive operations on the Ray engine: compress, decompress, verify, inspect.

Each returns a report object; the CLI and the Ray jobs are thin wrappers around these.
The archive format itself is :mod:`fp8ray.io.archive`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import pyarrow.fs as pafs
import ray

from .. import __version__
from ..codec import CodecOptions
from ..errors import ArchiveExistsError
from ..io import archive
from ..io.archive import DEFAULT_PART_BYTES
from ..io.blocks import list_blocks
from ..io.paths import check_apart, redact, resolve
from ..io.safetensors import SafetensorsWriter
from .pool import QuantPool

Progress = Callable[[int], None]  # called with the number of blocks just finished


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


def _prepare_destination(fs: pafs.FileSystem, path: str, uri: str, resume: bool, overwrite: bool) -> None:
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        raise ArchiveExistsError(f"destination {redact(uri)} exists and is a file")
    if info.type == pafs.FileType.Directory:
        has_manifest = fs.get_file_info(f"{path}/{archive.MANIFEST_NAME}").type == pafs.FileType.File
        entries = fs.get_file_info(pafs.FileSelector(path))
        if overwrite:
            fs.delete_dir_contents(path)
        elif has_manifest:
            raise ArchiveExistsError(f"destination {redact(uri)} already holds an archive (pass --overwrite to replace it)")
        elif entries and not resume:
            raise ArchiveExistsError(
                f"destination {redact(uri)} exists and is not empty (pass --resume to continue, --overwrite to replace)"
            )
    fs.create_dir(path, recursive=True)


def compress_archive(
    source: str,
    destination: str,
    *,
    options: CodecOptions | None = None,
    workers: int = 2,
    gpus_per_worker: float = 0,
    address: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    part_bytes: int = DEFAULT_PART_BYTES,
    progress: Progress | None = None,
    **codec_options,
) -> CompressReport:
    """Compress a safetensors file, a directory of them or a raw-block Parquet archive
    into an fp8ray archive directory on the Ray engine.

    Each worker reads its part's blocks from the source and writes the part itself; the
    driver moves only metadata and writes the manifest last. With ``resume``, parts a
    previous run finished (same source, options and plan) are kept as they are.

    Codec options: ``options`` (default: the default mode), then any of
    :class:`~fp8ray.codec.CodecOptions`' fields as keywords (``scaling="token"``), each
    overriding only itself. All of them are recorded in the manifest.
    """
    codec = CodecOptions.parse(codec_options, base=options)  # bad options fail before any work
    check_apart(source, destination)
    refs = list_blocks(source)
    parts = archive.plan_parts(refs, part_bytes)
    fs, path = resolve(destination)
    _prepare_destination(fs, path, destination, resume, overwrite)
    plan = archive.plan_record(source, codec.as_dict(), parts)
    reused: dict[int, archive.PartInfo] = {}
    previous = archive.read_plan(fs, path) if resume else None
    if previous is not None:
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
        archive.write_plan(fs, path, plan)

    infos: dict[int, archive.PartInfo] = dict(reused)
    devices, nodes = set(), set()
    if progress:
        progress(sum(info.blocks for info in reused.values()))
    todo = [i for i in range(len(parts)) if i not in reused]
    with QuantPool(num_workers=workers, gpus_per_worker=gpus_per_worker, address=address) as pool:
        start = time.perf_counter()
        tasks = ((parts[i], codec, destination, i) for i in todo)
        for i, result in zip(todo, pool.map("compress_part", tasks)):
            infos[i] = result.info
            devices.add(result.device)
            nodes.add(result.node_id)
            if progress:
                progress(result.info.blocks)
        replaced = pool.replaced
    seconds = time.perf_counter() - start

    manifest = archive.build_manifest(source, codec.as_dict(), len(refs), [infos[i] for i in range(len(parts))], __version__)
    archive.write_manifest(fs, path, manifest)
    archive.clean_scratch(fs, path)
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
        devices=sorted(devices),
        nodes=len(nodes - {None}),
    )


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
    check_apart(archive_uri, output)
    out_fs, out_path = resolve(output)
    if out_fs.get_file_info(out_path).type != pafs.FileType.NotFound and not overwrite:
        raise ArchiveExistsError(f"output {redact(output)} exists (pass --overwrite to replace it)")
    start = time.perf_counter()
    columns = archive.read_metadata_columns(fs, path, manifest, ["key", "dtype", "shape"])
    entries = [(k, d, tuple(s)) for part in columns for k, d, s in zip(part["key"], part["dtype"], part["shape"])]
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
    return DecompressReport(redact(archive_uri), redact(output), len(entries), manifest["raw_bytes"], time.perf_counter() - start)


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
        for part_result in pool.map("verify_part", tasks):
            report.blocks += part_result.blocks
            report.errors += part_result.errors
            report.metrics.update(part_result.metrics)
            seen.update(part_result.keys)
            if progress:
                progress(part_result.blocks)
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
