"""Reading single blocks out of an archive, as ``safetensors.safe_open`` reads one tensor.

:func:`open_archive` reads the manifest; a block's part is found by its key among the
keys of the parts that hold its file (the layout says which rows are whose: parts hold
the blocks in source order), each part's Parquet footer read once and kept. Where each
row group of a part holds one block (large blocks), the keys are the footer's
statistics of the ``key`` column; otherwise that column is read.
:meth:`ArchiveReader.get` then reads the ``frame`` column of the one row group holding
the block, and decodes it, checked by the frame's own CRC-32C (the part's CRC
covers the whole file: it is checked by ``verify`` and ``decompress``, not here).
What is read instead is checked (:mod:`fp8ray.io.part_checks`): the footer by its own
CRC-32C before pyarrow parses it, the metadata columns by theirs where read, the row's
key against the key asked for, the frame's dtype and shape against its row's, and each
part's size, block count, first and last key and no block twice. Parts written before
the footer and column CRCs (docs/FORMAT.md, "Manifest") lack those two checks: a
damaged byte in such a part's key column can move a block under another key the other
checks miss, and one in its footer can abort pyarrow. Parts
written since row groups were bounded in bytes (:data:`fp8ray.io.archive.ROW_GROUP_BYTES`)
give a large block a row group of its own; older parts are read a row group (up to 64
blocks) at a time, as are small blocks (up to 1 MiB of them).
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..codec import decode
from ..codec.blocks import Block
from ..codec.formats import tensor_nbytes
from ..codec.fp8codec import decode_raw
from ..codec.frame import as_byte_array, is_block, parse_layout
from ..errors import BadInputError, CorruptArchiveError, InvalidOptionError
from . import archive, part_checks
from .paths import as_uri, one_line, printable, redact, resolve
from .provenance import Provenance, check_provenance
from .records import Manifest, Part


def open_archive(
    uri: str | os.PathLike, *, filesystem: pafs.FileSystem | None = None, expect: Provenance | Mapping[str, str] | None = None
) -> ArchiveReader:
    """A reader of the archive at ``uri`` (a local path or a URI such as ``s3://...``).
    ``filesystem``: read through this ``pyarrow.fs`` filesystem instead, ``uri`` being a
    path in it. Only the manifest is read here. ``expect``: the provenance the archive
    must record (``{"model": ..., "revision": ..., "kv_layout": ...}``, any of them); one
    made for anything else, or recording none, raises :class:`~fp8ray.errors.MismatchError` naming the
    field."""
    return ArchiveReader(uri, filesystem, expect)


@dataclass
class _PartIndex:
    """What a reader keeps of one part once it has looked into it."""

    metadata: pq.FileMetaData  # its footer, not read again
    rows: dict[tuple[str, str], int]  # (file, key) -> row
    keys: list[tuple[str, str]]  # (file, key) of each row, in order
    group_starts: list[int]  # first row of each row group
    group_rows: list[int]  # rows of each row group


class ArchiveReader:
    """An archive opened for reading blocks one at a time (:func:`open_archive`).

    Blocks are named by ``(file, key)``: ``file`` is a source file's name as the archive
    records it (:meth:`files`; a version 1 archive has one, ``""``); it may be left out
    where the key is in one file only.
    """

    def __init__(
        self,
        uri: str | os.PathLike,
        filesystem: pafs.FileSystem | None = None,
        expect: Provenance | Mapping[str, str] | None = None,
    ):
        expect = Provenance.parse(expect)  # a bad field name fails before anything is read
        if filesystem is not None and not isinstance(filesystem, pafs.FileSystem):
            raise TypeError(f"filesystem must be a pyarrow.fs.FileSystem or None, got {type(filesystem).__name__}")
        uri = as_uri(uri, "an archive's path")
        self._fs, self._dir = (filesystem, uri.rstrip("/")) if filesystem is not None else resolve(uri)
        self._uri = uri
        self.manifest: Manifest = archive.read_manifest(self._fs, self._dir, uri)
        self._manifest_stamp = self._stamp()
        check_provenance(self.manifest.provenance, expect, f"archive {self._shown}")
        self._parts: dict[int, _PartIndex] = {}
        # The rows of each file: (first, end) in the archive's order of blocks.
        starts = [0]
        for part in self.manifest.parts:
            starts.append(starts[-1] + part.blocks)
        self._part_starts = starts
        self._file_rows: dict[str, tuple[int, int]] = {}
        if self.manifest.layout is not None:
            row = 0
            for f in self.manifest.layout.files:
                self._file_rows[f.name] = (row, row + f.blocks)
                row += f.blocks
            if row != starts[-1]:  # rows are found by these counts: they must agree
                raise CorruptArchiveError(
                    f"archive {self._shown}: its manifest's layout records {row} blocks, its parts {starts[-1]}"
                )
        else:
            self._file_rows[""] = (0, starts[-1])

    def __enter__(self) -> ArchiveReader:  # not typing.Self: Python 3.10 has none
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop the footers and keys kept of the parts looked into (what leaving ``with``
        does). The reader may still be used: it reads them again."""
        self._parts.clear()

    def files(self) -> list[str]:
        """The source's files, in the archive's order."""
        return list(self._file_rows)

    def metadata(self, file: str) -> dict[str, str]:
        """A safetensors file's ``__metadata__`` (``{}`` for files without, Parquet files
        and version 1 archives)."""
        self._check_file(file)
        if self.manifest.layout is None:
            return {}
        return next(dict(f.metadata) for f in self.manifest.layout.files if f.name == file)

    def keys(self, file: str | None = None) -> list[str]:
        """The keys of ``file`` in file order; of every file (in order) when it is left out."""
        files = [file] if file is not None else self.files()
        out = []
        for name in files:
            self._check_file(name)
            keys = [key for f, key in self._idents(name) if f == name]
            if len(set(keys)) != len(keys):  # each part's were checked: two parts hold one key
                seen: set[str] = set()
                twice = next(key for key in keys if key in seen or seen.add(key))
                raise CorruptArchiveError(f"archive {self._shown} is damaged: it holds block {twice!r} of file {name!r} twice")
            out += keys
        return out

    def file_of(self, key: str) -> str:
        """The file holding ``key``, where one file does. Raises :class:`BadInputError`
        naming the key where no file holds it, and the files to choose from where several do."""
        _check_names(key, None)
        return self._file_of(key)

    def get(self, key: str, file: str | None = None, device=None):
        """The block ``key`` of ``file``, decoded (on ``device``, default the CPU).

        Raises :class:`BadInputError` naming the key and file when the archive has no
        such block, and :class:`CorruptArchiveError`, in one line naming the block, when
        its part or frame is damaged."""
        label, part, buf, _ = self._read_frame(key, file)
        try:
            return decode(buf, device=device)
        except InvalidOptionError:
            raise  # the device asked for, not the archive
        except (ValueError, TypeError) as exc:
            raise self._damaged(label, part, one_line(exc)) from None

    def block(self, key: str, file: str | None = None) -> Block:
        """:meth:`get` as a :class:`~fp8ray.codec.blocks.Block`: the tensor's raw
        little-endian bytes with its dtype's name and shape, decoded on the CPU without
        torch. Raises as :meth:`get` does."""
        label, part, buf, header = self._read_frame(key, file)
        try:
            return Block(key, header.dtype, header.shape, decode_raw(buf, header.dtype, header.shape))
        except InvalidOptionError:
            raise  # FP8RAY_NUM_THREADS, not the archive
        except (ValueError, TypeError) as exc:
            raise self._damaged(label, part, one_line(exc)) from None

    def nbytes(self, key: str, file: str | None = None) -> int:
        """The size of block ``key``'s tensor, read without its frame (to refuse a block
        too large before reading it). Raises as :meth:`get` does."""
        label, part, row = self._read_row(key, file, "dtype", "shape", "raw_bytes")
        # Read without the part's CRC (from its row group alone): the row must agree with itself.
        dtype, shape, nbytes = row["dtype"], row["shape"], row["raw_bytes"]
        if not (is_block(dtype, shape) and nbytes == tensor_nbytes(dtype, shape)):
            raise self._damaged(label, part, f"its row says {dtype!r} {shape!r} of {nbytes!r} bytes")
        return nbytes

    def _read_frame(self, key: str, file: str | None):
        """The block's label, part, frame and frame header; the header's dtype and shape
        must be its row's (a frame carries no key: its row says whose it is)."""
        label, part, row = self._read_row(key, file, "dtype", "shape", "frame")
        try:
            buf = as_byte_array(memoryview(row["frame"]))
            header = parse_layout(buf)
        except (ValueError, TypeError) as exc:
            raise self._damaged(label, part, one_line(exc)) from None
        if header.dtype != row["dtype"] or list(header.shape) != row["shape"]:
            raise self._damaged(
                label, part, f"its row says {row['dtype']} {row['shape']}, its frame {header.dtype} {list(header.shape)}"
            )
        return label, part, buf, header

    def _read_row(self, key: str, file: str | None, *columns: str) -> tuple[str, Part, dict]:
        """The block's label, its part, and its values of ``columns`` (read from its row
        group alone), its row's key and file checked to be the ones asked for."""
        _check_names(key, file)
        file = self._file_of(key) if file is None else file
        self._check_file(file)
        label = f"{file}:{key}" if len(self._file_rows) > 1 else key
        part = None
        try:
            located = self._locate(file, key)
            if located is None:
                in_file = f" in file {file!r}" if file else ""  # a version 1 archive names no files
                raise BadInputError(f"no block {key!r}{in_file} of archive {self._shown}", field="key")
            index, row = located
            part, meta = self.manifest.parts[index], self._parts[index]
            group = bisect.bisect_right(meta.group_starts, row) - 1
            names = ["key", *(["file"] if self.manifest.version >= 2 else []), *columns]
            with archive.open_part(self._fs, f"{self._dir}/{part.name}", part, self._shown) as f:
                table = pq.ParquetFile(f, metadata=meta.metadata).read_row_group(group, columns=names)
            at = row - meta.group_starts[group]
            if table.num_rows != meta.group_rows[group]:
                why = f"its row group holds {table.num_rows} rows, its footer {meta.group_rows[group]}"
                raise self._damaged(label, part, why)
            values = {c: table.column(c)[at] for c in names}
            out = {c: v.as_buffer() if c == "frame" else v.as_py() for c, v in values.items()}
        except CorruptArchiveError as exc:
            raise self._replaced() or CorruptArchiveError(f"block {label!r}: {exc}") from None
        except (OSError, pa.ArrowException, KeyError, IndexError) as exc:
            raise self._damaged(label, part, f"not readable as Parquet ({one_line(exc)})") from None
        if out["key"] != key or out.get("file", file) != file:
            held = f"{printable(str(out.get('file', file)))}:{printable(str(out['key']))}"
            raise self._damaged(label, part, f"its row holds block {held!r}")
        # An archive replaced since (compress --overwrite) whose parts have the old ones' row
        # groups reads without an error: its blocks were served as this archive's. Locally a
        # stat after the read tells (the renames swap the manifest and the parts at once); on
        # an object store that is a request per block, and only a failed read asks.
        if isinstance(self._fs, pafs.LocalFileSystem):
            replaced = self._replaced()
            if replaced is not None:
                raise replaced
        return label, part, out

    @property
    def _shown(self) -> str:
        return redact(self._uri)

    def _damaged(self, label: str, part: Part, why: str) -> CorruptArchiveError:
        return self._replaced() or CorruptArchiveError(f"block {label!r} in part {part.name} of {self._shown} is damaged: {why}")

    def _stamp(self) -> tuple | None:
        """The manifest file's size and modification time (None: it is gone)."""
        info = self._fs.get_file_info(f"{self._dir}/{archive.MANIFEST_NAME}")
        return None if info.type == pafs.FileType.NotFound else (info.size, info.mtime_ns)

    def _replaced(self) -> CorruptArchiveError | None:
        """Where the archive's manifest is not the one this reader opened (the archive was
        replaced, as by ``compress --overwrite``), the error saying so: what it kept of the
        old one (manifest, footers) made the new one's parts look damaged."""
        try:
            if self._stamp() == self._manifest_stamp:
                return None
        except OSError:
            return None
        return CorruptArchiveError(
            f"archive {self._shown} changed since it was opened (its manifest was replaced): open it again"
        )

    def _check_file(self, file: str) -> None:
        if not isinstance(file, str):  # metadata(None), keys(3)
            raise BadInputError(f"file must be a string, got {type(file).__name__} {file!r}", field="file")
        if file not in self._file_rows:
            raise BadInputError(f"archive {self._shown} holds no file {file!r}", field="file")

    def _file_of(self, key: str) -> str:
        """The one file holding ``key``, when no file is named."""
        if len(self._file_rows) == 1:
            return next(iter(self._file_rows))
        holding = [name for name in self.files() if self._locate(name, key) is not None]
        if not holding:
            raise BadInputError(f"no block {key!r} in any file of archive {self._shown}", field="key")
        if len(holding) > 1:
            raise BadInputError(
                f"key {key!r} is in {len(holding)} files of archive {self._shown} "
                f"({', '.join(map(printable, holding[:3]))}{', ...' if len(holding) > 3 else ''}): name the file",
                field="file",
            )
        return holding[0]

    def _parts_of(self, file: str) -> range:
        """The parts holding the rows of ``file`` (parts hold the blocks in source order)."""
        first, end = self._file_rows[file]
        if first == end:
            return range(0)
        lo = bisect.bisect_right(self._part_starts, first) - 1
        hi = bisect.bisect_left(self._part_starts, end)
        return range(lo, hi)

    def _idents(self, file: str) -> list[tuple[str, str]]:
        return [ident for i in self._parts_of(file) for ident in self._index(i).keys]

    def _locate(self, file: str, key: str) -> tuple[int, int] | None:
        for i in self._parts_of(file):
            row = self._index(i).rows.get((file, key))
            if row is not None:
                return i, row
        return None

    def _index(self, i: int) -> _PartIndex:
        """Part ``i``'s footer and the ``(file, key)`` of its rows, read on first use. A
        row's file is known from the layout (each file's rows are consecutive); its key from
        the footer's statistics where every row group holds one block (large blocks: no
        column read at all), else from the ``key`` column. Whatever a damaged part makes
        pyarrow raise is a :class:`CorruptArchiveError` naming the part."""
        if i not in self._parts:
            part = self.manifest.parts[i]
            try:
                self._parts[i] = self._read_index(part, self._part_starts[i])
            except CorruptArchiveError as exc:
                raise self._replaced() or exc from None
            except (OSError, pa.ArrowException, KeyError, IndexError, ValueError, TypeError) as exc:
                raise self._replaced() or CorruptArchiveError(
                    f"part {part.name} of {self._shown} is damaged: not readable as Parquet ({one_line(exc)})"
                ) from None
        return self._parts[i]

    def _read_index(self, part: Part, first_row: int) -> _PartIndex:
        """:meth:`_index` of one part: its footer read and checked (part_checks) before
        pyarrow parses it, its key columns checked where read, then what any archive
        allows: its size, its row count, its first and last key, no block twice."""
        shown = self._shown
        v2 = self.manifest.version >= 2
        with archive.open_part(self._fs, f"{self._dir}/{part.name}", part, shown) as f:
            if f.size() != part.file_bytes:
                raise CorruptArchiveError(
                    f"part {part.name} of {shown} is damaged: {f.size()} bytes, its entry records {part.file_bytes}"
                )
            metadata = part_checks.read_footer(f, part, shown)
            needed = ["file"] * v2 + ["key", "dtype", "shape", "frame"]
            part_checks.check_schema(metadata, part, shown, archive.SCHEMA, needed)
            keys = _keys_in_footer(metadata)
            if keys is None:
                # The key column alone, but every metadata column where their CRC is recorded.
                names = archive.METADATA_COLUMNS if part.columns_crc32c is not None else ["key"]
                table = pq.ParquetFile(f, metadata=metadata).read(columns=names, use_threads=False)
                columns = {name: table.column(name).to_pylist() for name in names}
                part_checks.check_columns(columns, part, shown)
                keys = columns["key"]
        part_checks.check_rows(len(keys), part, shown)
        part_checks.check_key_range(keys, part, shown)
        damaged = f"part {part.name} of {shown} is damaged"
        idents = list(zip(self._files_of_rows(first_row, len(keys)), keys))
        rows = {ident: r for r, ident in enumerate(idents)}
        if len(rows) != len(idents):
            twice = next(ident for r, ident in enumerate(idents) if rows[ident] != r)
            raise CorruptArchiveError(f"{damaged}: it holds block {twice[1]!r} twice")
        group_rows = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        starts = [0, *itertools.accumulate(group_rows)][:-1]
        return _PartIndex(metadata, rows, idents, starts, group_rows)

    def _files_of_rows(self, first: int, count: int) -> list[str]:
        """The file of each of the archive's rows ``first`` to ``first + count``."""
        names = []
        for name, (start, end) in self._file_rows.items():
            overlap = min(end, first + count) - max(start, first)
            names += [name] * max(overlap, 0)
        return names


def _check_names(key, file) -> None:
    """Refuse a key that is not a string, or a file that is neither a string nor None."""
    for name, value in (("key", key), ("file", file)):
        if not isinstance(value, str) and not (name == "file" and value is None):
            raise BadInputError(f"{name} must be a string, got {type(value).__name__} {value!r}", field=name)


def _keys_in_footer(metadata: pq.FileMetaData) -> list[str] | None:
    """Each row's key from the ``key`` column's statistics, where every row group holds
    one row (its minimum is its key); ``None`` where any row group holds more or records
    no statistics (Parquet leaves out those of a value over 4 KiB)."""
    column = metadata.schema.names.index("key")
    keys = []
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        if group.num_rows == 0:
            continue
        stats = group.column(column).statistics
        if group.num_rows != 1 or stats is None or not stats.has_min_max or stats.min != stats.max:
            return None
        keys.append(stats.min)
    return keys
