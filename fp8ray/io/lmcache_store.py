"""LMCache's filesystem L2 store as files: chunk file names, chunk layouts, the forms a
chunk file takes, and scanning a store.

LMCache's FS adapter (``lmcache/v1/distributed/l2_adapters/fs_l2_adapter.py`` in
lmcache 0.5.6: ``_object_key_to_filename``) keeps one file per chunk, flat in its
``base_path``, named::

    <model, '/' -> '-SEP-'>@<kv_rank as 0x%08x>@<object_group_id, hex>@<chunk_hash, hex>[@<cache_salt>].data

The name is the same whatever the adapter's serde. LMCache's native filesystem connector
can also spread the files into hash-prefix folders (its ``hash_subdir_levels``): level
``i`` is the ``i``-th pair of hex digits of the chunk hash, ``9f/3a/<name>``. The file holds the bytes the serde
wrote, with no header of LMCache's own. For a chunk of layout ``dtype:shape`` that is
one of three forms:

- ``raw``: no serde, the tensor's bytes (``numel * itemsize``);
- ``fp8``: LMCache's ``"fp8"`` serde, one fp8 byte per element (``numel``);
- ``fp8ray``: the ``"fp8ray"`` serde (:func:`fp8ray.lmcache.register`), one fp8ray frame
  of that dtype and shape, whose header gives its length.

Only the first two share a size: the fp8 form's is also a raw chunk's of 1/itemsize of
the tokens, so :func:`scan_store` takes such a file for a raw one in a store of raw chunks.

The conversion itself is :mod:`fp8ray.lmcache.store_files`, run on the engine
(:mod:`fp8ray.engine.stores`); a store as an archive's source is
:mod:`fp8ray.io.store_source`; docs/LMCACHE.md has the contract.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..codec.formats import DTYPE_CODES, DTYPE_ITEMSIZES
from ..codec.frame import MAX_HEADER_BYTES, FrameHeader, parse_header
from ..errors import BadInputError, CorruptFrameError, MismatchError
from .paths import counted, link_kind

SEP = "@"
SLASH_REPLACEMENT = "-SEP-"
EXTENSION = ".data"
SALT_FORBIDDEN = frozenset("@/\\\x00")
SALT_MAX_LEN = 128
# The dtypes a layout may name, and their sizes: a KV cache's, those fp8 encodes (LMCache's
# serdes take no other; and a store's forms are told apart by size, which a 1-byte dtype's
# raw chunk would share with the fp8 form).
LAYOUT_DTYPES = {name: DTYPE_ITEMSIZES[name] for name in DTYPE_CODES}
RAW, FP8, FRAMES = "raw", "fp8", "fp8ray"
FORMS = (RAW, FP8, FRAMES)  # the forms a chunk file takes (module docstring)
HEADER_BYTES = MAX_HEADER_BYTES  # enough of a file to read any frame header
STORE_KIND = "lmcache"  # an archive's source kind (its manifest's layout) for a store
HEX_DIGITS = frozenset("0123456789abcdef")  # a hash-prefix folder's name: two of them, as chunk names write hashes


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
            raise BadInputError(f"model must not contain '@' (got {self.model!r})")
        if self.object_group_id < 0:
            raise BadInputError(f"object_group_id must be >= 0 (got {self.object_group_id})")
        bad = SALT_FORBIDDEN & set(self.cache_salt)
        if bad:
            raise BadInputError(f"cache_salt must not contain {sorted(bad)} (got {self.cache_salt!r})")
        if len(self.cache_salt) > SALT_MAX_LEN:
            raise BadInputError(f"cache_salt is {len(self.cache_salt)} characters, at most {SALT_MAX_LEN} allowed")


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
    :class:`~fp8ray.errors.BadInputError` (a ``ValueError``) saying why a name is not one."""
    if not filename.endswith(EXTENSION):
        raise BadInputError(f"does not end in {EXTENSION}")
    parts = filename[: -len(EXTENSION)].split(SEP)
    if len(parts) not in (4, 5):
        raise BadInputError(f"has {len(parts)} '@'-separated fields, expected 4 or 5")
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
        raise BadInputError(f"has a malformed field: {exc}") from None


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
        return self.numel * LAYOUT_DTYPES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}:{','.join(map(str, self.shape))}"


def parse_layout(text: str) -> Layout:
    dtype, sep, dims = text.partition(":")
    if not sep or dtype not in LAYOUT_DTYPES:
        raise BadInputError(
            f"layout {text!r}: expected DTYPE:D0,D1,... with DTYPE one of {sorted(LAYOUT_DTYPES)}", field="layout"
        )
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise BadInputError(f"layout {text!r}: dimensions must be comma-separated integers", field="layout") from None
    if any(d <= 0 for d in shape):
        raise BadInputError(f"layout {text!r}: dimensions must be positive", field="layout")
    return Layout(dtype, shape)


@dataclass(frozen=True)
class ChunkFile:
    """A chunk file of a store: its name (relative to the store: ``9f/3a/<name>`` in
    hash-prefix folders), its form (one of :data:`FORMS`) and its size; a frame's header
    too (form ``fp8ray``), which gives the codec options it was written in."""

    name: str
    form: str
    size: int
    header: FrameHeader | None = None


@dataclass
class StoreScan:
    """A store's chunk files of the layout, by form, and the entries left alone with the reason."""

    chunks: list[ChunkFile] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"name", "reason"}

    def count(self, form: str) -> int:
        return sum(1 for c in self.chunks if c.form == form)


def form_of(layout: Layout, size: int, prefix: bytes) -> tuple[str | None, str]:
    """The form of a chunk file of ``size`` bytes starting with ``prefix`` (at least
    :data:`HEADER_BYTES` of it, or all of it) under ``layout``, or ``None`` and the
    reason it is none of them.

    A frame is recognised by its header (magic, codes, the layout's dtype and shape, and
    a length equal to the file's); its checksum is verified when it is converted. A valid
    header decides before the size does: the frame of a shorter chunk (the last of a
    request) can be exactly as long as a plain chunk of the layout, and was read as one."""
    try:
        header = parse_header(prefix)
        malformed = ""
    except CorruptFrameError as exc:
        header, malformed = None, str(exc)
    if header is not None:
        found = f"{header.dtype}:{','.join(map(str, header.shape))}"
        if found != str(layout):
            return None, f"an fp8ray frame of {found}, not of the layout {layout}"
        if header.frame_size != size:
            return None, f"an fp8ray frame of {size} bytes, but its header implies {header.frame_size}: truncated or padded?"
        return FRAMES, ""
    if size == layout.raw_bytes:
        return RAW, ""
    if size == layout.numel:
        return FP8, ""
    sizes = f"{layout.raw_bytes} bytes ({layout.dtype}), {layout.numel} (LMCache fp8) or an fp8ray frame of that shape"
    return None, f"{size} bytes, the layout {layout} needs {sizes}" + (f"; {malformed}" if malformed else "")


def is_hash_folder(name: str) -> bool:
    """Whether a folder's name is one level of LMCache's hash-prefix folders (two hex digits)."""
    return len(name) == 2 and set(name) <= HEX_DIGITS


def hash_folders(chunk: ChunkName, levels: int) -> str:
    """The hash-prefix folders of a chunk at ``levels`` levels (``"9f/3a/"``; ``""`` at 0),
    as LMCache's native filesystem connector (``hash_subdir_levels``) places it."""
    digits = chunk.chunk_hash.hex()
    return "".join(f"{digits[2 * i : 2 * i + 2]}/" for i in range(levels))


def is_store_entry(name: str, kind: str) -> bool:
    """Whether an entry under a directory (a :class:`~fp8ray.io.paths.TreeEntry`'s
    ``name`` and ``kind``) is one a store holds, whatever its layout: a regular file with
    a chunk name, flat or in its hash's prefix folders, or an empty hash-prefix folder."""
    *folders, base = name.rstrip("/").split("/")
    if kind == "empty folder":
        return all(is_hash_folder(f) for f in [*folders, base])
    if kind != "file":
        return False
    try:
        chunk = parse_chunk_name(base)
    except ValueError:
        return False
    return hash_folders(chunk, len(folders)) == "".join(f"{f}/" for f in folders)


PLAIN_FORMS = (RAW, FP8)  # what a store's plain files are, where their sizes cannot tell (scan_store's plain_form)


def scan_store(directory: str, layout: Layout, plain_form: str | None = None) -> StoreScan:
    """Sort the entries of a store directory into chunk files of ``layout`` (by form)
    and skipped ones (not a regular file, a name that is not a chunk name, a file of
    none of the forms, a chunk in a hash-prefix folder that is not its hash's).
    LMCache's FS adapter keeps chunks flat in the directory; its native connector may put
    them in hash-prefix folders (two hex digits a level, :func:`hash_folders`), which are
    entered, every other folder being skipped. Names are relative to ``directory``, ``/``
    between parts; a skipped folder's ends in ``/``. Reads the first bytes of every file:
    a frame's header decides its form (:func:`form_of`).

    The raw and fp8 forms of two layouts share a size: a raw chunk of 1/itemsize of the
    tokens (the last of a sequence, which LMCache stores with ``save_unfull_chunk``) is an
    fp8 chunk's, and an fp8 chunk of itemsize times the tokens a raw chunk's. An LMCache
    writes one of the two (its serde is set for the store): ``plain_form`` (``"raw"`` or
    ``"fp8"``) says which, and the files of the other form's size are skipped as chunks of
    another layout. Left out, a store holding files of both sizes is refused
    (:class:`~fp8ray.errors.MismatchError`): which are of the layout cannot be told."""
    if plain_form is not None and plain_form not in PLAIN_FORMS:
        raise BadInputError(f"plain_form must be one of {list(PLAIN_FORMS)} or None, got {plain_form!r}")
    scan = StoreScan()
    _scan_folder(directory, "", layout, scan)
    itemsize = LAYOUT_DTYPES[layout.dtype]
    if plain_form is None and scan.count(RAW) and scan.count(FP8):
        raise MismatchError(
            f"LMCache store {directory} holds {counted(scan.count(RAW), 'file')} of {layout.raw_bytes} bytes and "
            f"{scan.count(FP8)} of {layout.numel}: raw chunks of the layout {layout} and raw ones of 1/{itemsize} of "
            f"its tokens, or LMCache fp8 chunks of it and fp8 ones of {itemsize} times its tokens; say which with "
            "--plain-form raw or fp8 (plain_form=): the files of the other size are then skipped",
            field="plain_form",
        )
    other = {RAW: FP8, FP8: RAW}.get(plain_form)
    if other is not None and scan.count(other):
        reason = (
            f"{layout.numel} bytes, a raw chunk of 1/{itemsize} of the tokens (save_unfull_chunk) in a store of raw chunks "
            "(--plain-form raw): a chunk of another layout"
            if plain_form == RAW
            else f"{layout.raw_bytes} bytes, an LMCache fp8 chunk of {itemsize} times the tokens in a store of fp8 chunks "
            "(--plain-form fp8): a chunk of another layout"
        )
        scan.skipped += [{"name": c.name, "reason": reason} for c in scan.chunks if c.form == other]
        scan.chunks = [c for c in scan.chunks if c.form != other]
    return scan


def _unreadable(name: str, exc: OSError) -> dict:
    """The skipped entry of a file or folder that cannot be read."""
    return {"name": name, "reason": f"unreadable: {exc.strerror or exc}"}


def _scan_folder(root: str, prefix: str, layout: Layout, scan: StoreScan) -> None:
    """Scan the folder ``prefix`` (``""``, or hash-prefix folders ending in ``/``) of ``root``."""
    try:
        with os.scandir(os.path.join(root, prefix) if prefix else root) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        if not prefix:  # the store itself: the caller's to report
            raise
        scan.skipped.append(_unreadable(prefix, exc))
        return
    if not entries and prefix:
        scan.skipped.append({"name": prefix, "reason": "an empty hash-prefix folder"})
    for entry in entries:
        name = prefix + entry.name
        if entry.is_symlink():  # a skipped folder's name ends in '/' (docs/FORMAT.md)
            folder = "/" if link_kind(entry.path) == "folder link" else ""
            scan.skipped.append({"name": name + folder, "reason": "a symbolic link"})
            continue
        folder = "/" if entry.is_dir() else ""
        if entry.is_dir() and is_hash_folder(entry.name):
            _scan_folder(root, name + "/", layout, scan)
            continue
        if not entry.is_file():
            scan.skipped.append(
                {"name": name + folder, "reason": "not a regular file, nor a hash-prefix folder (two hex digits) of chunk files"}
            )
            continue
        try:
            chunk = parse_chunk_name(entry.name)
        except ValueError as exc:
            scan.skipped.append({"name": name, "reason": f"not an LMCache chunk name: it {exc}"})
            continue
        if prefix and hash_folders(chunk, prefix.count("/")) != prefix:
            scan.skipped.append(
                {"name": name, "reason": f"in folder {prefix}, not its hash's prefix folder: LMCache would not find it there"}
            )
            continue
        prefix_bytes = b""
        try:
            size = entry.stat().st_size  # a file LMCache evicted since the listing: named, the rest go on
            with open(entry.path, "rb") as f:  # of every size: a frame's header decides (form_of)
                prefix_bytes = f.read(HEADER_BYTES)
        except OSError as exc:
            scan.skipped.append(_unreadable(name, exc))
            continue
        form, reason = form_of(layout, size, prefix_bytes)
        if form is None:
            scan.skipped.append({"name": name, "reason": reason})
        else:
            scan.chunks.append(ChunkFile(name, form, size, parse_header(prefix_bytes) if form == FRAMES else None))
