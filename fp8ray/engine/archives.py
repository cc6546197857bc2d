"""Archive operations on the Ray engine: compress, decompress, verify, inspect.

Each returns a report object; the CLI and the Ray jobs are thin wrappers around these.
The archive format itself is :mod:`fp8ray.io.archive`.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import posixpath
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import pyarrow.fs as pafs

from .. import __version__
from ..codec import CodecOptions, frame
from ..codec.bound import bound_constants
from ..codec.formats import is_stored
from ..errors import (
    ArchiveExistsError,
    CorruptArchiveError,
    CorruptDataError,
    DestinationError,
    Fp8rayError,
    InvalidOptionError,
    SourceError,
    WriteError,
    block_error,
)
from ..io import archive
from ..io.archive import DEFAULT_LOSSLESS, DEFAULT_PART_BYTES
from ..io.blocks import scan_source
from ..io.destinations import (
    check_output,
    clean_temporaries,
    hold_destination,
    make_work,
    prepare_destination,
    remove_created,
    undo_compress,
)
from ..io.leftovers import ScratchMark, sweep_leftovers
from ..io.lmcache_store import STORE_KIND, Layout
from ..io.paths import (
    as_uri,
    check_apart,
    counted,
    entries,
    move_into_place,
    name_list,
    os_reason,
    output_error,
    output_exists,
    printable,
    redact,
    remove_folders,
    remove_quietly,
    replace_directory,
    resolve,
    resolve_output,
    temporary_name,
    uri_for,
)
from ..io.provenance import Provenance, check_provenance, short_repr
from ..io.restore import RESTORE_COLUMNS, SINGLE_FILE_METADATA_KEY, plan_restore
from ..io.safetensors import FRAMES_BODY, FRAMES_MARK
from ..io.store_source import scan_store_source
from .pool import PoolSettings, QuantPool, check_pool, use_pool
from .stores import check_chunk_models, check_store_restore, restored_serde
from .worker import QuantWorker

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
    skipped: list[dict] = field(default_factory=list)  # what a source tree holds that was not taken: name, reason
    stored: int = 0  # blocks of a dtype fp8 does not encode (integers, bool, ...), kept in stored frames
    written_raw_bytes: int = 0  # of the parts this run wrote (not those resumed): what ``seconds`` covers

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.archive_bytes if self.archive_bytes else 0.0

    @property
    def input_gbps(self) -> float:
        """Input compressed per second by this run (parts resumed took none of its time)."""
        return self.written_raw_bytes / self.seconds / 1e9 if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "input_gbps": self.input_gbps}


@dataclass
class DecompressReport:
    archive: str
    output: str
    blocks: int
    raw_bytes: int
    seconds: float  # the work, once the workers are up
    files: int
    nodes: int = 0  # distinct Ray nodes that wrote files
    deleted: list[str] = field(default_factory=list)  # what --force-replace deleted that the archive does not describe
    lmcache_serde: dict | None = None  # a store given back as fp8ray files: the "serde" LMCache loads them with

    @property
    def output_gbps(self) -> float:
        return self.raw_bytes / self.seconds / 1e9 if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "output_gbps": self.output_gbps}


@dataclass
class VerifyReport:
    archive: str
    blocks: int
    parts: int
    errors: list[str] = field(default_factory=list)
    metrics: dict[str, dict] = field(default_factory=dict)
    stored: list[str] = field(default_factory=list)  # with against: stored blocks found identical (not in metrics)

    @property
    def ok(self) -> bool:
        return not self.errors

    def as_dict(self) -> dict:
        from ..codec.metrics import json_safe

        return json_safe({**asdict(self), "ok": self.ok})  # an exact block's snr_db is +inf


def _scan_compressible(
    source: str, codec: CodecOptions, strict: bool = False, lmcache_layout: Layout | str | None = None, plain_form=None
):
    """The source's layout and blocks, refused before anything is written if it holds no
    tensor, or one no frame can hold (or whose frame in ``codec`` no part can), or
    (``strict``) anything it does not take. ``lmcache_layout``: the source is an LMCache
    store of chunks of that layout (``plain_form``: :func:`~fp8ray.io.lmcache_store.scan_store`'s)."""
    if lmcache_layout is None:
        layout, refs = scan_source(source)
    else:
        layout, refs = scan_store_source(source, lmcache_layout, plain_form)
    if strict and layout.skipped:
        raise SourceError(
            f"source {redact(source)} holds {entries(len(layout.skipped))} "
            f"compress does not take (--strict): " + name_list([f"{s.name} ({s.reason})" for s in layout.skipped])
        )
    if not refs:
        raise SourceError(f"source {redact(source)} holds no tensors: there is nothing to compress")
    marked = [f.name for f in layout.files if f.metadata.get(FRAMES_MARK) == FRAMES_BODY]
    if marked:  # its U8 tensors would be archived as opaque stored bytes, larger than the tensors' fp8
        where = redact(source) if layout.container == "file" else f"{redact(source).rstrip('/')}/{marked[0]}"
        raise SourceError(
            f"{where} holds fp8ray frames already (the service's encode response, "
            f"__metadata__ {FRAMES_MARK!r}: {FRAMES_BODY!r}): decode it (POST /v1/decode, or fp8ray.decode of each "
            "tensor) and compress the tensors"
        )
    checked = set()  # blocks share a few shapes: each is checked once, named by its first block
    for ref in refs:
        if (ref.dtype, ref.shape) not in checked:
            try:
                frame.check_shape(ref.shape, ref.dtype)
                archive.check_frame_fits(frame.header_for(codec, ref.dtype, ref.shape).frame_size)
            except ValueError as exc:
                raise block_error(ref.key, exc, ref.of_file) from None
            checked.add((ref.dtype, ref.shape))
    return layout, refs


def _resumable_parts(
    fs: pafs.FileSystem, work: str, plan: archive.Plan, previous: archive.Plan | None, destination: str
) -> dict[int, archive.Part]:
    """The parts an interrupted run of the same plan finished (none without one)."""
    if previous is None:
        return {}
    why = _why_not_resumable(previous, plan)
    if why:
        raise ArchiveExistsError(f"cannot resume {redact(destination)}: {why}; {archive.START_AGAIN}")
    infos = {i: archive.resumable_part(fs, work, i, len(blocks)) for i, blocks in enumerate(plan.parts)}
    return {i: info for i, info in infos.items() if info is not None}


def _why_not_resumable(previous: archive.Plan, plan: archive.Plan) -> str:
    """Why an interrupted run's plan cannot be continued by this run (``""``: it can), as
    the refusal says it. A local source is the same given as a relative or an absolute
    path, or with a trailing slash (a job is given absolute paths)."""
    same_source = previous.source == plan.source or (
        "://" not in previous.source + plan.source and os.path.realpath(previous.source) == os.path.realpath(plan.source)
    )
    if not same_source:
        return f"it was started from another source, {redact(previous.source)} (this run's: {redact(plan.source)})"
    if previous.codec != plan.codec:
        changed = sorted(k for k in previous.codec.keys() | plan.codec.keys() if previous.codec.get(k) != plan.codec.get(k))
        return "it was started with other codec options: " + ", ".join(
            f"{k} {previous.codec.get(k)!r} (this run's: {plan.codec.get(k)!r})" for k in changed
        )
    if _spelled_alike(previous.lossless) != plan.lossless:
        return f"it was started with another lossless stage, {previous.lossless} (this run's: {plan.lossless})"
    if previous.parts != plan.parts:
        return (
            f"it was started with another plan of parts ({len(previous.parts)} parts, this run's {len(plan.parts)}): "
            "another --part-mb, or other blocks in the source"
        )
    # Same keys and shapes is not same values: a source rewritten since must not reuse parts.
    if previous.files is None:
        return (
            "its plan, written by an earlier fp8ray, does not record the source files' sizes and times, "
            "so a source rewritten since cannot be told"
        )
    return archive.changed_file(previous.files, plan.files or ()) or ""


def _spelled_alike(lossless: str) -> str:
    """An earlier plan's lossless stage as this fp8ray records it (``zstd:03`` as ``zstd:3``),
    or as it is where this fp8ray would refuse it."""
    try:
        return archive.canonical_lossless(lossless)
    except InvalidOptionError:
        return lossless


def _parts_left(fs: pafs.FileSystem, work: str, total: int) -> str:
    """What a failed compress leaves for ``--resume``: the parts finished, as their
    sidecars say (calls still running when one failed finish theirs too)."""
    done = sum(archive.read_sidecar(fs, work, i) is not None for i in range(total))
    return f"; {done} of {total} parts done: rerun with --resume to keep them"


def _destination_error(exc: OSError, destination: str, left: str = "") -> OSError:
    """An error writing the destination, as the user sees it (then ``left``: what is
    left of the run): a worker's :class:`WriteError` names the file within it; fp8ray's
    other errors stay as they are; pyarrow's text repeats its cause and may name a
    scratch directory, so name what was typed, once."""
    if isinstance(exc, WriteError):
        return DestinationError(f"cannot write destination {redact(destination)} ({exc}){left}")
    if isinstance(exc, Fp8rayError):
        return exc
    return DestinationError(f"cannot write destination {redact(destination)}: {os_reason(exc)}{left}")


def compress_archive(
    source: str,
    destination: str,
    *,
    options: CodecOptions | None = None,
    resume: bool = False,
    overwrite: bool = False,
    parents: bool = False,
    strict: bool = False,
    part_bytes: int = DEFAULT_PART_BYTES,
    lossless: str = DEFAULT_LOSSLESS,
    progress: Progress | None = None,
    pool: QuantPool | PoolSettings | None = None,
    provenance: Provenance | Mapping[str, str] | None = None,
    lmcache_layout: Layout | str | None = None,
    lmcache_plain_form: str | None = None,
    announce: Callable[[str], None] | None = None,
    on_scan: Callable[[int], None] | None = None,
    **codec_options,
) -> CompressReport:
    """Compress a safetensors file, a directory of them or a raw-block Parquet archive
    into an fp8ray archive directory on the Ray engine.

    Each worker reads its part's blocks from the source and writes the part itself; the
    driver moves only metadata and writes the manifest last. With ``resume``, parts a
    previous run finished (same source, options and plan, its files of the same size and
    modification time) are kept as they are (``resume`` with ``overwrite`` is refused). A
    destination that overlaps the source is refused before anything is touched;
    ``overwrite`` replaces an existing archive only once the new one is complete; a run
    that fails before any part is finished leaves the destination as it found it (one
    that fails later keeps its finished parts for ``resume``). A non-empty directory that
    is not an fp8ray archive (or an interrupted compress) is never written into. A missing parent directory
    is created with ``parents``, else refused. ``pool``: a running :class:`QuantPool` to
    use (and leave running), or the :class:`PoolSettings` of one to start for this call
    (default: ``PoolSettings()``).

    A directory source is a tree: every ``.safetensors`` (or ``.parquet``) file in it,
    subfolders too, under its relative path. What else it holds (other files, hidden
    names, symbolic links to folders, empty folders) is named in the report's and the
    manifest's ``skipped``; with ``strict`` it is an error instead, before any work.

    Codec options: ``options`` (default: the default mode), then any of
    :class:`~fp8ray.codec.CodecOptions`' fields as keywords (``scaling="token"``), each
    overriding only itself. All of them are recorded in the manifest, with ``lossless``
    (the Parquet codec of the frame column, ``"zstd:3"``, ``"none"``...), the source's
    layout (to give it back) and the codec's error bound (to verify against).

    ``provenance``: what the cache was made for (a :class:`~fp8ray.io.records.Provenance`
    or a mapping of its fields: ``model``, ``revision``, ``kv_layout``), recorded in the
    manifest for ``open_archive(..., expect=...)`` and ``decompress_archive(expect=...)``
    to check. None given: the manifest records none.

    ``lmcache_layout``: the source is an LMCache filesystem store (a local directory)
    whose chunks are of this layout (``"bfloat16:2,30,256,192"``,
    :class:`~fp8ray.io.lmcache_store.Layout`): every chunk file, raw or in the ``fp8`` or
    ``fp8ray`` serde's form, flat or in hash-prefix folders, becomes one block, recorded
    under its path in the store (:mod:`fp8ray.io.store_source`); ``decompress_archive``
    with ``lmcache_form`` gives the store back. ``lmcache_plain_form`` (with ``lmcache_layout`` only): ``"raw"`` or
    ``"fp8"``, what the store's plain files are where their sizes cannot tell
    (:func:`~fp8ray.io.lmcache_store.scan_store`).

    The scratch folders that runs killed outright left beside the destination are
    removed first (:mod:`fp8ray.io.leftovers`), ``announce`` called with what went.
    ``on_scan(n)`` is called with the number of blocks once the source is scanned and the
    destination checked, before any work; ``progress(n)`` with the blocks just finished
    (those of resumed parts first).
    """
    if resume and overwrite:  # overwrite would win, and the finished parts be thrown away unsaid
        raise InvalidOptionError(
            "--resume keeps what an interrupted compress finished, --overwrite replaces the destination: pass one",
            field="resume",
        )
    if lmcache_plain_form is not None and lmcache_layout is None:  # it would be ignored
        raise InvalidOptionError(
            "--plain-form says what an LMCache store's files are: it goes with --lmcache-layout", field="lmcache_plain_form"
        )
    codec = CodecOptions.parse(codec_options, base=options)  # bad options fail before any work
    archive.check_block_size_fits(codec)
    if isinstance(part_bytes, bool) or not isinstance(part_bytes, numbers.Integral) or part_bytes < 1:
        raise InvalidOptionError(f"part_bytes must be a positive integer, got {part_bytes!r}", field="part_bytes")
    made_for = Provenance.parse(provenance)
    source, destination = as_uri(source, "source"), as_uri(destination, "destination")
    check_pool(pool)
    lossless = archive.canonical_lossless(lossless)  # as the archive records it
    check_apart(source, destination)
    layout, refs = _scan_compressible(source, codec, strict, lmcache_layout, lmcache_plain_form)
    if lmcache_layout is not None:  # a chunk's name records its model: the one recorded must be it
        check_chunk_models([f.name for f in layout.files], made_for.model, source)
    compress_part = QuantWorker.compress_part if lmcache_layout is None else QuantWorker.compress_store_part
    parts = archive.plan_parts(refs, part_bytes)
    stamps = archive.source_stamps(source, layout)  # as the scan found the files: --resume compares them
    try:
        dest = prepare_destination(destination, resume, overwrite, parents)
    except OSError as exc:
        raise _destination_error(exc, destination) from None
    fs, work = dest.fs, dest.work
    sweep_leftovers(fs, dest.path, destination, announce)
    if on_scan is not None:
        on_scan(len(refs))
    held, run, mark = False, None, None
    try:
        try:
            make_work(dest)
            if dest.replacing:
                mark = ScratchMark(work, fs)
        except OSError as exc:
            raise _destination_error(exc, destination) from None
        with hold_destination(dest, destination):  # one compress at a time writes a directory
            held = True
            plan = archive.plan_record(source, codec.as_dict(), lossless, parts, stamps)
            previous = archive.read_plan(fs, work) if resume and not dest.replacing else None
            reused = _resumable_parts(fs, work, plan, previous, destination)
            todo = [i for i in range(len(parts)) if i not in reused]
            run = _PartsRun(dict(reused))
            if previous is None:
                try:
                    archive.write_plan(fs, work, plan)
                except OSError as exc:
                    raise _destination_error(exc, destination) from None
            if progress:
                progress(sum(info.blocks for info in reused.values()))
            try:
                _write_parts(run, pool, compress_part, parts, todo, (codec, uri_for(destination, work), lossless), progress)
            except (WriteError, SourceError) as exc:  # a part's write (a full disk, above all), or a source file's read
                kept = (run.finished or reused) and not dest.replacing  # else nothing of this run is left (below)
                left = _parts_left(fs, work, len(parts)) if kept else ""
                if isinstance(exc, SourceError):  # gone, cut short, or unreadable for a while: resumed once it is back
                    raise SourceError(f"{exc}{left}") from None
                raise _destination_error(exc, destination, left) from None
            # The workers read each file at the offsets the scan found: a file rewritten
            # since (a new header moves every tensor) was archived from the wrong bytes.
            changed = archive.changed_file(stamps, archive.source_stamps(source, layout, gone_ok=True), "while compress read it")
            if changed:
                undo_compress(dest, todo)
                raise SourceError(f"{changed}: its blocks may have been read from the wrong bytes; nothing was archived")
            bound = bound_constants(codec.fmt, codec.scaling)
            stored = sum(is_stored(ref.dtype) for ref in refs)
            part_infos = [run.infos[i] for i in range(len(parts))]
            manifest = archive.build_manifest(
                source, layout, codec.as_dict(), lossless, bound, len(refs), part_infos, __version__, made_for, stored
            )
            _check_parts_arrived(fs, work, run, destination)
            try:
                archive.write_manifest(fs, work, manifest)
            except OSError as exc:
                raise _destination_error(exc, destination, "" if dest.replacing else _parts_left(fs, work, len(parts))) from None
            archive.clean_scratch(fs, work)
        if dest.replacing:  # the old archive goes only now
            mark.release()
            replace_directory(fs, work, dest.path, destination, replace=True)
    except BaseException as exc:
        if dest.replacing:
            remove_quietly(fs, work)  # the old archive stays as it was (or, once replaced, work is gone)
            if mark is not None:
                mark.release()
        elif not held and isinstance(exc, ArchiveExistsError):
            pass  # another compress holds the directory: what is in it is its own
        elif run is None:  # before any work: what is there is an earlier run's, or nothing
            if dest.created:
                remove_created(dest)
        elif fs.get_file_info(f"{work}/{archive.MANIFEST_NAME}").type == pafs.FileType.File:
            # Interrupted once the manifest was written: the archive is whole; its scratch goes.
            with contextlib.suppress(OSError):
                archive.clean_scratch(fs, work)
        elif not run.finished and not reused:
            undo_compress(dest, todo)
        raise
    return CompressReport(
        source=redact(source),
        archive=redact(destination),
        blocks=len(refs),
        parts=len(parts),
        parts_reused=len(reused),
        raw_bytes=manifest.raw_bytes,
        frame_bytes=manifest.frame_bytes,
        archive_bytes=manifest.archive_bytes,
        seconds=run.seconds,
        workers=run.workers,
        workers_replaced=run.replaced,
        devices=sorted(run.devices),
        nodes=len(run.nodes - {None}),
        skipped=[asdict(entry) for entry in layout.skipped],
        stored=stored,
        written_raw_bytes=sum(info.raw_bytes for i, info in run.infos.items() if i not in reused),
    )


@dataclass
class _PartsRun:
    """What writing an archive's parts gave: each part's manifest entry (those resumed
    included), where they were written, and the pool's figures."""

    infos: dict[int, archive.Part]
    devices: set = field(default_factory=set)
    nodes: set = field(default_factory=set)
    finished: list = field(default_factory=list)  # parts written in this run, in whatever order they arrived
    seconds: float = 0.0
    workers: int = 0
    replaced: int = 0


def _check_parts_arrived(fs: pafs.FileSystem, work: str, run: _PartsRun, destination: str) -> None:
    """Refuse to write the manifest unless every part this run wrote is in the destination,
    as this process sees it, with the size its worker reported: a worker on another node
    writes a local path on its own disk (one listing, not a request per part)."""
    found = {e.base_name: e.size for e in fs.get_file_info(pafs.FileSelector(work)) if e.type == pafs.FileType.File}
    absent = [p.name for i, p in sorted(run.infos.items()) if found.get(p.name) != p.file_bytes]
    if absent:
        nodes = len(run.nodes - {None})
        why = (
            f" (the workers ran on {counted(nodes, 'Ray node')}: on a cluster, a local path must be on storage every node "
            "mounts, or give an s3:// destination)"
            if nodes
            else ""
        )
        raise DestinationError(
            f"{counted(len(absent), 'part')} the workers wrote ({name_list(absent)}) not in {redact(destination)} as this "
            f"process sees it, or not at the size written{why}; no manifest was written"
        )


def _write_parts(run: _PartsRun, pool, method: Callable, parts: list, todo: list[int], common: tuple, progress) -> None:
    """Write parts ``todo`` on the pool with ``method`` (a ``QuantWorker`` method taking a
    part's blocks, then ``common``: codec, work directory's URI, lossless stage; then the
    part's index), recording each in ``run`` as it comes."""
    codec, work_uri, lossless = common
    with use_pool(pool) as running:
        start = time.perf_counter()
        tasks = ((parts[i], codec, work_uri, i, lossless) for i in todo)
        for i, result in zip(todo, running.map(method, tasks, on_result=run.finished.append)):
            run.infos[i] = result.info
            run.devices.add(result.device)
            run.nodes.add(result.node_id)
            if progress:
                progress(result.info.blocks)
        run.replaced = running.replaced
        run.workers = running.num_workers
    run.seconds = time.perf_counter() - start


def decompress_archive(
    archive_uri: str,
    output: str,
    *,
    single_file: bool = False,
    overwrite: bool = False,
    force_replace: bool = False,
    parents: bool = False,
    progress: Progress | None = None,
    pool: QuantPool | PoolSettings | None = None,
    announce: Callable[[str], None] | None = None,
    expect: Provenance | Mapping[str, str] | None = None,
    lmcache_form: str | None = None,
) -> DecompressReport:
    """Give back what was compressed: the source's own files at ``output`` (a directory of
    the same files, keys, order and metadata; a single file; a raw-block Parquet file with
    the same columns), written by the workers that decode their blocks, straight to the
    destination; the driver moves only metadata. With ``single_file`` (and for archives
    written before the layout was recorded), every block into one ``.safetensors`` file.
    On a local output, a safetensors file whose blocks lie in several parts (a large
    file, or ``single_file``) is written by several workers at once: the driver writes
    its header and size, and each part's task its blocks' byte ranges; elsewhere (an
    object store: no writes at offsets) each file has one writer. Either way a worker
    holds one part at a time, whatever the file's size (:mod:`fp8ray.io.restore`).

    The destination is checked before any work; the output appears by rename only when
    complete, and a damaged part or frame leaves nothing behind. Nothing decompress did
    not write is removed: ``overwrite`` replaces an output holding only what the archive
    describes (an earlier decompress of it); ``force_replace`` replaces one holding other
    files too, calling ``announce`` with what it will delete before any work. The scratch
    folders that runs killed outright left beside ``output`` are removed
    (:mod:`fp8ray.io.leftovers`), ``announce`` called with what went. ``pool``:
    as for :func:`compress_archive`. ``expect``: the provenance the archive must record
    (some of ``model``, ``revision``, ``kv_layout``); an archive made for anything else,
    or recording none, is refused with a :class:`~fp8ray.errors.MismatchError` naming
    the field, before any work.

    ``lmcache_form``: an archive of an LMCache store (``compress_archive(...,
    lmcache_layout=...)``) comes back as a store at ``output``, the same file names in the
    same folders, each file ``"raw"`` (the layout's dtype: an LMCache with no serde loads
    it) or ``"fp8ray"`` (the archive's frames as they are: the fp8ray serde in the
    archive's codec options loads it; ``lmcache_serde`` in the report). An archive of a
    store needs one (or ``single_file``); any other archive refuses one.
    """
    archive_uri, output = as_uri(archive_uri, "archive"), as_uri(output, "output")
    check_pool(pool)
    expect = Provenance.parse(expect)  # a bad field name fails before anything is read
    fs, path = resolve(archive_uri)
    manifest = archive.read_manifest(fs, path, archive_uri)
    check_provenance(manifest.provenance, expect, f"archive {redact(archive_uri)}")
    check_store_restore(manifest, lmcache_form, single_file, redact(archive_uri))
    check_apart(archive_uri, output)
    columns = archive.read_metadata_columns(fs, path, manifest, RESTORE_COLUMNS, archive_uri)
    out_fs, out_path = resolve_output(output)
    # A local output is written at offsets: a safetensors file from several parts, by several
    # workers at once (a store's chunk files are one block each) where they share this disk.
    single_name = posixpath.basename(out_path) if single_file else None
    ranged = isinstance(out_fs, pafs.LocalFileSystem) and lmcache_form is None
    try:
        plan = plan_restore(manifest, columns, single_name, ranged)
    except (CorruptArchiveError, DestinationError):
        # Values no block has, or keys that clash: where the columns' CRC says why, a part damaged.
        archive.read_metadata_columns(fs, path, manifest, RESTORE_COLUMNS, archive_uri, check=True)
        raise
    # Folders --parents makes, taken away again if the command fails (a damaged archive leaves nothing).
    foreign, made = check_output(out_fs, out_path, output, plan, overwrite or force_replace, force_replace, parents)
    # What is replaced at the end: only an output there now (one made meanwhile is kept).
    replace = (overwrite or force_replace) and output_exists(out_fs, out_path)
    if foreign and announce:
        announce(
            f"--force-replace: replacing {redact(output)} deletes {entries(len(foreign))} "
            f"the archive does not describe: {name_list(foreign)}"
        )
    report = DecompressReport(redact(archive_uri), redact(output), 0, 0, 0.0, 0, deleted=foreign)
    report.lmcache_serde = restored_serde(manifest, lmcache_form)
    sweep_leftovers(out_fs, out_path, output, announce)
    nodes = set()
    scratch = temporary_name(out_path)
    mark = None
    try:
        out_fs.create_dir(scratch)  # in the try: an interrupt that lands as it is made removes it
        mark = ScratchMark(scratch, out_fs)
        with use_pool(pool) as running:
            start = time.perf_counter()
            if plan.shared and not running.on_this_machine():  # workers elsewhere cannot write this disk's files
                plan = plan_restore(manifest, columns, single_name, ranged=False)
            for f in plan.shared:  # its header and size, before the tasks write their ranges of it
                f.create_presized(scratch)
            scratch_uri = uri_for(output, scratch)
            tasks = ((archive_uri, {i: manifest.parts[i] for i in t.parts}, t, scratch_uri) for t in plan.tasks)
            if lmcache_form is not None:  # a store's chunk files, in the form asked for
                results = running.map(QuantWorker.restore_store_files, ((*task, lmcache_form) for task in tasks))
            else:
                results = running.map(QuantWorker.restore_files, tasks)
            for result in results:
                report.files += result.files
                report.blocks += result.blocks
                report.raw_bytes += result.raw_bytes
                nodes.add(result.node_id)
                if progress:
                    progress(result.blocks)
            report.files += len(plan.shared)
            report.seconds = time.perf_counter() - start
            report.nodes = len(nodes - {None})
        clean_temporaries(out_fs, scratch)  # of workers killed mid-file; their files were rewritten
        mark.release()
        if plan.container == "directory":
            replace_directory(out_fs, scratch, out_path, output, replace=replace)
        else:
            (only,) = plan.files
            # Replaces an old file (--overwrite) in one step; else keeps one made meanwhile.
            move_into_place(out_fs, f"{scratch}/{only.name}", out_path, output, replace=replace)
            out_fs.delete_dir(scratch)
    except OSError as exc:
        remove_quietly(out_fs, scratch)
        remove_folders(made)
        raise output_error(output, exc) from None  # pyarrow's text names the scratch directory; fp8ray's own pass
    except BaseException as exc:
        remove_quietly(out_fs, scratch)
        remove_folders(made)
        if isinstance(exc, CorruptDataError) and _replaced(fs, path, manifest):
            raise SourceError(_replaced_message(archive_uri, "decompress") + "; nothing written") from None
        raise
    finally:
        if mark is not None:
            mark.release()
    return report


def verify_archive(
    archive_uri: str,
    *,
    against: str | None = None,
    progress: Progress | None = None,
    pool: QuantPool | PoolSettings | None = None,
) -> VerifyReport:
    """Check every part's CRC-32C and every frame; with ``against``, error metrics per
    block against the original source, each block held to the codec's derived error bound
    (a source that is not the one compressed fails). Damage is reported, naming the block
    (or the part where it lies outside every block), not raised. ``pool``: as for
    :func:`compress_archive`."""
    archive_uri = as_uri(archive_uri, "archive")
    against = as_uri(against, "against") if against is not None else None
    check_pool(pool)
    fs, path = resolve(archive_uri)
    manifest = archive.read_manifest(fs, path, archive_uri)
    layout = manifest.layout
    name_files = layout is not None and len(layout.files) > 1
    refs = source_layout = None
    if against is not None and layout is not None and layout.kind == STORE_KIND:
        raise InvalidOptionError(
            f"archive {redact(archive_uri)} is of an LMCache store, and verify --against compares an archive with a "
            ".safetensors or .parquet source only: verify it without --against (every part's and frame's CRC), or "
            "decompress it with --lmcache-form raw and compare the chunk files",
            field="against",
        )
    if against is not None:
        source_layout, source_refs = scan_source(against)
        refs = archive.blocks_by_ident(layout, source_layout, source_refs, against)
    codec = manifest.options
    bound = manifest.error_bound or bound_constants(codec.fmt, codec.scaling)
    report = VerifyReport(redact(archive_uri), 0, len(manifest.parts))
    seen: set[tuple[str, str]] = set()
    stored_frames = 0
    with use_pool(pool) as running:
        # The source's block map goes to the object store once, not with every part.
        shared_refs = running.share(refs)
        tasks = ((archive_uri, part, shared_refs, bound, name_files, codec) for part in manifest.parts)
        for part, part_result in zip(manifest.parts, running.map(QuantWorker.verify_part, tasks)):
            report.blocks += part_result.blocks
            report.errors += part_result.errors
            if part_result.blocks != part.blocks and not part_result.errors:
                recorded = counted(part.blocks, "block")
                report.errors.append(f"the manifest records {recorded} in {part.name}, it holds {part_result.blocks}")
            report.metrics.update(part_result.metrics)
            report.stored += part_result.stored
            stored_frames += part_result.stored_frames
            seen.update(part_result.idents)
            if progress:
                progress(part_result.blocks)
    if report.blocks != manifest.blocks and not report.errors:
        report.errors.append(f"the manifest records {counted(manifest.blocks, 'block')}, the parts hold {report.blocks}")
    if stored_frames != manifest.stored_blocks and not report.errors:
        report.errors.append(
            f"the manifest records {counted(manifest.stored_blocks, 'stored block')}, the parts hold {stored_frames}"
        )
    if not report.errors:  # every part checks: what decompress would make of them must too
        try:
            plan_restore(manifest, archive.read_metadata_columns(fs, path, manifest, RESTORE_COLUMNS, archive_uri))
        except CorruptArchiveError as exc:
            report.errors.append(str(exc))
    if refs is not None:
        report.errors += _compare_files(layout, source_layout, refs, seen, against)
    report.errors += archive.unlisted_entries(fs, path, manifest, archive_uri)
    if report.errors and _replaced(fs, path, manifest):  # its parts were another archive's: no damage to report
        report.errors = [_replaced_message(archive_uri, "verify")]
    return report


def _replaced(fs: pafs.FileSystem, path: str, manifest: archive.Manifest) -> bool:
    """Whether the archive at ``path`` is no longer the one whose ``manifest`` was read
    (a compress --overwrite replaced it meanwhile), so that what failed is not damage."""
    try:
        return archive.read_manifest(fs, path) != manifest
    except CorruptDataError:  # gone, or being replaced right now
        return True


def _replaced_message(archive_uri: str, command: str) -> str:
    return (
        f"archive {redact(archive_uri)} was replaced while {command} read it (a compress --overwrite?), "
        "so its parts were not the ones its manifest described: run it again"
    )


def _compare_files(layout, source_layout, refs: dict, seen: set, against: str) -> list[str]:
    """What a source holds that the archive does not, by file: a whole file, blocks of
    one, or a safetensors file's ``__metadata__`` (decompress gives the archive's back);
    and the archive's files the source lacks."""
    errors = []
    file_of = archive.source_file_names(layout, source_layout)
    archived = {f.name: f for f in layout.files} if layout is not None else None
    in_archive = set(archived) if archived is not None else None
    missing: dict[str, list[str]] = {}
    for ident in sorted(set(refs) - seen):
        missing.setdefault(refs[ident].file, []).append(ident[1])
    for f in source_layout.files:
        name = printable(f.name)
        if in_archive is not None and file_of[f.name] not in in_archive:
            errors.append(f"source file {name} ({counted(f.blocks, 'block')}) is not in the archive")
            continue
        if f.name in missing:
            keys = missing[f.name]
            errors.append(f"{len(keys)} block(s) of source file {name} are not in the archive, e.g. {keys[0]!r}")
        if archived is not None and layout.kind == source_layout.kind == "safetensors":
            difference = _metadata_difference(f.metadata, archived[file_of[f.name]].metadata)
            if difference:
                errors.append(f"source file {name}: {difference}")
    if in_archive is not None:
        errors += [
            f"file {printable(name)} of the archive is not in {redact(against)}"
            for name in sorted(in_archive - set(file_of.values()))
        ]
    return errors


def _metadata_difference(source: dict[str, str], archived: dict[str, str]) -> str:
    """How a source file's ``__metadata__`` differs from the archive's record of it, by the
    first key (in sorted order) that does; ``""`` where they agree. The key
    ``decompress --single-file`` adds (the archive's codec options) is not the source's
    own: a file it wrote verifies against its archive."""
    if SINGLE_FILE_METADATA_KEY not in archived:
        source = {k: v for k, v in source.items() if k != SINGLE_FILE_METADATA_KEY}
    key = next((k for k in sorted(set(source) | set(archived)) if source.get(k) != archived.get(k)), None)
    if key is None:
        return ""

    def value(metadata: dict[str, str]) -> str:
        return short_repr(metadata[key]) if key in metadata else "absent"

    return (
        f"its __metadata__ differs from the archive's: {short_repr(key)} is {value(archived)} in the archive, "
        f"{value(source)} in the source"
    )


@dataclass
class InspectReport:
    """An archive's manifest, and ``problems``: each part missing, or of another size than
    the manifest records."""

    manifest: archive.Manifest
    problems: list[str]

    @property
    def ratio(self) -> float:
        return self.manifest.raw_bytes / self.manifest.archive_bytes if self.manifest.archive_bytes else 0.0

    def as_dict(self) -> dict:
        """The manifest's JSON, keys sorted as in its file, with the compression ratio and
        the problems."""
        return {**_sorted_keys(self.manifest.to_json()), "ratio": self.ratio, "problems": self.problems}


def _sorted_keys(value):
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    return [_sorted_keys(v) for v in value] if isinstance(value, list) else value


def inspect_archive(archive_uri: str | os.PathLike) -> InspectReport:
    """The manifest, with the compression ratio, and the problems found checking every
    part's presence and size (without reading any part)."""
    archive_uri = as_uri(archive_uri, "archive")
    fs, path = resolve(archive_uri)
    manifest = archive.read_manifest(fs, path, archive_uri)
    return InspectReport(manifest, archive.part_problems(fs, path, manifest, archive_uri))
