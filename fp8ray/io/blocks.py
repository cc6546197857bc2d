"""Block sources: where KV blocks come from, listed once and read in shards.

A source is listed once, on the driver, into :class:`BlockRef` records (metadata only:
key, dtype, shape, where the bytes lie); a worker then reads just the blocks of its
shard. Paths are local or any URI ``pyarrow.fs`` knows (``s3://...``), so that on
shared storage the driver moves only metadata.

Sources: a ``.safetensors`` file, a directory of them, or a raw-block Parquet file
(columns ``key``, ``dtype``, ``shape``, ``data``) or a directory of those. Nothing here
unpickles anything: the safetensors header is JSON and the data raw little-endian bytes.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from ..codec.formats import DTYPE_NAMES, DTYPES_BY_NAME
from ..errors import SourceError
from .paths import redact, resolve, uri_for
from .safetensors import SOURCE_DTYPES, read_file_header

RAW_COLUMNS = ("key", "dtype", "shape", "data")


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
        return math.prod(self.shape) * DTYPES_BY_NAME[self.dtype].itemsize


def list_blocks(uri: str) -> list[BlockRef]:
    """Every block of a source, in a deterministic order (files sorted, then file order)."""
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
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


def _safetensors_blocks(fs: pafs.FileSystem, path: str, uri: str) -> list[BlockRef]:
    entries, _, data_start = read_file_header(fs, path, uri, tuple(SOURCE_DTYPES))
    return [
        BlockRef(e.key, e.fp8ray_dtype, e.shape, "safetensors", uri, data_start + e.begin)
        for e in entries  # file order
    ]


def _parquet_blocks(fs: pafs.FileSystem, path: str, uri: str) -> list[BlockRef]:
    try:
        table = pq.read_table(path, filesystem=fs, columns=["key", "dtype", "shape"])
        names = pq.read_schema(path, filesystem=fs).names
    except (OSError, pa.ArrowException) as exc:
        raise SourceError(f"{redact(uri)}: unreadable Parquet file: {exc}") from exc
    missing = [c for c in RAW_COLUMNS if c not in names]
    if missing:
        raise SourceError(f"{redact(uri)}: a raw-block Parquet source needs columns {list(RAW_COLUMNS)}; missing {missing}")
    refs = []
    for row, (key, dtype, shape) in enumerate(zip(*(table.column(c).to_pylist() for c in ("key", "dtype", "shape")))):
        if dtype not in DTYPES_BY_NAME:
            raise SourceError(f"{redact(uri)}: key {key!r} has dtype {dtype!r}; expected one of {sorted(DTYPES_BY_NAME)}")
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
        if refs[indices[0]].kind == "safetensors":
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
    return flat.view(DTYPES_BY_NAME[dtype]).reshape(tuple(shape))


def tensor_to_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw little-endian bytes of a contiguous CPU tensor, as a uint8 array view."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def dtype_name(t: torch.Tensor) -> str:
    """fp8ray's name of a tensor's dtype (``"bfloat16"``, ``"float16"``, ``"float32"``)."""
    return DTYPE_NAMES[t.dtype]
