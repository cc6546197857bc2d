"""The compressed archive: a directory of Parquet parts and a manifest written last.

Specified in docs/FORMAT.md. Each part is an ordinary Parquet file (one row per block:
its frame in a ``large_binary`` column beside plain columns for the source file, key,
dtype, shape, format, scaling and sizes; the frame column optionally compressed by a
lossless Parquet codec), so ``pyarrow.parquet.read_table`` and
``ray.data.read_parquet`` read it without fp8ray. ``_manifest.json`` (skipped by Parquet
readers, like every name starting with ``_`` or ``.``) holds the codec options, counts,
sizes and each part's CRC-32C; it is renamed into place last, so a directory without
it is never a complete archive. A part is written under a temporary name and renamed,
then described by a sidecar ``_part-NNNNN.json``, which ``--resume`` checks the part
against (:func:`resumable_part`). What the
JSON files hold, and how each is checked, is :mod:`fp8ray.io.records`.
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from collections.abc import Iterator

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..codec.formats import is_stored
from ..codec.options import CodecOptions
from ..errors import BadInputError, CorruptArchiveError, InvalidOptionError, MismatchError, SourceError, WriteError
from . import columns as arrow_columns
from . import part_checks
from .blocks import MANIFEST_NAME, BlockRef, SourceLayout
from .lossless import DEFAULT_LOSSLESS, canonical_lossless, parse_lossless  # noqa: F401 (re-exported)
from .paths import delete_quietly, entries, is_temporary, name_list, one_line, os_reason, printable, redact, resolve, write_atomic
from .provenance import Provenance
from .records import ARCHIVE_VERSION, PART_PREFIX, PART_SUFFIX, STORED_FRAMES_VERSION, Manifest, Part, Plan

PLAN_NAME = "_plan.json"
START_AGAIN = "pass --overwrite instead of --resume to start again"  # a plan that cannot be resumed
# The most a manifest, plan or part entry may hold. A manifest takes a few hundred bytes
# per source file and part: one larger is no archive's, and is refused before it is read.
MAX_RECORD_BYTES = 1 << 30
DEFAULT_PART_BYTES = 64 << 20
# A part holds at most this many blocks, however small: a part is the unit of progress,
# of parallel work and of a worker's per-block bookkeeping, so a source of a million
# tiny blocks is not one part that shows no progress, runs on one worker and holds a
# million rows' objects at once.
PART_BLOCKS = 4096
# A part's row groups hold, past their first block, at most 1 MiB of frames: reading one
# block alone (fp8ray.io.reader) reads its row group's frames. Each row group costs about
# a millisecond to write (ten column chunks): small blocks fill one to the byte bound.
ROW_GROUP_ROWS = 1024
ROW_GROUP_BYTES = 1 << 20
# The largest frame a part holds. Parquet records a value's length, and a page's (the
# value and its 4-byte length, compressed or not), in 32 signed bits, and pyarrow reads
# values up to 2**31 - 5 bytes (2**31 - 2 raised "Negative buffer resize"); 64 MiB is left
# for a lossless stage's growth of frames it cannot compress (random bytes of this size:
# lz4 8 MB, gzip 0.6 MB, snappy, zstd and brotli under 0.1 MB, each read back whole).
MAX_FRAME_BYTES = 2**31 - 2**26


def check_frame_fits(frame_bytes: int) -> None:
    """Refuse, naming the limit, a frame too large for a part (:data:`MAX_FRAME_BYTES`)."""
    if frame_bytes > MAX_FRAME_BYTES:
        raise BadInputError(
            f"its frame would be {frame_bytes} bytes, more than an archive's part holds in one "
            f"block ({MAX_FRAME_BYTES} bytes, Parquet's limit less a margin): split the tensor into "
            "smaller ones to compress it"
        )


MAX_BLOCK_SIZE = 2**31 - 1  # the parts' block_size column is an int32 (a frame's is a uint32)


def check_block_size_fits(codec: CodecOptions) -> None:
    """Refuse, naming the limit, a ``block_size`` a part's int32 column cannot record."""
    if codec.scaling == "block" and codec.block_size > MAX_BLOCK_SIZE:
        raise InvalidOptionError(
            f"block_size {codec.block_size}: an archive records it in 32-bit signed integers, at most {MAX_BLOCK_SIZE}",
            field="block_size",
        )


SCHEMA = pa.schema(
    [
        ("file", pa.string()),
        ("key", pa.string()),
        ("dtype", pa.string()),
        ("shape", pa.list_(pa.int64())),
        ("fp8", pa.string()),
        ("scaling", pa.string()),
        ("block_size", pa.int32()),
        ("raw_bytes", pa.int64()),
        ("frame_bytes", pa.int64()),
        ("frame", pa.large_binary()),
    ]
)
METADATA_COLUMNS = [name for name in SCHEMA.names if name != "frame"]
# What pyarrow's writer options name: a column's leaf ("shape.list.element"). A codec or
# dictionary given for "shape" itself applies to nothing (parts before 2026-12-06 hold
# its values plain).
METADATA_LEAVES = [f"{name}.list.element" if pa.types.is_list(SCHEMA.field(name).type) else name for name in METADATA_COLUMNS]

SIDECAR_PREFIX, SIDECAR_SUFFIX = "_part-", ".json"


def part_name(index: int) -> str:
    return f"{PART_PREFIX}{index:05d}{PART_SUFFIX}"


def sidecar_name(index: int) -> str:
    return f"{SIDECAR_PREFIX}{index:05d}{SIDECAR_SUFFIX}"


def is_scratch(name: str) -> bool:
    """Whether a name in an archive directory is a leftover of writing it: the plan, a
    sidecar, or the temporary file of a writer that was killed."""
    return name == PLAN_NAME or (name.startswith(SIDECAR_PREFIX) and name.endswith(SIDECAR_SUFFIX)) or is_temporary(name)


def is_archive_entry(name: str) -> bool:
    """Whether a name in an archive directory is one fp8ray writes there: the manifest, a
    part, or scratch (:func:`is_scratch`)."""
    index = name.removeprefix(PART_PREFIX).removesuffix(PART_SUFFIX)
    is_part = name == f"{PART_PREFIX}{index}{PART_SUFFIX}" and index.isascii() and index.isdigit()
    return name == MANIFEST_NAME or is_part or is_scratch(name)


def clean_scratch(fs: pafs.FileSystem, directory: str) -> None:
    """After the manifest: drop the plan, the sidecars and the temporaries of killed writers."""
    for entry in fs.get_file_info(pafs.FileSelector(directory)):
        if is_scratch(entry.base_name):
            fs.delete_file(entry.path)


def plan_parts(refs: list[BlockRef], part_bytes: int) -> list[list[BlockRef]]:
    """Consecutive blocks grouped into parts of about ``part_bytes`` of input (at least one
    block each, at most :data:`PART_BLOCKS`), following the source's files: a part holds
    whole files, or a slice of one file larger than ``part_bytes`` (or of more blocks
    than :data:`PART_BLOCKS`), so that decompress writes each file from as few parts as
    possible. Depends only on the source, so any number of workers writes the same parts."""
    file_bytes: dict[str, int] = {}
    for ref in refs:
        file_bytes[ref.file] = file_bytes.get(ref.file, 0) + ref.nbytes
    parts: list[list[BlockRef]] = []
    size = 0
    for i, ref in enumerate(refs):
        new_file = i == 0 or ref.file != refs[i - 1].file
        if not parts or len(parts[-1]) >= PART_BLOCKS:
            start = True
        elif new_file:
            start = size + file_bytes[ref.file] > part_bytes  # the whole file does not fit
        else:
            start = size >= part_bytes and parts[-1][0].file == ref.file  # a large file's next slice
        if start:
            parts.append([])
            size = 0
        parts[-1].append(ref)
        size += ref.nbytes
    return parts


def plan_record(source: str, codec: dict, lossless: str, parts: list[list[BlockRef]], files: tuple | None = None) -> Plan:
    """What ``_plan.json`` holds: a resumed run must find the same source, options and
    parts, and (``files``, :func:`source_stamps`) the source's files as they were. A local
    source is recorded absolute: a run resumed from another directory (a job runs in its
    own) must find it."""
    recorded = redact(source) if "://" in source else os.path.abspath(source)
    return Plan(recorded, codec, lossless, tuple(tuple(r.ident for r in part) for part in parts), files)


def source_stamps(source: str, layout: SourceLayout, gone_ok: bool = False) -> tuple[tuple[str, int, int | None], ...]:
    """Each source file's name, size and modification time (ns; None where the filesystem
    keeps none): what tells a resumed run, without reading the files, that one was rewritten.
    A file no longer there is refused, or (``gone_ok``) left out, for :func:`changed_file`
    to name as absent."""
    fs, root = resolve(source)
    names = [f.name for f in layout.files]
    paths = [f"{root.rstrip('/')}/{name}" if layout.container == "directory" else root for name in names]
    try:
        infos = fs.get_file_info(paths)
    except OSError as exc:
        raise SourceError(f"source {redact(source)} cannot be read: {os_reason(exc)}") from None
    for name, info in zip(names, infos):
        if info.type != pafs.FileType.File and not gone_ok:
            raise SourceError(f"source file {printable(name)} of {redact(source)} is no longer there")
    return tuple((name, info.size, info.mtime_ns) for name, info in zip(names, infos) if info.type == pafs.FileType.File)


def changed_file(recorded: tuple, now: tuple, since: str = "since the interrupted run read it") -> str | None:
    """How the first source file that differs from its record differs (``since``: when it
    was recorded, for the message), or None."""
    before, after = {f[0]: tuple(f[1:]) for f in recorded}, {f[0]: tuple(f[1:]) for f in now}
    for name in [*before, *(n for n in after if n not in before)]:
        was, is_ = before.get(name), after.get(name)
        if was != is_:
            return f"source file {printable(name)} changed {since} (was {_stamp(was)}; now {_stamp(is_)})"
    return None


def _stamp(stamp: tuple | None) -> str:
    return "absent" if stamp is None else f"{stamp[0]} bytes, modified at {stamp[1]} ns"


def read_plan(fs: pafs.FileSystem, directory: str) -> Plan | None:
    path = f"{directory}/{PLAN_NAME}"
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    try:
        return Plan.from_json(json.loads(_read_record(fs, path, path)), path)
    except CorruptArchiveError as exc:
        raise CorruptArchiveError(f"{exc}; {START_AGAIN}") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptArchiveError(f"{path}: unreadable plan ({exc}); {START_AGAIN}") from None


def write_plan(fs: pafs.FileSystem, directory: str, plan: Plan) -> None:
    write_atomic(fs, f"{directory}/{PLAN_NAME}", json.dumps(plan.to_json(), sort_keys=True).encode())


def file_crc32c(fs: pafs.FileSystem, path: str) -> tuple[int, int]:
    """CRC-32C and size of a whole file, read in 8 MiB pieces."""
    crc, size = 0, 0
    with fs.open_input_stream(path) as f:
        while chunk := f.read(8 << 20):
            crc = crc32c.crc32c(chunk, crc)
            size += len(chunk)
    return crc, size


def frame_column(frames: np.ndarray, sizes: list[int]) -> pa.LargeBinaryArray:
    """A ``large_binary`` column over frames laid end to end in one uint8 buffer, without
    copying them (the offsets are the running sums of ``sizes``)."""
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if offsets[-1] != frames.size:
        raise BadInputError(f"frame sizes add up to {offsets[-1]} bytes, the buffer holds {frames.size}")
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(sizes), [None, pa.py_buffer(offsets), pa.py_buffer(frames)])


def part_rows(refs: list[BlockRef], codec: CodecOptions, frame_sizes: list[int], frames) -> dict[str, list]:
    """The columns of a part holding ``refs`` encoded under ``codec`` (``frames``: a
    :func:`frame_column`, or a list of byte buffers). A block of a dtype fp8 does not
    encode is a stored frame: ``stored``, scaling ``none``, block size 0."""
    block_size = codec.block_size if codec.scaling == "block" else 0
    stored = [is_stored(r.dtype) for r in refs]
    return {
        "file": [r.file for r in refs],
        "key": [r.key for r in refs],
        "dtype": [r.dtype for r in refs],
        "shape": [list(r.shape) for r in refs],
        "fp8": ["stored" if s else codec.fp8 for s in stored],
        "scaling": ["none" if s else codec.scaling for s in stored],
        "block_size": [0 if s else block_size for s in stored],
        "raw_bytes": [r.nbytes for r in refs],
        "frame_bytes": list(frame_sizes),
        "frame": frames,
    }


def row_groups(frame_sizes: list[int]) -> list[int]:
    """How many rows each row group of a part takes, in order (:data:`ROW_GROUP_BYTES`)."""
    groups: list[int] = []
    rows = size = 0
    for frame_bytes in frame_sizes:
        if rows and (rows == ROW_GROUP_ROWS or size + frame_bytes > ROW_GROUP_BYTES):
            groups.append(rows)
            rows = size = 0
        rows += 1
        size += frame_bytes
    return groups + [rows] if rows else groups


def write_part(fs: pafs.FileSystem, directory: str, index: int, rows: dict[str, list], lossless: str = "none") -> Part:
    """Write one part (deterministic bytes for the same rows), rename it into place,
    then its sidecar; return its manifest entry.

    The part is built in memory (it is bounded by ``--part-mb``) so that its CRC-32C is
    taken on the way out rather than by reading the file back. ``rows["frame"]`` may be a
    list of byte buffers or a ready :func:`frame_column`. ``lossless`` compresses the
    frame column (:func:`parse_lossless`); Parquet records the codec in the part itself.
    """
    codec, level = parse_lossless(lossless)
    table = arrow_columns.table(rows, SCHEMA)
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(
        sink,
        SCHEMA,
        compression={"frame": codec, **dict.fromkeys(METADATA_LEAVES, "zstd")},
        compression_level={"frame": level} if level is not None else None,
        write_statistics=["key", "raw_bytes", "frame_bytes"],
        # Frames are unique: a dictionary would only hash them all before giving up.
        use_dictionary=METADATA_LEAVES,
    ) as writer:
        start = 0
        for rows_in_group in row_groups(rows["frame_bytes"]) or [0]:
            writer.write_table(table.slice(start, rows_in_group), row_group_size=max(rows_in_group, 1))
            start += rows_in_group
    data = sink.getvalue()
    try:
        write_atomic(fs, f"{directory}/{part_name(index)}", data)
    except OSError as exc:  # a full disk, above all
        raise WriteError(f"{part_name(index)}: {os_reason(exc)}") from None
    keys = rows["key"]
    info = Part(
        name=part_name(index),
        blocks=len(keys),
        raw_bytes=sum(rows["raw_bytes"]),
        frame_bytes=sum(rows["frame_bytes"]),
        file_bytes=data.size,
        crc32c=crc32c.crc32c(memoryview(data)),
        first_key=keys[0] if keys else None,
        last_key=keys[-1] if keys else None,
        footer_crc32c=part_checks.footer_crc32c(data),
        columns_crc32c=part_checks.columns_crc32c(table.select(METADATA_COLUMNS).to_pydict()),
        frames_crc32c=part_checks.frames_crc32c(table.column("frame")),
    )
    try:
        write_sidecar(fs, directory, index, info)
    except OSError as exc:  # the part goes too: without its sidecar --resume writes it again, beside it, needing its room twice
        delete_quietly(fs, f"{directory}/{part_name(index)}")
        raise WriteError(f"{sidecar_name(index)}: {os_reason(exc)}") from None
    return info


def write_sidecar(fs: pafs.FileSystem, directory: str, index: int, info: Part) -> None:
    write_atomic(fs, f"{directory}/{sidecar_name(index)}", json.dumps(info.to_json(), sort_keys=True).encode())


def read_sidecar(fs: pafs.FileSystem, directory: str, index: int) -> Part | None:
    """The sidecar of a finished part, if it and the part are there and agree in size."""
    path = f"{directory}/{sidecar_name(index)}"
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    try:
        info = Part.from_json(json.loads(_read_record(fs, path, path)), f"{path}: the part entry")
    except (ValueError, RecursionError, CorruptArchiveError):  # damaged, e.g. by a writer killed mid-way: redo the part
        return None
    if info.name != part_name(index):
        return None
    part = fs.get_file_info(f"{directory}/{info.name}")
    if part.type != pafs.FileType.File or part.size != info.file_bytes:
        return None
    return info


def resumable_part(fs: pafs.FileSystem, directory: str, index: int, blocks: int) -> Part | None:
    """The sidecar of a finished part ``--resume`` may keep: its part is there, of its size
    and its CRC-32C (a part damaged since, say by a crash after its rename, is written
    again, not taken into an archive ``verify`` would refuse), and holds the ``blocks``
    the plan gives it."""
    info = read_sidecar(fs, directory, index)
    if info is None or info.blocks != blocks:
        return None
    try:
        crc, _ = file_crc32c(fs, f"{directory}/{info.name}")
    except OSError:
        return None
    return info if crc == info.crc32c else None


def build_manifest(
    source: str,
    layout: SourceLayout,
    codec: dict,
    lossless: str,
    bound: dict,
    blocks: int,
    parts: list[Part],
    fp8ray_version: str,
    provenance: Provenance | None = None,
    stored_blocks: int = 0,
) -> Manifest:
    """The manifest of a finished archive: what it holds, the source's layout (to give it
    back), the codec's error bound (to verify against), each part's size and CRC-32C, and
    what the cache was made for (recorded only where a field of ``provenance`` is given).
    ``stored_blocks``: how many blocks are in stored frames (any makes it version 3)."""
    return Manifest(
        version=STORED_FRAMES_VERSION if stored_blocks else ARCHIVE_VERSION,
        fp8ray_version=fp8ray_version,
        codec=codec,
        lossless=lossless,
        error_bound=bound,
        layout=layout,
        source=redact(source),  # never the credentials a URI may carry
        blocks=blocks,
        raw_bytes=sum(p.raw_bytes for p in parts),
        frame_bytes=sum(p.frame_bytes for p in parts),
        archive_bytes=sum(p.file_bytes for p in parts),
        parts=tuple(parts),
        provenance=provenance if provenance is not None and provenance.recorded() else None,
        stored_blocks=stored_blocks,
    )


def write_manifest(fs: pafs.FileSystem, directory: str, manifest: Manifest) -> None:
    text = json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n"
    write_atomic(fs, f"{directory}/{MANIFEST_NAME}", text.encode())


def _shown(directory: str, uri: str | None) -> str:
    """The archive as messages name it: as the user gave it, where known."""
    return redact(uri) if uri is not None else directory


def _read_record(fs: pafs.FileSystem, path: str, shown: str) -> bytes:
    """The bytes of one of an archive's JSON records (manifest, plan, part entry), refused
    unread beyond :data:`MAX_RECORD_BYTES` (``shown``: its path for messages)."""
    size = fs.get_file_info(path).size
    if size is not None and size > MAX_RECORD_BYTES:
        raise CorruptArchiveError(f"{shown} is {size} bytes, more than an archive's record may hold ({MAX_RECORD_BYTES})")
    with fs.open_input_stream(path) as f:
        return f.read()


def read_manifest(fs: pafs.FileSystem, directory: str, uri: str | None = None) -> Manifest:
    """The checked manifest of the archive in ``directory`` (``uri``: the archive as the
    user gave it, for messages)."""
    shown = _shown(directory, uri)
    path = f"{shown.rstrip('/')}/{MANIFEST_NAME}"
    try:
        info = fs.get_file_info(directory)
        if info.type == pafs.FileType.NotFound:
            raise CorruptArchiveError(f"archive {shown} does not exist")
        if isinstance(fs, pafs.LocalFileSystem) and info.type != pafs.FileType.Directory:  # a source given as the archive, say
            raise CorruptArchiveError(f"archive {shown} is not a directory: not an fp8ray archive")
        if fs.get_file_info(f"{directory}/{MANIFEST_NAME}").type != pafs.FileType.File:
            raise CorruptArchiveError(f"{shown} has no {MANIFEST_NAME}: not a complete fp8ray archive")
        text = _read_record(fs, f"{directory}/{MANIFEST_NAME}", path)
    except OSError as exc:
        raise CorruptArchiveError(f"{path} cannot be read: {os_reason(exc)}") from None
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's stack
        raise CorruptArchiveError(f"{path}: unreadable manifest: {exc}") from None
    return Manifest.from_json(manifest, path)


def source_file_names(layout: SourceLayout | None, source_layout: SourceLayout) -> dict[str, str]:
    """Each file of a source by the name the archive gives it: a single file matches a
    single-file archive whatever its name (and a lone file of a directory); files of a
    directory match by their path in it; an archive from before the layout was recorded
    names no file (``""``)."""
    if layout is None:
        return dict.fromkeys((f.name for f in source_layout.files), "")
    if len(layout.files) == 1 and len(source_layout.files) == 1 and "file" in (layout.container, source_layout.container):
        return {source_layout.files[0].name: layout.files[0].name}
    return {f.name: f.name for f in source_layout.files}


def blocks_by_ident(
    layout: SourceLayout | None, source_layout: SourceLayout, refs: list[BlockRef], source: str
) -> dict[tuple[str, str], BlockRef]:
    """A source's blocks by ``(file, key)`` as an archive names them, to compare the two
    (:func:`source_file_names`)."""
    file_of = source_file_names(layout, source_layout)
    blocks: dict[tuple[str, str], BlockRef] = {}
    for r in refs:
        ident = (file_of[r.file], r.key)
        if ident in blocks:
            raise MismatchError(f"key {r.key!r} is in several files of {redact(source)}; the archive names blocks by key alone")
        blocks[ident] = r
    return blocks


def _missing(info: Part, shown: str) -> CorruptArchiveError:
    """A part the manifest lists that is not there at all: missing, not damaged."""
    return CorruptArchiveError(f"part {info.name} is missing from {shown} (the manifest records it, {info.file_bytes} bytes)")


def unlisted_entries(fs: pafs.FileSystem, directory: str, manifest: Manifest, uri: str | None = None) -> list[str]:
    """A message naming what the archive's directory holds beside the parts its manifest
    lists, as Parquet readers of the directory see it (they skip names starting with
    ``_`` or ``.``; the manifest and scratch are such): fp8ray reads the listed parts
    only, but ``pyarrow.parquet.read_table(ARCHIVE)`` and Ray Data read a stray part too
    (an older archive synced over this one without deleting), or fail on another file."""
    listed = {part.name for part in manifest.parts}
    try:
        found = fs.get_file_info(pafs.FileSelector(directory))
    except OSError as exc:
        return [f"archive {_shown(directory, uri)} cannot be listed: {os_reason(exc)}"]
    names = sorted(
        entry.base_name + ("/" if entry.type == pafs.FileType.Directory else "")
        for entry in found
        if not entry.base_name.startswith(("_", ".")) and entry.base_name not in listed
    )
    if not names:
        return []
    return [
        f"archive {_shown(directory, uri)} holds {entries(len(names))} its manifest does not list "
        f"({name_list(names)}): fp8ray reads only the listed parts, but Parquet readers of the "
        "directory (pyarrow, Ray Data) read those too, or fail on them; remove them"
    ]


def part_problems(fs: pafs.FileSystem, directory: str, manifest: Manifest, uri: str | None = None) -> list[str]:
    """Whether every part is there with the size its manifest entry records, without
    reading any: one message per part missing or of another size, and one naming what
    else the directory holds (:func:`unlisted_entries`)."""
    shown = _shown(directory, uri)
    problems = unlisted_entries(fs, directory, manifest, uri)
    for part in manifest.parts:
        try:
            info = fs.get_file_info(f"{directory}/{part.name}")
        except OSError as exc:
            problems.append(f"part {part.name} of {shown} cannot be read: {os_reason(exc)}")
            continue
        if info.type == pafs.FileType.NotFound:
            problems.append(str(_missing(part, shown)))
        elif info.type != pafs.FileType.File:
            problems.append(f"part {part.name} of {shown} is damaged: it is not a file")
        elif info.size != part.file_bytes:
            problems.append(f"part {part.name} of {shown} is damaged: {info.size} bytes, the manifest records {part.file_bytes}")
    return problems


def open_part(fs: pafs.FileSystem, path: str, info: Part, shown: str):
    """The part's file open for reading; raises :func:`_missing`'s error if it is gone,
    and refuses one that is not a regular file (a FIFO would block the open, and signals
    with it; a device, as ``/dev/zero``, never ends) (``shown``: the archive as messages name it)."""
    try:
        kind = fs.get_file_info(path).type
        if kind == pafs.FileType.NotFound:
            raise _missing(info, shown)
        if kind != pafs.FileType.File:
            raise CorruptArchiveError(f"part {info.name} of {shown} is not a regular file ({kind.name.lower()})")
        return fs.open_input_file(path)
    except OSError as exc:
        raise CorruptArchiveError(f"part {info.name} of {shown} cannot be read: {os_reason(exc)}") from None


def check_part(fs: pafs.FileSystem, directory: str, info: Part, uri: str | None = None) -> None:
    """Check a part's presence, size and CRC-32C against its manifest entry."""
    shown = _shown(directory, uri)
    path = f"{directory}/{info.name}"
    with open_part(fs, path, info, shown):
        pass
    try:
        crc, size = file_crc32c(fs, path)
    except OSError as exc:
        raise CorruptArchiveError(f"part {info.name} of {shown} cannot be read: {os_reason(exc)}") from None
    _check_crc(info, crc, size, shown)


def _check_crc(info: Part, crc: int, size: int, shown: str) -> None:
    if size != info.file_bytes or crc != info.crc32c:
        raise CorruptArchiveError(
            f"part {info.name} of {shown} is damaged: {size} bytes with crc32c {crc:#010x}, "
            f"the manifest records {info.file_bytes} bytes with crc32c {info.crc32c:#010x}"
        )


def read_part(
    fs: pafs.FileSystem, directory: str, info: Part, columns: list[str] | None = None, check: bool = True, uri: str | None = None
) -> pa.Table:
    """Read a part, checked against its manifest entry's size, CRC-32C and (read with its
    frames) ``frames_crc32c`` unless ``check`` is false (to read a damaged part anyway and name the blocks the damage lies in; its
    footer is still checked by its own CRC, where recorded, before it is parsed). A
    checked part is read once, into memory, and parsed from there. A part that is not
    there raises :class:`CorruptArchiveError` saying it is missing; one that is there
    but damaged, saying that (``uri``: the archive as the user gave it, for messages)."""
    shown = _shown(directory, uri)
    path = f"{directory}/{info.name}"
    with open_part(fs, path, info, shown) as f:
        try:
            if not check:  # the footer checked by its own CRC first, where recorded
                footer = part_checks.read_footer(f, info, shown)
                table = _parquet_table(f, columns, footer)
                part_checks.check_frame_bytes(table, footer, info, shown)
                return table
            data = f.read_buffer()
        except OSError as exc:
            if getattr(exc, "errno", None):
                raise CorruptArchiveError(f"part {info.name} of {shown} cannot be read: {os_reason(exc)}") from None
            raise _unreadable(info, shown, exc) from None
        except (pa.ArrowException, KeyError, IndexError) as exc:
            raise _unreadable(info, shown, exc) from None
    _check_crc(info, crc32c.crc32c(memoryview(data)), data.size, shown)
    try:
        table = _parquet_table(pa.BufferReader(data), columns)
    except (OSError, pa.ArrowException, KeyError, IndexError) as exc:
        raise _unreadable(info, shown, exc) from None
    part_checks.check_rows(table.num_rows, info, shown)  # an entry's count is not in the part's CRC
    part_checks.check_frames(table, info, shown)  # what the part's CRC cannot see: frames moved between rows
    return table


def _unreadable(info: Part, shown: str, exc: BaseException) -> CorruptArchiveError:
    return CorruptArchiveError(f"part {info.name} of {shown} is damaged: not readable as Parquet ({one_line(exc)})")


def _parquet_table(source, columns: list[str] | None, metadata: pq.FileMetaData | None = None) -> pa.Table:
    """The ``columns`` of a Parquet file (all where None), each one required; ``metadata``:
    its footer, already read. Read with
    ``pq.ParquetFile``: ``pq.read_table`` goes through ``pyarrow.dataset``, which imports
    pandas (0.14 s of a one-shot command's start, 0.2 s of every fresh worker's first
    part), and ``ParquetFile`` skips a column it lacks, so that is checked here."""
    parquet = pq.ParquetFile(source, metadata=metadata)
    if columns is not None and "frame" in columns and parquet.num_row_groups > 1:
        # A row group at a time: a whole read joins the groups' frames into one chunk, a
        # second copy of every frame (half the read's time for parts of small frames).
        table = pa.concat_tables([parquet.read_row_group(g, columns=columns) for g in range(parquet.num_row_groups)])
    else:
        table = parquet.read(columns=columns)
    missing = [name for name in columns or () if name not in table.column_names]
    if missing:
        raise pa.ArrowInvalid(f"no column {missing}")
    return table


def read_metadata_columns(
    fs: pafs.FileSystem, directory: str, manifest: Manifest, columns: list[str], uri: str | None = None, check: bool = False
) -> list[dict[str, list]]:
    """For each part, the given small metadata columns (never the frames) as lists, read
    without the part's CRC (its footer's is checked). ``check``: also check them against
    the part's ``columns_crc32c`` and row count where its entry records them (every
    metadata column is then read, the CRC being of them all), to name a damaged part as
    such; it costs about 1.5 us a block (the columns' canonical JSON). A version 1
    archive has no ``file`` column: its blocks read as from one file, ``""``."""
    wanted = [c for c in columns if c != "file" or manifest.version >= 2]
    shown = _shown(directory, uri)
    out = []
    for part in manifest.parts:
        read = METADATA_COLUMNS if check and part.columns_crc32c is not None else wanted
        table = read_part(fs, directory, part, columns=read, check=False, uri=uri)
        cols = {name: table.column(name).to_pylist() for name in read}
        if check:
            part_checks.check_rows(table.num_rows, part, shown)
            part_checks.check_columns(cols, part, shown)
        cols = {name: cols[name] for name in wanted}
        if "file" in columns and "file" not in cols:
            cols["file"] = [""] * table.num_rows
        out.append(cols)
    return out


def iter_frames(table: pa.Table) -> Iterator[memoryview]:
    """The frame column of a part as zero-copy memoryviews of Arrow's buffer."""
    return iter(PartFrames(table))


class PartFrames:
    """A part's frame column, read once: frame ``i`` as a zero-copy memoryview, and
    consecutive frames of one size as one ``[count, size]`` array over Arrow's buffer
    (:meth:`row_arrays`), so that a run of small blocks needs no Python object per frame. Holds
    the column's buffers (and nothing else of the table) alive."""

    def __init__(self, table: pa.Table):
        self._chunks = []  # (first row, data as uint8, offsets into it)
        first = 0
        for chunk in table.column("frame").chunks:
            self._chunks.append((first, *arrow_columns.binary_buffers(chunk)))
            first += len(chunk)
        self._starts = [c[0] for c in self._chunks]
        self.num_rows = first

    def _chunk(self, row: int) -> tuple[int, np.ndarray, np.ndarray]:
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} of a part of {self.num_rows} frames")
        return self._chunks[bisect_right(self._starts, row) - 1]

    def __getitem__(self, row: int) -> memoryview:
        first, data, offsets = self._chunk(row)
        i = row - first
        return memoryview(data[offsets[i] : offsets[i + 1]])

    def __iter__(self) -> Iterator[memoryview]:
        for _, data, offsets in self._chunks:
            view = memoryview(data)
            for i in range(len(offsets) - 1):
                yield view[offsets[i] : offsets[i + 1]]

    def row_arrays(self, row: int, count: int) -> list[np.ndarray] | None:
        """Frames ``row`` to ``row + count - 1`` as ``[n, size]`` uint8 views, one for each
        chunk (row group) they lie in, in order; None where a chunk's frames among them
        differ in size."""
        if count < 0 or row + count > self.num_rows:
            raise IndexError(f"rows {row} to {row + count - 1} of a part of {self.num_rows} frames")
        arrays = []
        while count:
            first, data, offsets = self._chunk(row)
            i = row - first
            n = min(count, len(offsets) - 1 - i)
            ends = offsets[i : i + n + 1]
            size = int(ends[1] - ends[0])
            if not (np.diff(ends) == size).all():
                return None
            arrays.append(data[ends[0] : ends[-1]].reshape(n, size))
            row, count = row + n, count - n
        return arrays
