"""Giving a source back: which files ``decompress`` writes, from which parts, in tasks a
worker runs on its own.

An archive (version 2) records its source's layout; its parts hold the blocks in source
order, each row naming its file. A :class:`RestoreFile` is one output file with its
blocks in file order (part, row, key, dtype, shape). A :class:`RestoreTask` writes whole
files, streamed by one writer, and :class:`RestoreRange` s: the byte ranges of a shared
file that one part's blocks fill. Tasks are closed under sharing a part, so that each
task reads its parts and no two tasks write the same bytes.

On a local output (writable at offsets), a safetensors file whose blocks lie in more
than one part is shared: its header is known before any data, so the driver creates it
at its full size (:attr:`RestorePlan.shared`) and each part's task writes its blocks'
ranges, several workers at once, each holding one part at a time whatever the file's
size; a retried task writes the same bytes again. Elsewhere (object stores, which have
no writes at offsets) and for Parquet outputs, such a file is written by one task, in
order, from all its parts, each part dropped after its last block.
"""

from __future__ import annotations

import json
import operator
import os
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate, groupby

from ..codec.formats import tensor_nbytes
from ..codec.frame import RAW_BYTES_PER_FRAME_BYTE, is_block
from ..errors import CorruptArchiveError, DestinationError
from .blocks import RawBlockParquetWriter, SourceLayout, parquet_schema
from .part_checks import totals_problem
from .paths import printable
from .provenance import short_repr
from .records import Manifest, checked_file_name
from .safetensors import SafetensorsLayout, SafetensorsWriter, create_presized

SINGLE_FILE_METADATA_KEY = "fp8ray_archive"
RESTORE_COLUMNS = ["file", "key", "dtype", "shape", "frame_bytes"]  # what plan_restore reads of each part


@dataclass(frozen=True)
class RestoreFile:
    """One file ``decompress`` writes: its name (in the output directory), its kind, and
    its blocks in file order as ``(part, row, key, dtype, shape)``."""

    name: str
    kind: str  # "safetensors" | "parquet"
    blocks: tuple[tuple[int, int, str, str, tuple[int, ...]], ...]
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    schema: str | None = None  # parquet: the source file's Arrow schema
    source: str | None = None  # the source file its blocks are of (None: of several, --single-file)

    @property
    def tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(key, dtype, shape) for _, _, key, dtype, shape in self.blocks]

    def writer(self, uri: str):
        """A streaming writer of this file at ``uri`` (temporary name, then rename)."""
        if self.kind == "parquet":
            return RawBlockParquetWriter(uri, parquet_schema(self.schema))
        return SafetensorsWriter(uri, self.tensors, self.metadata)

    def create_presized(self, directory: str) -> None:
        """Create this (safetensors) file in the local ``directory``, its header written and
        its data a hole of its full size, for the tasks of its :class:`RestoreRange` s."""
        path = f"{directory}/{self.name}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        create_presized(path, SafetensorsLayout.of(self.tensors, self.metadata))


@dataclass(frozen=True)
class RestoreRange:
    """Consecutive blocks of a shared safetensors file, all from one part: the first
    one's bytes go at ``offset`` in the file (header included), the others end to end
    after it."""

    name: str  # the file's, in the output directory
    offset: int
    blocks: tuple[tuple[int, int, str, str, tuple[int, ...]], ...]
    source: str | None = None  # as its file's


@dataclass(frozen=True)
class RestoreTask:
    parts: tuple[int, ...]  # indices into the manifest's parts, in order
    files: tuple[RestoreFile, ...]  # written whole, by this task alone
    ranges: tuple[RestoreRange, ...] = ()  # of shared files, which the driver creates first

    @property
    def blocks(self) -> int:
        return sum(len(f.blocks) for f in (*self.files, *self.ranges))


@dataclass(frozen=True)
class RestorePlan:
    """What ``decompress`` writes: a single file at the output, or a directory of files."""

    container: str  # "file" | "directory"
    tasks: tuple[RestoreTask, ...]
    shared: tuple[RestoreFile, ...] = ()  # created by the driver, filled by several tasks' ranges

    @property
    def files(self) -> list[RestoreFile]:
        return [f for task in self.tasks for f in task.files] + list(self.shared)


def plan_restore(
    manifest: Manifest, columns: list[dict[str, list]], single_file_name: str | None = None, ranged: bool = False
) -> RestorePlan:
    """The files to write and the tasks that write them, from the manifest and each part's
    ``file``, ``key``, ``dtype``, ``shape`` columns. ``single_file_name``: every block into
    one safetensors file of that name (keys must then be unique); archives written before
    the layout was recorded restore that way too. ``ranged``: the output is written at
    offsets (a local filesystem), so a safetensors file from several parts is shared,
    one task per part (module docstring)."""
    layout = manifest.layout
    rows = _block_rows(manifest, columns)
    if single_file_name is not None or layout is None:
        seen: dict[str, str] = {}
        for _, _, file, key, _, _ in rows:
            if key in seen:
                raise DestinationError(
                    f"key {key!r} is in both {printable(seen[key])} and {printable(file)}: one safetensors "
                    "file cannot hold both; decompress without --single-file to get the files back"
                )
            seen[key] = file
        # The source files' __metadata__ where they all agree (all of it, from one file).
        kept = _common_items([dict(f.metadata) for f in layout.files]) if layout is not None else {}
        metadata = {**kept, SINGLE_FILE_METADATA_KEY: json.dumps(manifest.codec)}
        name = single_file_name or "restored.safetensors"
        blocks = tuple((p, r, key, dtype, shape) for p, r, _, key, dtype, shape in rows)
        container, files = "file", [RestoreFile(name, "safetensors", blocks, metadata)]
    else:
        container, files = layout.container, _layout_files(layout, rows, manifest)
    shared: list[RestoreFile] = []
    pieces: list[RestoreFile | RestoreRange] = []
    for f in files:
        if ranged and f.kind == "safetensors" and len({p for p, *_ in f.blocks}) > 1:
            shared.append(f)
            pieces += _ranges(f)
        else:
            pieces.append(f)
    return RestorePlan(container, _group(pieces), tuple(shared))


def _block_rows(manifest: Manifest, columns: list[dict[str, list]]) -> list[tuple]:
    """``(part, row, file, key, dtype, shape)`` of every block, each value checked to be
    one a block can have, and no block asking more bytes than its frame can give back (a
    frame holds at least a byte per element) nor a part more than its entry records: a
    part's columns hand-edited with its CRCs made again, or of a part written before they
    had a CRC, are not trusted to size the files written."""
    rows = []
    for part, cols in enumerate(columns):
        entry = manifest.parts[part]
        # By column, over the distinct values (a part of small blocks holds thousands of one shape).
        files, keys, dtypes, frame_bytes = cols["file"], cols["key"], cols["dtype"], cols["frame_bytes"]
        shapes = [tuple(s) if isinstance(s, list) else None for s in cols["shape"]]
        kinds = list(zip(dtypes, shapes))
        strings = set(map(type, files)) | set(map(type, keys)) <= {str}
        if not (strings and set(map(type, frame_bytes)) <= {int} and all(is_block(*kind) for kind in set(kinds))):
            row = next(r for r, values in enumerate(zip(files, keys, kinds, frame_bytes)) if not _sound(*values))
            raise CorruptArchiveError(f"part {entry.name}, row {row}: {_described(cols, row)}: not a block's")
        sizes = {kind: tensor_nbytes(kind[0], kind[1]) for kind in set(kinds)}
        raw = [sizes[kind] for kind in kinds]
        most = [RAW_BYTES_PER_FRAME_BYTE * f for f in frame_bytes]
        if any(map(operator.gt, raw, most)):
            over = next(r for r, (n, m) in enumerate(zip(raw, most)) if n > m)
            raise CorruptArchiveError(
                f"part {entry.name}, row {over}: {_described(cols, over)}: {raw[over]} bytes, more than a frame of "
                f"{cols['frame_bytes'][over]} bytes holds"
            )
        problem = totals_problem(sum(raw), sum(frame_bytes), entry)
        if problem:
            raise CorruptArchiveError(f"part {entry.name}: {problem}")
        rows += [(part, row, *values) for row, values in enumerate(zip(files, keys, dtypes, shapes))]
    return rows


def _described(cols: dict[str, list], row: int) -> str:
    """A row's values as a message shows them (each shortened: they may be anything)."""
    return ", ".join(f"{name} {short_repr(cols[name][row])}" for name in ("file", "key", "dtype", "shape", "frame_bytes"))


def _sound(file, key, kind: tuple, frame_bytes) -> bool:
    return isinstance(file, str) and isinstance(key, str) and is_block(*kind) and type(frame_bytes) is int


def _common_items(dicts: list[dict]) -> dict:
    """The items every one of ``dicts`` holds, with the same value."""
    if not dicts:
        return {}
    return {k: v for k, v in dicts[0].items() if all(d.get(k) == v for d in dicts[1:])}


def _layout_files(layout: SourceLayout, rows: list, manifest: Manifest) -> list[RestoreFile]:
    by_file: dict[str, list] = {checked_file_name(f.name): [] for f in layout.files}
    _check_names_apart([f.name for f in layout.files])
    for part, row, file, key, dtype, shape in rows:
        if file not in by_file:
            raise CorruptArchiveError(
                f"a block of part {manifest.parts[part].name} (row {row}) names the file {str(file)!r}, "
                "which the manifest does not list"
            )
        by_file[file].append((part, row, key, dtype, shape))
    out = []
    for f in layout.files:
        blocks = by_file[f.name]
        if len(blocks) != f.blocks:
            held = len(blocks)
            raise CorruptArchiveError(f"the manifest records {f.blocks} blocks of {printable(f.name)}, the parts hold {held}")
        if layout.kind == "safetensors" and len(set(map(operator.itemgetter(2), blocks))) != len(blocks):
            twice = next(key for key, n in Counter(block[2] for block in blocks).items() if n > 1)
            raise CorruptArchiveError(f"the parts hold block {twice!r} of {printable(f.name)} twice; safetensors keys are unique")
        out.append(RestoreFile(f.name, layout.kind, tuple(blocks), dict(f.metadata), f.schema, f.name))
    return out


def _check_names_apart(names: list[str]) -> None:
    """Refuse a layout naming a file twice, or a file that is another's folder
    (``a.safetensors`` and ``a.safetensors/b.safetensors``): no tree holds both."""
    files = Counter(names)
    if len(files) != len(names):
        twice = next(name for name, n in files.items() if n > 1)
        raise CorruptArchiveError(f"the manifest lists the file {printable(twice)} twice")
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in files:
                raise CorruptArchiveError(
                    f"the manifest lists {printable(folder)} as a file and as the folder of {printable(name)}"
                )


def _ranges(f: RestoreFile) -> list[RestoreRange]:
    """A shared file's blocks, one range per part, each at its offset in the file."""
    layout = SafetensorsLayout.of(f.tensors, f.metadata)
    starts = list(accumulate(layout.sizes, initial=len(layout.prefix)))
    out, first = [], 0
    for _, blocks in groupby(f.blocks, key=lambda block: block[0]):
        blocks = tuple(blocks)
        out.append(RestoreRange(f.name, starts[first], blocks, f.source))
        first += len(blocks)
    return out


def _group(pieces: list[RestoreFile | RestoreRange]) -> tuple[RestoreTask, ...]:
    """Files and ranges that share a part go into one task, with every part they need (in order)."""
    tasks: list[tuple[set[int], list[RestoreFile | RestoreRange]]] = []
    for piece in pieces:  # in source order, so pieces sharing a part are neighbours
        parts = {p for p, *_ in piece.blocks}
        if tasks and (not parts or tasks[-1][0] & parts):  # a file without blocks joins its neighbour
            tasks[-1][0].update(parts)
            tasks[-1][1].append(piece)
        else:
            tasks.append((parts, [piece]))
    return tuple(
        RestoreTask(
            tuple(sorted(parts)),
            tuple(p for p in group if isinstance(p, RestoreFile)),
            tuple(p for p in group if isinstance(p, RestoreRange)),
        )
        for parts, group in tasks
    )
