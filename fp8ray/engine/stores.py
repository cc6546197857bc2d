"""LMCache filesystem stores converted on the Ray engine (names, forms and scanning are in
:mod:`fp8ray.io.lmcache_store`, the per-file work in :mod:`fp8ray.lmcache.store_files`).

A store's chunk files are in one of three forms for a layout: ``raw`` (the layout's
dtype, no serde), ``fp8`` (LMCache's ``"fp8"`` serde) or ``fp8ray`` (the ``"fp8ray"``
serde's frames). :func:`convert_store` writes every chunk file in a target form, exactly
the bytes an LMCache with that serde would have stored, under the same names:
:func:`compress_store` to ``fp8`` or ``fp8ray``, :func:`decompress_store` to ``raw``.
Each file's form is found from its size and, for frames, its header, so a store that
mixes forms converts too; files already in the target form (frames: in the codec
options asked) are copied unchanged and listed, and a store with nothing to convert is
refused. Workers are ``QuantWorker``
actors, a shard of files per call; docs/LMCACHE.md has the contract.

Nothing is written at the destination until every file is converted: workers write into
a temporary directory beside it, which is renamed into place at the end, and removed if
anything failed. Nothing read is modified.

A store is also an archive's source and an archive's output, through ``compress_archive``
and ``decompress_archive`` (:mod:`fp8ray.engine.archives`, keywords ``lmcache_layout``
and ``lmcache_form``); what they check of a store archive is :func:`check_store_restore`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pyarrow.fs import LocalFileSystem

from ..codec import CodecOptions
from ..codec.frame import header_for
from ..errors import (
    ArchiveExistsError,
    BadInputError,
    DestinationError,
    Fp8rayError,
    InvalidOptionError,
    MismatchError,
    SourceError,
    WriteError,
)
from ..io.leftovers import ScratchMark, sweep_leftovers
from ..io.lmcache_store import (
    FORMS,
    FP8,
    FRAMES,
    RAW,
    STORE_KIND,
    ChunkFile,
    Layout,
    is_store_entry,
    parse_chunk_name,
    parse_layout,
    scan_store,
)
from ..io.paths import (
    check_apart,
    entries,
    list_tree,
    name_list,
    os_reason,
    prepare_parent,
    printable,
    remove_folders,
    remove_quietly,
    replace_directory,
    resolve,
    temporary_name,
)
from ..io.provenance import Provenance, check_provenance
from ..io.records import Manifest
from .pool import PoolSettings, QuantPool, check_pool, use_pool
from .worker import QuantWorker

SHARD_BYTES = 64 << 20  # input bytes per worker call
SERDES = (FP8, FRAMES)  # the forms compress_store writes: LMCache's serde types
RESTORE_FORMS = (RAW, FRAMES)  # the forms an archive of a store comes back in


@dataclass
class StoreReport:
    mode: str  # "compress" | "decompress"
    source: str
    destination: str
    layout: str
    target: str  # the form written: "raw", "fp8" or "fp8ray"
    fp8: str  # the format of plain fp8 files
    codec: dict | None  # the frames' codec options (target fp8ray)
    files: int  # converted
    converted_from: dict[str, int]  # form -> files converted from it
    unchanged: list[str]  # already in the target form: copied as they were
    skipped: list[dict]  # {"name", "reason"}: left alone, not copied
    bytes_before: int  # of the converted files
    bytes_after: int
    seconds: float
    workers: int
    unchanged_bytes: int = 0

    @property
    def input_gbps(self) -> float:
        return self.bytes_before / self.seconds / 1e9 if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "input_gbps": self.input_gbps}


def _check_paths(source: str, destination: str, overwrite: bool, parents: bool) -> tuple[str, str]:
    src, dst = os.path.realpath(source), os.path.realpath(destination)
    if not os.path.isdir(src):
        raise SourceError(f"source {source} is not a directory")
    check_apart(source, destination)
    if os.path.lexists(dst) or os.path.islink(destination):  # a link to nothing is the user's too
        if not overwrite:
            raise ArchiveExistsError(f"destination {destination} exists (pass --overwrite to replace it)")
        if not os.path.isdir(dst):  # a file, or a link to nothing (a link to a store is followed: dst is its target)
            raise DestinationError(f"destination {destination} exists and is not a directory; not replacing it")
        # Replacing it deletes the whole directory: never what is not a store's.
        try:
            foreign = [e.name for e in list_tree(LocalFileSystem(), dst) if not is_store_entry(e.name, e.kind)]
        except OSError as exc:
            raise DestinationError(f"destination {printable(destination)} cannot be listed: {os_reason(exc)}") from None
        if foreign:
            raise DestinationError(
                f"destination {printable(destination)} holds {entries(len(foreign))} "
                f"that {'is' if len(foreign) == 1 else 'are'} not an LMCache store's ({name_list(foreign)}): "
                "--overwrite replaces only a store; move them out first"
            )
    elif not parents:  # a missing folder is refused now; --parents makes it as the conversion starts
        fs, path = resolve(dst)
        prepare_parent(fs, path, destination, parents)
    return src, dst


def _plan_shards(chunks: list[ChunkFile], workers: int) -> list[list[ChunkFile]]:
    """Shards of up to SHARD_BYTES of input, and at least two per worker when there are enough files."""
    most = -(-len(chunks) // (2 * workers))
    shards: list[list[ChunkFile]] = []
    size = 0
    for chunk in chunks:
        if not shards or len(shards[-1]) >= most or (size + chunk.size > SHARD_BYTES and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(chunk)
        size += chunk.size
    return shards


def _nothing_to_convert(source: str, layout: Layout, target: str, chunks: list[ChunkFile], skipped: list[dict]) -> Exception:
    """The error for a store in which no file needs converting, saying why."""
    if chunks:
        return BadInputError(
            f"every chunk file of {source} matching the layout {layout} ({len(chunks)}) is already in the target "
            f"form {target!r}; nothing to convert" + (f" ({len(skipped)} other entries skipped)" if skipped else ""),
            field="source",
        )
    if not skipped:
        return SourceError(f"source {source} holds no files")
    reasons = Counter(s["reason"] for s in skipped)
    common = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(3))
    return MismatchError(
        f"no file of {source} is a chunk file of the layout {layout} in any form (raw, fp8, fp8ray): "
        f"{len(skipped)} entries, {common}; is --layout right?",
        field="layout",
    )


def check_chunk_models(names: list[str], expect_model: str | None, source: str) -> None:
    """Refuse a store holding a chunk file (of these relative ``names``) of a model other
    than ``expect_model``: the model is what the chunk's name records (all a chunk
    records of its provenance)."""
    if expect_model is None:
        return
    expect = Provenance(model=expect_model)  # an empty or unprintable name is refused here
    for name in names:
        model = parse_chunk_name(os.path.basename(name)).model
        what = f"chunk file {printable(name)} of store {printable(source)}"
        if not model or not model.isprintable():  # the store's fault, not the option's: Provenance would blame it
            raise MismatchError(
                f"{what} was made for a model whose name is not printable ({printable(repr(model))}), "
                f"expected model {expect_model!r}",
                field="model",
            )
        made_for = Provenance(model=model)
        if made_for != expect:
            check_provenance(made_for, expect, what)


def convert_store(
    source: str,
    destination: str,
    layout: Layout | str,
    target: str,
    *,
    options: CodecOptions | None = None,
    pool: QuantPool | PoolSettings | None = None,
    overwrite: bool = False,
    parents: bool = False,
    progress=None,
    on_scan=None,
    expect_model: str | None = None,
    plain_form: str | None = None,
    announce: Callable[[str], None] | None = None,
    **codec_options,
) -> StoreReport:
    """Write every chunk file of the LMCache FS store ``source`` in the ``target`` form
    (``"raw"``, ``"fp8"`` or ``"fp8ray"``) into the new directory ``destination``.

    ``options`` are the codec options of the frames written (default: the default mode),
    then any of :class:`~fp8ray.codec.CodecOptions`' fields as keywords
    (``scaling="token"``), each overriding only itself, as ``compress_archive`` takes them;
    their format (``fp8``) and ``nonfinite`` apply to plain fp8 files too. Entries of no
    form are skipped and reported; files already in the target form are copied and
    listed (frames only in ``options``: one in other options is decoded and encoded
    again). A store with nothing to convert (every file in the target form, or none of
    the layout: a wrong ``layout``) raises and creates nothing. A file that fails
    (non-finite values, a damaged frame) aborts the whole run with an error naming it,
    leaving no destination.

    ``progress(n)`` is called with the files just written; ``on_scan(n)`` with the
    number of files to write, before the work starts. ``pool``: a running
    :class:`QuantPool` to use (and leave running), or the :class:`PoolSettings` of one to
    start for this call (default: ``PoolSettings()``). The scratch folders that runs
    killed outright left beside ``destination`` are removed (:mod:`fp8ray.io.leftovers`),
    ``announce`` called with what went.

    ``expect_model``: the model every chunk must be of (LMCache names each chunk file
    after its model); a store holding a chunk of another model is refused with a
    :class:`MismatchError` naming the file and both models, before any work.

    ``plain_form``: what the store's plain files are, ``"raw"`` or ``"fp8"``, where their
    sizes cannot tell (:func:`~fp8ray.io.lmcache_store.scan_store`).
    """
    if target not in FORMS:
        raise InvalidOptionError(f"target form must be one of {list(FORMS)}, got {target!r}", field="target")
    options = CodecOptions.parse(codec_options, base=options)
    fmt = options.fmt
    check_pool(pool)
    layout = parse_layout(layout) if isinstance(layout, str) else layout
    src, dst = _check_paths(source, destination, overwrite, parents)
    replace = overwrite and os.path.lexists(dst)  # only a store there now: one made meanwhile is kept
    scan = scan_store(src, layout, plain_form)
    check_chunk_models([c.name for c in scan.chunks], expect_model, source)
    wanted = header_for(options, layout.dtype, layout.shape)  # a frame in other options is converted: the serde would refuse it
    todo = [c for c in scan.chunks if c.form != target or (target == FRAMES and c.header != wanted)]
    if not todo:
        raise _nothing_to_convert(source, layout, target, scan.chunks, scan.skipped)
    sweep_leftovers(LocalFileSystem(), dst, destination, announce)
    if on_scan is not None:
        on_scan(len(scan.chunks))

    from ..lmcache.store_files import StoreConversion  # the LMCache modules load torch: only here

    scratch = temporary_name(dst)
    conversion = StoreConversion(src, scratch, layout, target, fmt.name, options)
    done = []
    cannot_write = f"cannot write destination {printable(destination)}"
    mark = None
    made = []  # folders --parents makes: removed again if the conversion fails
    try:
        try:
            made = prepare_parent(LocalFileSystem(), dst, destination, parents)
            os.mkdir(scratch)  # in the try: an interrupt that lands as it is made removes it
            mark = ScratchMark(scratch)
        except OSError as exc:
            raise DestinationError(f"{cannot_write}: {os_reason(exc)}") from None
        with use_pool(pool) as running:
            start = time.perf_counter()  # the conversion itself, once the workers are up
            workers = running.num_workers
            items = ((conversion, shard) for shard in _plan_shards(scan.chunks, workers))
            try:
                for files in running.map(QuantWorker.convert_store_files, items):
                    done.extend(files)
                    if progress is not None:
                        progress(len(files))
            except WriteError as exc:  # a chunk file's write: a full disk, above all
                raise DestinationError(f"{cannot_write} ({exc})") from None
            seconds = time.perf_counter() - start
        mark.release()
        try:
            replace_directory(LocalFileSystem(), scratch, dst, destination, replace=replace)  # the old store goes only now
        except Fp8rayError:  # its own, named already (an output made meanwhile, an old store it could not delete)
            raise
        except OSError as exc:
            raise DestinationError(f"{cannot_write}: {os_reason(exc)}") from None
    except BaseException:
        remove_quietly(LocalFileSystem(), scratch)
        remove_folders(made)
        raise
    finally:
        if mark is not None:
            mark.release()
    converted = [f for f in done if not f.copied]
    copied = [f for f in done if f.copied]
    return StoreReport(
        mode="decompress" if target == RAW else "compress",
        source=source,
        destination=destination,
        layout=str(layout),
        target=target,
        fp8=fmt.name,
        codec=options.as_dict() if target == FRAMES else None,
        files=len(converted),
        converted_from=dict(Counter(f.form for f in converted)),
        unchanged=[f.name for f in copied],
        skipped=scan.skipped,
        bytes_before=sum(f.bytes_in for f in converted),
        bytes_after=sum(f.bytes_out for f in converted),
        seconds=seconds,
        workers=workers,
        unchanged_bytes=sum(f.bytes_out for f in copied),
    )


def compress_store(source: str, destination: str, layout: Layout | str, serde: str = FP8, **options) -> StoreReport:
    """An LMCache store -> the files LMCache's ``serde`` (``"fp8"`` or ``"fp8ray"``) writes."""
    if serde not in SERDES:
        raise InvalidOptionError(f"serde must be one of {list(SERDES)}, got {serde!r}", field="serde")
    return convert_store(source, destination, layout, serde, **options)


def decompress_store(source: str, destination: str, layout: Layout | str, **options) -> StoreReport:
    """An LMCache store of ``fp8`` or ``fp8ray`` chunk files -> raw chunk files in the layout's dtype."""
    return convert_store(source, destination, layout, RAW, **options)


def check_store_restore(manifest: Manifest, lmcache_form: str | None, single_file: bool, archive: str) -> None:
    """Refuse, before any work, a decompress that cannot give a store back as asked: an
    ``lmcache_form`` other than ``"raw"`` or ``"fp8ray"``, or given for an archive not made
    from a store, or with ``single_file``; and an archive of a store decompressed with
    neither (its chunk files would not be what any LMCache loads)."""
    kind = manifest.layout.kind if manifest.layout is not None else "safetensors"
    if lmcache_form is None:
        if kind == STORE_KIND and not single_file:
            raise BadInputError(
                f"archive {archive} holds an LMCache store ({manifest.blocks} chunk files): pass --lmcache-form raw "
                "(for an LMCache with no serde) or fp8ray (for the fp8ray serde), or --single-file for one "
                ".safetensors file",
                field="lmcache_form",
            )
        return
    if lmcache_form not in RESTORE_FORMS:
        raise InvalidOptionError(
            f"--lmcache-form must be one of {list(RESTORE_FORMS)}, got {lmcache_form!r}", field="lmcache_form"
        )
    if single_file:
        raise InvalidOptionError(
            "--lmcache-form gives back a store directory; it does not go with --single-file", field="lmcache_form"
        )
    if kind != STORE_KIND:
        raise BadInputError(
            f"archive {archive} was not made from an LMCache store (its source was {kind} files): --lmcache-form "
            "applies only to archives compressed with --lmcache-layout",
            field="lmcache_form",
        )


def restored_serde(manifest: Manifest, lmcache_form: str) -> dict | None:
    """The ``"serde"`` an LMCache ``fs`` adapter needs to load a store given back in
    ``lmcache_form`` (None: raw, no serde): the fp8ray serde in the archive's codec
    options, whose frames the files are as they were archived (LMCache reads a file
    into a buffer of the serde's exact size, so the options must be the archive's)."""
    if lmcache_form != FRAMES:
        return None
    return {"type": FRAMES, **manifest.options.as_dict()}
