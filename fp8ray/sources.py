"""Block sources and the safetensors writer: where KV blocks come from and go back to.

A source is listed once, on the driver, into :class:`BlockRef` records (metadata only:
key, dtype, shape, where the bytes lie); a worker then reads just the blocks of its
shard. Paths are local or any URI ``pyarrow.fs`` knows (``s3://...``), so that on
shared storage the driver moves only metadata.

Sources: a ``.safetensors`` file, a directory of them, or a raw-block Parquet archive
(columns ``key``, ``dtype``, ``shape``, ``data``). Nothing here unpickles anything: the
safetensors header is JSON and the data raw little-endian bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import warnings

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from .errors import Fp8rayError

# safetensors dtype names <-> torch, for the dtypes fp8ray encodes.
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
SAFETENSORS_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
TORCH_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
TORCH_DTYPES = {v: k for k, v in TORCH_NAMES.items()}
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
# Bytes per element of the safetensors dtypes fp8ray reads: its source dtypes, and U8
# for frames carried in safetensors bodies.
SAFETENSORS_ITEMSIZES = {**{name: dtype.itemsize for name, dtype in SAFETENSORS_DTYPES.items()}, "U8": 1}


class SourceError(Fp8rayError, ValueError):
    """A source is missing, unreadable or malformed."""


@dataclass(frozen=True)
class BlockRef:
    """Where one block's raw bytes lie. ``path`` is the file's local path or URI;
    ``offset`` is a byte offset into a safetensors file, or a row index into a Parquet file."""

    key: str
    dtype: str  # "bfloat16" | "float16" | "float32"
    shape: tuple[int, ...]
    kind: str  # "safetensors" | "parquet"
    path: str
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * TORCH_DTYPES[self.dtype].itemsize


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """A filesystem and path for a local path or a URI such as ``s3://bucket/key``."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def uri_for(uri: str, path: str) -> str:
    """The URI of ``path`` on the filesystem ``uri`` names, keeping its scheme, credentials
    and options (``?endpoint_override=...``), so a worker's ``resolve`` finds the same file."""
    if "://" not in uri:
        return path
    parts = urlsplit(uri)
    if parts.scheme in ("s3", "gs", "gcs"):  # pyarrow's path is "bucket/key"
        userinfo, _, _ = parts.netloc.rpartition("@")
        bucket, _, key = path.partition("/")
        return urlunsplit((parts.scheme, f"{userinfo}@{bucket}" if userinfo else bucket, "/" + key, parts.query, ""))
    return urlunsplit((parts.scheme, parts.netloc, "/" + path.lstrip("/"), parts.query, ""))


def redact(uri: str) -> str:
    """``uri`` without credentials (``s3://key:secret@bucket`` -> ``s3://***@bucket``), for messages."""
    parts = urlsplit(uri) if "://" in uri else None
    if parts is None or "@" not in parts.netloc:
        return uri
    return urlunsplit((parts.scheme, "***@" + parts.netloc.rpartition("@")[2], parts.path, parts.query, ""))


def _info(fs: pafs.FileSystem, path: str) -> pafs.FileInfo:
    return fs.get_file_info(path)


def list_blocks(uri: str) -> list[BlockRef]:
    """Every block of a source, in a deterministic order (files sorted, then file order)."""
    fs, path = resolve(uri)
    info = _info(fs, path)
    if info.type == pafs.FileType.NotFound:
        raise SourceError(f"source {redact(uri)} does not exist")
    if info.type == pafs.FileType.Directory:
        files = sorted(
            f.path
            for f in fs.get_file_info(pafs.FileSelector(path, recursive=False))
            if f.type == pafs.FileType.File and not os.path.basename(f.path).startswith((".", "_"))
        )
        st = [f for f in files if f.endswith(".safetensors")]
        pq_files = [f for f in files if f.endswith(".parquet")]
        if st and pq_files:
            raise SourceError(f"source {redact(uri)} mixes .safetensors and .parquet files")
        if not st and not pq_files:
            raise SourceError(f"source {redact(uri)} holds no .safetensors or .parquet files")
        refs = [r for f in st for r in _safetensors_blocks(fs, f, uri_for(uri, f))] or [
            r for f in pq_files for r in _parquet_blocks(fs, f, uri_for(uri, f))
        ]
    elif path.endswith(".safetensors"):
        refs = _safetensors_blocks(fs, path, uri_for(uri, path))
    elif path.endswith(".parquet"):
        refs = _parquet_blocks(fs, path, uri_for(uri, path))
    else:
        raise SourceError(f"source {redact(uri)}: unknown format (expected .safetensors, .parquet or a directory of them)")
    seen: dict[str, str] = {}
    for r in refs:
        if r.key in seen:
            raise SourceError(f"key {r.key!r} appears twice: in {redact(seen[r.key])} and in {redact(r.path)}")
        seen[r.key] = r.path
    return refs


def read_safetensors_header(fs: pafs.FileSystem, path: str) -> tuple[dict, int, int]:
    """The parsed JSON header of a safetensors file, the data's start and the file size."""
    try:
        with fs.open_input_file(path) as f:
            size = f.size()
            if size < 8:
                raise SourceError(f"{path}: {size} bytes is too short for a safetensors file")
            (header_len,) = struct.unpack("<Q", f.read_at(8, 0))
            if header_len > min(MAX_HEADER, size - 8):
                raise SourceError(f"{path}: header length {header_len} exceeds the file ({size} bytes)")
            header = json.loads(f.read_at(header_len, 8))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        if isinstance(exc, SourceError):
            raise
        raise SourceError(f"{path}: unreadable safetensors file: {exc}") from exc
    if not isinstance(header, dict):
        raise SourceError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + header_len, size


class SafetensorsEntryError(ValueError):
    """A tensor's entry in a safetensors header is malformed; ``key`` names the tensor."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def safetensors_entries(header: dict, data_size: int, allowed: tuple[str, ...]) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """``(key, dtype name, shape, begin, end)`` of each tensor of a parsed safetensors
    header (``__metadata__`` left out), in byte order, each checked: a dtype in
    ``allowed`` (names of :data:`SAFETENSORS_ITEMSIZES`), a non-negative shape, and a byte
    range of exactly its size inside the ``data_size`` bytes after the header."""
    entries = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsEntryError(f"key {key!r}: malformed safetensors header entry", key) from exc
        if dtype_name not in allowed:
            raise SafetensorsEntryError(f"key {key!r} has dtype {dtype_name}; expected one of {list(allowed)}", key)
        expected = math.prod(shape) * SAFETENSORS_ITEMSIZES[dtype_name]
        if any(d < 0 for d in shape) or begin < 0 or end - begin != expected or end > data_size:
            raise SafetensorsEntryError(
                f"key {key!r} claims bytes [{begin}, {end}) for shape {list(shape)} {dtype_name} "
                f"({expected} bytes) in a data section of {data_size} bytes",
                key,
            )
        entries.append((key, dtype_name, shape, begin, end))
    entries.sort(key=lambda e: e[3])
    return entries


def safetensors_prefix(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file or body whose tensors,
    ``(key, dtype name, shape, bytes)``, follow it end to end in this order."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, dtype_name, shape, nbytes in entries:
        header[key] = {"dtype": dtype_name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _safetensors_blocks(fs: pafs.FileSystem, path: str, uri: str) -> list[BlockRef]:
    header, data_start, size = read_safetensors_header(fs, path)
    try:
        entries = safetensors_entries(header, size - data_start, tuple(SAFETENSORS_DTYPES))
    except SafetensorsEntryError as exc:
        raise SourceError(f"{path}: {exc}") from exc
    return [
        BlockRef(key, TORCH_NAMES[SAFETENSORS_DTYPES[name]], shape, "safetensors", uri, data_start + begin)
        for key, name, shape, begin, _ in entries  # file order
    ]


_RAW_COLUMNS = ("key", "dtype", "shape", "data")


def _parquet_blocks(fs: pafs.FileSystem, path: str, uri: str) -> list[BlockRef]:
    try:
        table = pq.read_table(path, filesystem=fs, columns=["key", "dtype", "shape"])
        names = pq.read_schema(path, filesystem=fs).names
    except (OSError, pa.ArrowException) as exc:
        raise SourceError(f"{path}: unreadable Parquet file: {exc}") from exc
    missing = [c for c in _RAW_COLUMNS if c not in names]
    if missing:
        raise SourceError(f"{path}: a raw-block Parquet source needs columns {list(_RAW_COLUMNS)}; missing {missing}")
    refs = []
    for row, (key, dtype, shape) in enumerate(zip(*(table.column(c).to_pylist() for c in ("key", "dtype", "shape")))):
        if dtype not in TORCH_DTYPES:
            raise SourceError(f"{path}: key {key!r} has dtype {dtype!r}; expected one of {sorted(TORCH_DTYPES)}")
        refs.append(BlockRef(str(key), dtype, tuple(int(d) for d in shape), "parquet", uri, row))
    return refs


def read_blocks(refs: list[BlockRef]) -> list[np.ndarray]:
    """The raw bytes of each block, as uint8 arrays, checked against the declared size."""
    by_file: dict[str, list[int]] = {}
    for i, r in enumerate(refs):
        by_file.setdefault(r.path, []).append(i)
    result: list[np.ndarray | None] = [None] * len(refs)
    for path, indices in by_file.items():
        fs, fpath = resolve(path)
        kind = refs[indices[0]].kind
        if kind == "safetensors":
            with fs.open_input_file(fpath) as f:
                for i in indices:
                    r = refs[i]
                    data = f.read_at(r.nbytes, r.offset)
                    if len(data) != r.nbytes:
                        raise SourceError(f"{redact(path)}: key {r.key!r} truncated: read {len(data)} of {r.nbytes} bytes")
                    result[i] = np.frombuffer(data, dtype=np.uint8)
        else:
            for i, value in zip(indices, _parquet_rows(fs, fpath, [refs[i].offset for i in indices])):
                r = refs[i]
                if len(value) != r.nbytes:
                    raise SourceError(
                        f"{redact(path)}: key {r.key!r} has {len(value)} data bytes, its shape {list(r.shape)} {r.dtype} needs {r.nbytes}"
                    )
                result[i] = np.frombuffer(value, dtype=np.uint8)
    return result  # type: ignore[return-value]


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


def bytes_to_tensor(data: np.ndarray, dtype: str, shape) -> torch.Tensor:
    """A zero-copy tensor view of raw little-endian bytes (read-only buffers included:
    the codec never writes to its input)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        flat = torch.from_numpy(data.view(np.uint8))
    return flat.view(TORCH_DTYPES[dtype]).reshape(tuple(shape))


def tensor_to_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw little-endian bytes of a contiguous CPU tensor, as a uint8 array view."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


class SafetensorsWriter:
    """Stream tensors into a safetensors file: the header (all offsets) first, then each
    tensor's bytes in order; written to a temporary name and renamed when complete."""

    def __init__(self, uri: str, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        self.fs, self.path = resolve(uri)
        self.entries = entries
        self.sizes = [math.prod(shape) * TORCH_DTYPES[dtype].itemsize for _, dtype, shape in entries]
        prefix = safetensors_prefix(
            [(key, SAFETENSORS_NAMES[TORCH_DTYPES[dtype]], shape, n) for (key, dtype, shape), n in zip(entries, self.sizes)], metadata
        )
        self.tmp = f"{self.path}.tmp-{os.getpid()}"
        self.stream = self.fs.open_output_stream(self.tmp)
        self.stream.write(prefix)
        self.written = 0

    def write(self, data) -> None:
        expected = self.sizes[self.written]
        if len(memoryview(data).cast("B")) != expected:
            raise ValueError(f"tensor {self.entries[self.written][0]!r}: got {len(memoryview(data).cast('B'))} bytes, expected {expected}")
        self.stream.write(data)
        self.written += 1

    def close(self) -> None:
        self.stream.close()
        if self.written != len(self.entries):
            self.fs.delete_file(self.tmp)
            raise ValueError(f"only {self.written} of {len(self.entries)} tensors were written")
        self.fs.move(self.tmp, self.path)

    def abort(self) -> None:
        self.stream.close()
        self.fs.delete_file(self.tmp)
