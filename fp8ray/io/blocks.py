"""Block sources: where KV blocks come from, listed once and read in shards.

A source is listed once, on the driver, into :class:`BlockRef` records (metadata only:
key, dtype, shape, where the bytes lie); a worker then reads just the blocks of its
shard. Paths are local or any URI ``pyarrow.fs`` knows (``s3://...``), so that on
shared storage the driver moves only metadata.

Sources: a ``.safetensors`` file, a directory tree of them (files in subfolders too,
named by their path relative to the source; what else the tree holds is named, not
dropped), or a raw-block Parquet file (columns ``key``, ``dtype``, ``shape``, ``data``,
nothing else) or a directory tree of those.
Keys need be unique only within a file, as in safetensors itself: a block is named by
its file (relative to the source) and its key. :func:`scan_source` also returns the
:class:`SourceLayout`, what ``decompress`` needs to give the source back (file names,
each safetensors file's ``__metadata__``, each Parquet file's schema). Nothing here
unpickles anything: the safetensors header is JSON, the data raw little-endian bytes,
a Parquet schema Arrow's own IPC bytes.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..codec.blocks import BlockSpec, bytes_to_tensor, dtype_name, tensor_to_bytes  # noqa: F401 (used by this layer's callers)
from ..codec.formats import DTYPE_ITEMSIZES
from ..errors import MismatchError, SourceError
from . import columns as arrow_columns
from .paths import (
    CompleteOrNothing,
    TreeEntry,
    delete_quietly,
    list_tree,
    name_list,
    os_reason,
    printable,
    redact,
    resolve,
    temporary_name,
    uri_for,
)
from .safetensors import SOURCE_DTYPES, read_file_header

RAW_COLUMNS = ("key", "dtype", "shape", "data")


@dataclass(frozen=True)
class BlockRef(BlockSpec):
    """Where one block's raw bytes lie (its key, dtype and shape are the :class:`BlockSpec`'s).
    ``path`` is the file's local path or URI, ``file`` its name relative to the source;
    ``offset`` is a byte offset into a safetensors file, or a row index into a Parquet file."""

    kind: str  # "safetensors" | "parquet" | "lmcache" (a store's chunk file: fp8ray.io.store_source)
    path: str
    offset: int
    file: str = ""

    @property
    def ident(self) -> tuple[str, str]:
        """What names the block within its source: its file and its key."""
        return self.file, self.key

    @property
    def of_file(self) -> str:
        """Its file, as an error names the block after its key (``" of req2.safetensors"``:
        keys repeat from file to file); empty for a source of one file."""
        return f" of {printable(self.file)}" if self.file else ""


@dataclass(frozen=True)
class SourceFile:
    """One file of a source, as ``decompress`` writes it back."""

    name: str  # relative to the source directory, or the file's own name
    blocks: int
    metadata: dict[str, str] = field(default_factory=dict)  # a safetensors file's __metadata__
    schema: str | None = None  # a Parquet file's Arrow schema (IPC bytes, base64)


@dataclass(frozen=True)
class SkippedEntry:
    """Something under a source directory that compress does not take, and why."""

    name: str  # relative to the source, "/" between parts; a folder's ends in "/"
    reason: str


@dataclass(frozen=True)
class SourceLayout:
    """The shape of a source: a single file or a directory tree of files, of one kind,
    and what the tree holds besides them (``skipped``: named, never left out silently)."""

    kind: str  # "safetensors" | "parquet"
    container: str  # "file" | "directory"
    files: tuple[SourceFile, ...]
    skipped: tuple[SkippedEntry, ...] = ()

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "container": self.container,
            "files": [asdict(f) for f in self.files],
            "skipped": [asdict(s) for s in self.skipped],
        }

    @classmethod
    def from_dict(cls, d: dict) -> SourceLayout:
        """Read back; a manifest written before ``skipped`` was recorded has none."""
        skipped = tuple(SkippedEntry(**s) for s in d.get("skipped") or ())
        return cls(d["kind"], d["container"], tuple(SourceFile(**f) for f in d["files"]), skipped)


def list_blocks(uri: str) -> list[BlockRef]:
    """Every block of a source, in a deterministic order (files sorted, then file order)."""
    return scan_source(uri)[1]


SUFFIXES = {".safetensors": "safetensors", ".parquet": "parquet"}
# Why a tree entry that is not a file compress could take is left, by its kind (paths.list_tree).
_NOT_TAKEN = {
    "folder link": "symbolic link to a folder, not followed",
    "broken link": "broken symbolic link",
    "empty folder": "empty folder",
    "hidden folder": "hidden folder",
    "special": "not a regular file",
    "not utf-8": "a name that is not UTF-8, which an archive cannot record",
}
NOT_UTF8_REASON = _NOT_TAKEN["not utf-8"]


# A name decompress does not write (a path separator elsewhere; docs/FORMAT.md), so not archived.
BACKSLASH = "\\"
# The file that makes a directory an fp8ray archive (fp8ray.io.archive writes it last). A
# source holding one is an archive, not blocks: its parts read as a raw-block Parquet
# source missing its 'data' column, which named no archive.
MANIFEST_NAME = "_manifest.json"
BACKSLASH_REASON = "a backslash in its name, which decompress does not write"


def select_files(entries: list[TreeEntry], uri: str) -> tuple[str, list[str], list[SkippedEntry]]:
    """From everything under a source directory: its kind, the files compress takes (every
    ``.safetensors``, or every ``.parquet``, file in any folder, by relative name, sorted;
    a symbolic link to a file counts as the file), and every other entry with why it is
    left (hidden names, other files, links to folders, empty folders). Refuses a tree
    holding both kinds, or neither."""
    candidates: dict[str, list[str]] = {"safetensors": [], "parquet": []}
    skipped: list[SkippedEntry] = []
    others: list[str] = []
    for e in entries:
        if e.kind in _NOT_TAKEN:
            skipped.append(SkippedEntry(e.name, _NOT_TAKEN[e.kind]))
        elif any(part.startswith(".") for part in e.name.split("/")):
            skipped.append(SkippedEntry(e.name, "hidden file"))
        elif BACKSLASH in e.name:
            skipped.append(SkippedEntry(e.name, BACKSLASH_REASON))
        elif os.path.splitext(e.name)[1] in SUFFIXES:
            candidates[SUFFIXES[os.path.splitext(e.name)[1]]].append(e.name)
        else:
            others.append(e.name)
    st, pq_files = candidates["safetensors"], candidates["parquet"]
    if st and pq_files:
        raise SourceError(
            f"source {redact(uri)} mixes .safetensors files ({printable(st[0])}, ...) and .parquet files "
            f"({printable(pq_files[0])}, ...): compress one kind at a time"
        )
    if not st and not pq_files:
        # What was left may be the files meant (a name not UTF-8, a hidden one): said with why.
        left = [f"{s.name} ({s.reason})" for s in skipped if os.path.splitext(s.name.rstrip("/"))[1] in SUFFIXES]
        raise SourceError(
            f"source {redact(uri)} holds no .safetensors or .parquet files, in any folder"
            + (f"; skipped {name_list(left)}" if left else "")
        )
    kind, files = ("safetensors", st) if st else ("parquet", pq_files)
    skipped += [SkippedEntry(name, f"not a .{kind} file") for name in others]
    return kind, files, sorted(skipped, key=lambda s: s.name)


def scan_source(uri: str) -> tuple[SourceLayout, list[BlockRef]]:
    """The layout of a source and every block of it, in a deterministic order (files
    sorted by relative name, then each file's own order). A directory is read as a tree:
    files in every folder, named by their path relative to it; what it holds besides is
    listed in the layout's ``skipped``. A key may repeat across files, not within one."""
    fs, path = resolve(uri)
    try:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            entries = list_tree(fs, path)
    except OSError as exc:
        failed = exc.filename if isinstance(exc.filename, str) else ""
        inside = f" ({printable(os.path.relpath(failed, path))})" if failed.startswith(path.rstrip("/") + "/") else ""
        raise SourceError(f"source {redact(uri)} cannot be read{inside}: {os_reason(exc)}") from None  # which folder
    skipped: list[SkippedEntry] = []
    if info.type == pafs.FileType.NotFound:
        raise SourceError(f"source {redact(uri)} does not exist")
    if info.type == pafs.FileType.Directory:
        if any(entry.name == MANIFEST_NAME for entry in entries):
            raise SourceError(
                f"source {redact(uri)} is an fp8ray archive, not blocks to compress or compare: give its source, "
                "or decompress it first (fp8ray decompress)"
            )
        container = "directory"
        kind, names, skipped = select_files(entries, uri)
        files = [(f"{path.rstrip('/')}/{name}", name) for name in names]
    elif info.type != pafs.FileType.File:  # a FIFO would block its reader for ever
        raise SourceError(f"source {redact(uri)} is not a regular file (a FIFO, socket or device): give a file or a directory")
    elif path.endswith((".safetensors", ".parquet")):
        if BACKSLASH in os.path.basename(path):
            raise SourceError(f"source {redact(uri)}: {BACKSLASH_REASON}; rename it")
        container, files = "file", [(path, os.path.basename(path))]
        kind = "safetensors" if path.endswith(".safetensors") else "parquet"
    else:
        raise SourceError(f"source {redact(uri)}: unknown format (expected .safetensors, .parquet or a directory of them)")
    read = _safetensors_blocks if kind == "safetensors" else _parquet_blocks
    layout_files, refs = [], []
    for f, name in files:
        source_file, file_refs = read(fs, f, uri_for(uri, f), name)
        layout_files.append(source_file)
        refs += file_refs
    return SourceLayout(kind, container, tuple(layout_files), tuple(skipped)), refs


def _check_unique(refs: list[BlockRef], uri: str) -> None:
    seen: set[str] = set()
    for r in refs:
        if r.key in seen:
            raise SourceError(f"{redact(uri)}: key {r.key!r} appears twice in the file")
        seen.add(r.key)


def _safetensors_blocks(fs: pafs.FileSystem, path: str, uri: str, name: str) -> tuple[SourceFile, list[BlockRef]]:
    tensors, metadata, data_start = read_file_header(fs, path, uri, tuple(SOURCE_DTYPES))
    refs = [
        BlockRef(key, SOURCE_DTYPES[dtype], shape, "safetensors", uri, data_start + begin, name)
        for key, dtype, shape, begin in zip(tensors.keys, tensors.dtypes, tensors.shapes, tensors.begins)  # file order
    ]
    return SourceFile(name, len(refs), metadata), refs


def _parquet_blocks(fs: pafs.FileSystem, path: str, uri: str, name: str) -> tuple[SourceFile, list[BlockRef]]:
    # One open file for the schema, the small columns and the data's nulls. Not
    # pq.read_table: it goes through pyarrow.dataset, which imports pandas, and names a
    # missing column in a many-line message of its own.
    try:
        with fs.open_input_file(path) as f:
            parquet = pq.ParquetFile(f)
            schema = parquet.schema_arrow
            problem = raw_schema_problem(schema)
            if problem:
                raise SourceError(f"{redact(uri)}: {problem}")
            table = parquet.read(columns=["key", "dtype", "shape"])
            columns = _checked_columns(parquet, uri, table)
    except OSError as exc:
        if getattr(exc, "errno", None):
            raise SourceError(f"{redact(uri)} cannot be read: {os_reason(exc)}") from None
        raise SourceError(f"{redact(uri)}: not a readable Parquet file: {exc}") from None
    except pa.ArrowException as exc:
        raise SourceError(f"{redact(uri)}: not a readable Parquet file: {exc}") from None
    refs = [
        BlockRef(str(key), dtype, tuple(shape), "parquet", uri, row, name)
        for row, (key, dtype, shape) in enumerate(zip(*(columns[c].to_pylist() for c in ("key", "dtype", "shape"))))
    ]
    _check_unique(refs, uri)
    # The schema as the file has it, its metadata too: decompress writes it back.
    return SourceFile(name, len(refs), schema=base64.b64encode(schema.serialize().to_pybytes()).decode()), refs


def raw_schema_problem(schema: pa.Schema) -> str | None:
    """What keeps ``schema`` from being a raw-block Parquet source's (the columns
    :data:`RAW_COLUMNS`, no others, of their types), or None. A source is checked
    against it as it is scanned, and the schema an archive records as it is read back."""
    missing = [c for c in RAW_COLUMNS if c not in schema.names]
    if missing:
        return f"a raw-block Parquet source needs columns {list(RAW_COLUMNS)}; missing {missing}"
    extra = [c for c in schema.names if c not in RAW_COLUMNS]
    if extra:  # they would not be archived, so not given back: refuse rather than lose them
        return f"columns {extra} are not archived; a raw-block source holds only {list(RAW_COLUMNS)}"
    types = {c: schema.field(c).type for c in RAW_COLUMNS}
    plain = {c: t.value_type if pa.types.is_dictionary(t) else t for c, t in types.items()}  # repeated strings
    expected = {
        "key": (_is_text(plain["key"]) or pa.types.is_integer(plain["key"]), "a string or an integer"),
        "dtype": (_is_text(plain["dtype"]), "a string"),
        "shape": (_is_int_list(plain["shape"]), "a list of integers"),
        "data": (_is_bytes(types["data"]), "binary"),
    }
    for name, (ok, wanted) in expected.items():
        if not ok:
            return f"column {name!r} is {types[name]}; expected {wanted}"
    return None


def _checked_columns(parquet: pq.ParquetFile, uri: str, table: pa.Table) -> dict:
    """The ``key``, ``dtype`` and ``shape`` columns (dictionaries decoded; their types
    checked by :func:`raw_schema_problem`), each checked at once for nulls and values, and
    ``data``'s nulls (from the row groups' statistics, so that the driver does not read
    the data): a bad row is refused naming the file, the column, the row (counted from 0)
    and its key, before anything is written."""
    columns = {}
    for name in ("key", "dtype", "shape"):
        column = table.column(name)
        if pa.types.is_dictionary(column.type):  # how pandas and Arrow write repeated strings
            column = column.cast(column.type.value_type)
        columns[name] = column
    keys = columns["key"]

    def refuse(row: int, what: str) -> None:
        key = keys[row].as_py()
        named = f" (key {str(key)!r})" if key is not None else ""
        raise SourceError(f"{redact(uri)}: row {row}{named}: {what}")

    expected_text = {"key": "a string", "dtype": f"one of {sorted(DTYPE_ITEMSIZES)}", "shape": "a list of integers"}
    for name, column in columns.items():
        if column.null_count:
            refuse(_first(pc.is_null(column)), f"column {name!r} is null; expected {expected_text[name]}")
    known = pc.is_in(columns["dtype"], value_set=pa.array(sorted(DTYPE_ITEMSIZES)))
    if not pc.all(known, min_count=0).as_py():
        row = _first(pc.invert(known))
        refuse(row, f"column 'dtype' is {columns['dtype'][row].as_py()!r}; expected one of {sorted(DTYPE_ITEMSIZES)}")
    shapes = columns["shape"]
    dims = pc.list_flatten(shapes)
    if dims.null_count or (len(dims) and pc.min(dims).as_py() < 0):
        bad = pc.or_kleene(pc.is_null(dims), pc.less(dims, 0))
        row = pc.list_parent_indices(shapes)[_first(pc.fill_null(bad, True))].as_py()
        refuse(row, f"column 'shape' is {shapes[row].as_py()}; expected a list of non-negative integers")
    row = _first_null_data(parquet)
    if row is not None:
        refuse(row, "column 'data' is null; expected the block's bytes")
    return columns


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_bytes(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)


def _is_int_list(t: pa.DataType) -> bool:
    lists = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return lists and pa.types.is_integer(t.value_type)


def _first(mask) -> int:
    """The index of the first true value of a boolean Arrow array (one is known to be)."""
    return pc.index(mask, True).as_py()


def _first_null_data(parquet: pq.ParquetFile) -> int | None:
    """The first row whose ``data`` is null, or None. Read from the row groups' statistics:
    only a group that holds a null (or has no statistics) has its data read."""
    metadata = parquet.metadata
    column = [metadata.schema.column(i).path for i in range(metadata.num_columns)].index("data")
    start = 0
    for g in range(parquet.num_row_groups):
        group = metadata.row_group(g)
        stats = group.column(column).statistics
        if stats is None or not stats.has_null_count or stats.null_count:
            data = parquet.read_row_group(g, columns=["data"]).column("data")
            if data.null_count:
                return start + _first(pc.is_null(data))
        start += group.num_rows
    return None


def parquet_schema(encoded: str) -> pa.Schema:
    """The Arrow schema a :class:`SourceFile` records (IPC bytes: no pickling)."""
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(encoded)))


def read_blocks(refs: list[BlockRef]) -> list[np.ndarray]:
    """The raw bytes of each block, as uint8 arrays of their own, checked against the
    declared size."""
    return [view.copy() if view.base is not None else view for view in BlockReader().read(refs)]


class BlockReader:
    """Reads blocks into one buffer it keeps and reuses: pages freshly mapped for every
    read cost more than the read itself. Neighbouring blocks of a safetensors file (a
    part's blocks are) are read with one call. The arrays :meth:`read` returns are views
    of that buffer, valid until its next call. ``allocate(nbytes)`` makes the buffer (a
    GPU worker's is pinned memory, :func:`fp8ray.codec.devices.host_buffer`)."""

    def __init__(self, allocate: Callable[[int], np.ndarray] = lambda nbytes: np.empty(nbytes, np.uint8)):
        self._allocate = allocate
        self._buffer = allocate(0)
        self._path = ""
        # After a read: every block's bytes end to end in the order asked for, one view of
        # the buffer, where the read laid them so (blocks of safetensors files in file
        # order, as a part's are); else None.
        self.joined: np.ndarray | None = None

    def read(self, refs: list[BlockRef]) -> list[np.ndarray]:
        self.joined = None
        try:
            return self._read(refs)
        except OSError as exc:
            raise SourceError(f"source file {redact(self._path)} cannot be read: {os_reason(exc)}") from None

    def _read(self, refs: list[BlockRef]) -> list[np.ndarray]:
        sizes = [r.nbytes for r in refs]  # looked up once: thousands of small blocks make a part
        total = sum(size for r, size in zip(refs, sizes) if r.kind == "safetensors")
        if self._buffer.size < total:
            self._buffer = self._allocate(total)
        result: list[np.ndarray | None] = [None] * len(refs)
        position = 0
        in_order = total == sum(sizes)  # so far, each run read was the next blocks asked for
        following = 0
        for path, indices in _by_file(refs).items():
            self._path = path  # for the message, should it fail
            fs, fpath = resolve(path)
            if refs[indices[0]].kind != "safetensors":
                for i, value in zip(indices, _parquet_rows(fs, fpath, [refs[i].offset for i in indices])):
                    if value is None:  # checked by the scan: the file changed since
                        ref = refs[i]
                        raise SourceError(f"{redact(path)}: row {ref.offset} (key {ref.key!r}): column 'data' is null")
                    result[i] = _checked(refs[i], np.frombuffer(value, dtype=np.uint8), path)
                continue
            with fs.open_input_file(fpath) as f:
                for run in _contiguous(refs, sizes, indices):
                    begin = refs[run[0]].offset
                    span = refs[run[-1]].offset + sizes[run[-1]] - begin
                    target = self._buffer[position : position + span]
                    f.seek(begin)
                    got = _read_fully(f, memoryview(target))
                    for i in run:
                        start = refs[i].offset - begin
                        result[i] = target[start : start + sizes[i]]
                    if got < span:  # the file ends early: name the first block cut short
                        for i in run:
                            _checked(refs[i], target[refs[i].offset - begin : min(refs[i].offset - begin + sizes[i], got)], path)
                    position += span
                    in_order = in_order and run[0] == following and run[-1] - run[0] == len(run) - 1
                    following = run[-1] + 1
        if in_order:
            self.joined = self._buffer[:total]
        return result  # type: ignore[return-value]


def _by_file(refs: list[BlockRef]) -> dict[str, list[int]]:
    by_file: dict[str, list[int]] = {}
    for i, r in enumerate(refs):
        by_file.setdefault(r.path, []).append(i)
    return by_file


def _contiguous(refs: list[BlockRef], sizes: list[int], indices: list[int]) -> list[list[int]]:
    """``indices`` in runs whose blocks (of ``sizes`` bytes) lie end to end in the file."""
    runs: list[list[int]] = []
    end = None
    for i in indices:
        if runs and end == refs[i].offset:
            runs[-1].append(i)
        else:
            runs.append([i])
        end = refs[i].offset + sizes[i]
    return runs


def _read_fully(f, target: memoryview) -> int:
    got = 0
    while got < len(target):
        n = f.readinto(target[got:])
        if not n:
            break
        got += n
    return got


def _checked(ref: BlockRef, data: np.ndarray, path: str) -> np.ndarray:
    if data.size != ref.nbytes:
        raise SourceError(
            f"{redact(path)}: key {ref.key!r} has {data.size} bytes, "
            f"its shape {list(ref.shape)} {ref.dtype} needs {ref.nbytes}" + (" (truncated?)" if data.size < ref.nbytes else "")
        )
    return data


def _parquet_rows(fs: pafs.FileSystem, path: str, rows: list[int]) -> list[bytes]:
    """The ``data`` values of the given rows, reading only the row groups that hold them
    (a shard must not read the whole file)."""
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
        starts = np.cumsum([0, *sizes])
        row_groups = np.searchsorted(starts, rows, side="right") - 1
        groups = sorted(set(row_groups.tolist()))
        table = pf.read_row_groups(groups, columns=["data"])
    # Where each needed group begins in the table just read.
    begins = dict(zip(groups, np.cumsum([0, *(sizes[g] for g in groups)])))
    picks = [int(begins[g] + row - starts[g]) for row, g in zip(rows, row_groups.tolist())]
    return table.column("data").take(picks).to_pylist()


class RawBlockParquetWriter(CompleteOrNothing):
    """Write blocks as a raw-block Parquet file (``key``, ``dtype``, ``shape``, ``data``)
    with the given Arrow schema, streamed in row groups; written to a temporary name and
    renamed when complete. Use as a context manager."""

    # A row group ends at whichever comes first: blocks of megabytes are not all held,
    # tiny ones are not written 64 to a group (a million rows made a 1.4 MB footer).
    GROUP_ROWS = 65536
    GROUP_BYTES = 16 << 20

    def __init__(self, uri: str, schema: pa.Schema):
        self.fs, self.path = resolve(uri)
        self.schema = schema
        self.tmp = temporary_name(self.path)
        try:
            self.stream = self.fs.open_output_stream(self.tmp)
            self.writer = pq.ParquetWriter(self.stream, schema)
        except BaseException:  # before the caller holds the writer to abort it
            delete_quietly(self.fs, self.tmp)
            raise
        self.rows: dict[str, list] = {name: [] for name in RAW_COLUMNS}
        self.held = 0  # bytes of data in rows

    def write_block(self, key: str, dtype: str, shape: tuple[int, ...], data) -> None:
        raw = bytes(memoryview(data).cast("B"))
        for name, value in zip(RAW_COLUMNS, (key, dtype, list(shape), raw)):
            self.rows[name].append(value)
        self.held += len(raw)
        if len(self.rows["key"]) >= self.GROUP_ROWS or self.held >= self.GROUP_BYTES:
            self._flush()

    def write_blocks(self, tensors: list[tuple[str, str, tuple[int, ...]]], data) -> None:
        """:meth:`write_block` of each of ``tensors`` (``(key, dtype, shape)``), their
        bytes end to end in ``data`` (as :meth:`SafetensorsWriter.write_blocks`)."""
        view = memoryview(data).cast("B")
        ends = np.cumsum([BlockSpec(*t).nbytes for t in tensors]).tolist()
        if (ends[-1] if ends else 0) != len(view):
            raise MismatchError(f"{len(tensors)} tensors take {ends[-1] if ends else 0} bytes, got {len(view)}")
        for (key, dtype, shape), start, end in zip(tensors, [0, *ends], ends):
            self.write_block(key, dtype, shape, view[start:end])

    def _flush(self) -> None:
        if self.rows["key"]:
            self.writer.write_table(arrow_columns.table(self.rows, self.schema))
            self.rows = {name: [] for name in RAW_COLUMNS}
            self.held = 0

    def close(self) -> None:
        self._flush()
        self.writer.close()
        self.stream.close()
        self.fs.move(self.tmp, self.path)

    def abort(self) -> None:
        self.writer.close()
        self.stream.close()
        self.fs.delete_file(self.tmp)
