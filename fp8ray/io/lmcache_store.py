"""LMCache's filesystem L2 store as files: chunk file names, chunk layouts, and scanning.

LMCache's FS adapter keeps one file per chunk, flat in its ``base_path``, named::

    <model, '/' -> '-SEP-'>@<kv_rank as 0x%08x>@<object_group_id, hex>@<chunk_hash, hex>[@<cache_salt>].data

holding only the chunk's raw bytes: no header, the reader supplies the layout (e.g.
bfloat16 ``[2, layers, 256, kv_heads * head_dim]``). With LMCache's fp8 serde the same
file holds one fp8 byte per element instead. The conversion itself runs on the engine
(:mod:`fp8ray.engine.stores`); docs/LMCACHE.md has the contract.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..codec.formats import DTYPES_BY_NAME

SEP = "@"
SLASH_REPLACEMENT = "-SEP-"
EXTENSION = ".data"
SALT_FORBIDDEN = frozenset("@/\\\x00")
SALT_MAX_LEN = 128
LAYOUT_DTYPES = DTYPES_BY_NAME  # the dtypes a layout may name: fp8ray's source dtypes


@dataclass(frozen=True)
class ChunkName:
    """The fields of an LMCache chunk file name (LMCache's ``ObjectKey``).

    ``model`` must not contain ``@``; ``cache_salt`` not ``@``, ``/``, ``\\`` or NUL and
    at most 128 characters; ``object_group_id`` is non-negative, as LMCache requires.
    """

    model: str
    kv_rank: int
    object_group_id: int
    chunk_hash: bytes
    cache_salt: str = ""

    def __post_init__(self):
        if SEP in self.model:
            raise ValueError(f"model must not contain '@' (got {self.model!r})")
        if self.object_group_id < 0:
            raise ValueError(f"object_group_id must be >= 0 (got {self.object_group_id})")
        bad = SALT_FORBIDDEN & set(self.cache_salt)
        if bad:
            raise ValueError(f"cache_salt must not contain {sorted(bad)} (got {self.cache_salt!r})")
        if len(self.cache_salt) > SALT_MAX_LEN:
            raise ValueError(f"cache_salt is {len(self.cache_salt)} characters, at most {SALT_MAX_LEN} allowed")


def format_chunk_name(name: ChunkName) -> str:
    """The file name LMCache's FS adapter gives a chunk."""
    base = (
        f"{name.model.replace('/', SLASH_REPLACEMENT)}{SEP}{name.kv_rank:#010x}"
        f"{SEP}{name.object_group_id:x}{SEP}{name.chunk_hash.hex()}"
    )
    return f"{base}{SEP}{name.cache_salt}{EXTENSION}" if name.cache_salt else f"{base}{EXTENSION}"


def parse_chunk_name(filename: str) -> ChunkName:
    """The fields of a chunk file name, parsed as LMCache parses them (4 fields, or 5
    with a salt; kv_rank and object_group_id as hex, ``0x`` optional). Raises
    ``ValueError`` saying why a name is not one."""
    if not filename.endswith(EXTENSION):
        raise ValueError(f"does not end in {EXTENSION}")
    parts = filename[: -len(EXTENSION)].split(SEP)
    if len(parts) not in (4, 5):
        raise ValueError(f"has {len(parts)} '@'-separated fields, expected 4 or 5")
    model, rank, group, chunk_hash, *salt = parts
    try:
        return ChunkName(
            model=model.replace(SLASH_REPLACEMENT, "/"),
            kv_rank=int(rank, 16),
            object_group_id=int(group, 16),
            chunk_hash=bytes.fromhex(chunk_hash),
            cache_salt=salt[0] if salt else "",
        )
    except ValueError as exc:
        raise ValueError(f"has a malformed field: {exc}") from None


@dataclass(frozen=True)
class Layout:
    """The dtype and shape of every chunk of a store: ``bfloat16:2,30,256,192``."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def raw_bytes(self) -> int:
        return self.numel * LAYOUT_DTYPES[self.dtype].itemsize

    def __str__(self) -> str:
        return f"{self.dtype}:{','.join(map(str, self.shape))}"


def parse_layout(text: str) -> Layout:
    dtype, sep, dims = text.partition(":")
    if not sep or dtype not in LAYOUT_DTYPES:
        raise ValueError(f"layout {text!r}: expected DTYPE:D0,D1,... with DTYPE one of {sorted(LAYOUT_DTYPES)}")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise ValueError(f"layout {text!r}: dimensions must be comma-separated integers") from None
    if any(d <= 0 for d in shape):
        raise ValueError(f"layout {text!r}: dimensions must be positive")
    return Layout(dtype, shape)


@dataclass
class StoreScan:
    """The files of a store to convert, and those left alone with the reason."""

    files: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"name", "reason"}


def scan_store(directory: str, expected_bytes: int, other_sizes: dict[int, str] | None = None) -> StoreScan:
    """Sort the entries of a store directory into chunk files of ``expected_bytes`` and
    skipped ones (not a regular file, a name that is not a chunk name, another size).
    Like LMCache's FS adapter, only the directory's own entries count (no recursion).
    ``other_sizes`` maps a size to a hint for the reason (``"already fp8?"``)."""
    scan = StoreScan()
    with os.scandir(directory) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.is_symlink():
                scan.skipped.append({"name": entry.name, "reason": "a symbolic link"})
                continue
            if not entry.is_file():
                scan.skipped.append({"name": entry.name, "reason": "not a regular file (LMCache keeps chunks flat)"})
                continue
            try:
                parse_chunk_name(entry.name)
            except ValueError as exc:
                scan.skipped.append({"name": entry.name, "reason": f"not an LMCache chunk name: it {exc}"})
                continue
            size = entry.stat().st_size
            if size != expected_bytes:
                hint = (other_sizes or {}).get(size)
                reason = f"{size} bytes, the layout needs {expected_bytes}" + (f" ({hint})" if hint else "")
                scan.skipped.append({"name": entry.name, "reason": reason})
                continue
            scan.files.append(entry.name)
    return scan
