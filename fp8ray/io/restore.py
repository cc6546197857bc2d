"""Giving a source back: which files ``decompress`` writes, from which parts, in tasks a
worker runs on its own.

An archive (version 2) records its source's layout; its parts hold the blocks in source
order, each row naming its file. A :class:`RestoreFile` is one output file with its
blocks in file order (part, row, key, dtype, shape); a :class:`RestoreTask` is a set of
files and the parts that hold their blocks, closed under sharing a part, so that every
file is written by exactly one worker and no two tasks write the same file. Parts follow
the source's files (:func:`fp8ray.io.archive.plan_parts`), so a task is usually one
part of whole files, or the parts of one large file (with the small files that share its
last part).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import CorruptArchiveError, DestinationError
from .blocks import RawBlockParquetWriter, SourceLayout, parquet_schema
from .paths import TMP_MARK, printable
from .records import Manifest
from .safetensors import SafetensorsWriter

SINGLE_FILE_METADATA_KEY = "fp8ray_archive"


@dataclass(frozen=True)
class RestoreFile:
    """One file ``decompress`` writes: its name (in the output directory), its kind, and
    its blocks in file order as ``(part, row, key, dtype, shape)``."""

    name: str
    kind: str  # "safetensors" | "parquet"
    blocks: tuple[tuple[int, int, str, str, tuple[int, ...]], ...]
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors __metadata__
    schema: str | None = None  # parquet: the source file's Arrow schema

    def writer(self, uri: str):
        """A streaming writer of this file at ``uri`` (temporary name, then rename)."""
        if self.kind == "parquet":
            return RawBlockParquetWriter(uri, parquet_schema(self.schema))
        return SafetensorsWriter(uri, [(key, dtype, shape) for _, _, key, dtype, shape in self.blocks], self.metadata)


@dataclass(frozen=True)
class RestoreTask:
    parts: tuple[int, ...]  # indices into the manifest's parts, in order
    files: tuple[RestoreFile, ...]

    @property
    def blocks(self) -> int:
        return sum(len(f.blocks) for f in self.files)


@dataclass(frozen=True)
class RestorePlan:
    """What ``decompress`` writes: a single file at the output, or a directory of files."""

    container: str  # "file" | "directory"
    tasks: tuple[RestoreTask, ...]

    @property
    def files(self) -> list[RestoreFile]:
        return [f for task in self.tasks for f in task.files]


def plan_restore(manifest: Manifest, columns: list[dict[str, list]], single_file_name: str | None = None) -> RestorePlan:
    """The files to write and the tasks that write them, from the manifest and each part's
    ``file``, ``key``, ``dtype``, ``shape`` columns. ``single_file_name``: every block into
    one safetensors file of that name (keys must then be unique); archives written before
    the layout was recorded restore that way too."""
    layout = manifest.layout
    rows = [
        (part, row, file, key, dtype, tuple(shape))
        for part, cols in enumerate(columns)
        for row, (file, key, dtype, shape) in enumerate(zip(cols["file"], cols["key"], cols["dtype"], cols["shape"]))
    ]
    if single_file_name is not None or layout is None:
        seen: dict[str, str] = {}
        for _, _, file, key, _, _ in rows:
            if key in seen:
                raise DestinationError(
                    f"key {printable(key)!r} is in both {printable(seen[key])} and {printable(file)}: one safetensors "
                    "file cannot hold both; decompress without --single-file to get the files back"
                )
            seen[key] = file
        metadata = {SINGLE_FILE_METADATA_KEY: json.dumps(manifest.codec)}
        name = single_file_name or "restored.safetensors"
        blocks = tuple((p, r, key, dtype, shape) for p, r, _, key, dtype, shape in rows)
        only = RestoreFile(name, "safetensors", blocks, metadata)
        return RestorePlan("file", (RestoreTask(tuple(range(len(columns))), (only,)),))
    files = _layout_files(layout, rows)
    return RestorePlan(layout.container, _group(files))


def _checked_name(name) -> str:
    """A file name from a manifest, refused unless it is a plain relative path (parts
    separated by ``/``, as a source tree's files are named): never one that would write
    outside the output directory, nor a hidden or scratch name."""
    parts = name.split("/") if isinstance(name, str) else []
    if (
        not parts
        or "\\" in name
        or "\0" in name
        or TMP_MARK in name
        or any(not part or part in (".", "..") or part.startswith(".") for part in parts)
    ):
        raise CorruptArchiveError(
            f"the archive names a source file {printable(str(name))!r}, which is not a plain relative file name"
        )
    return name


def _layout_files(layout: SourceLayout, rows: list) -> list[RestoreFile]:
    by_file: dict[str, list] = {_checked_name(f.name): [] for f in layout.files}
    for part, row, file, key, dtype, shape in rows:
        if file not in by_file:
            raise CorruptArchiveError(
                f"a block of part {part} names the file {printable(str(file))!r}, which the manifest does not list"
            )
        by_file[file].append((part, row, key, dtype, shape))
    out = []
    for f in layout.files:
        if len(by_file[f.name]) != f.blocks:
            raise CorruptArchiveError(
                f"the manifest records {f.blocks} blocks of {printable(f.name)}, the parts hold {len(by_file[f.name])}"
            )
        out.append(RestoreFile(f.name, layout.kind, tuple(by_file[f.name]), dict(f.metadata), f.schema))
    return out


def _group(files: list[RestoreFile]) -> tuple[RestoreTask, ...]:
    """Files that share a part go into one task, with every part they need (in order)."""
    tasks: list[tuple[set[int], list[RestoreFile]]] = []
    for f in files:  # in source order, so files sharing a part are neighbours
        parts = {p for p, *_ in f.blocks}
        if tasks and (not parts or tasks[-1][0] & parts):  # a file without blocks joins its neighbour
            tasks[-1][0].update(parts)
            tasks[-1][1].append(f)
        else:
            tasks.append((parts, [f]))
    return tuple(RestoreTask(tuple(sorted(parts)), tuple(fs)) for parts, fs in tasks)
