"""The safetensors format, read and written by fp8ray itself: files (streamed) and HTTP
bodies (in memory) share one header check.

A safetensors file is 8 bytes of little-endian header length ``n``, ``n`` bytes of JSON
naming each tensor's dtype, shape and byte range in the data that follows, then the
data. Nothing here unpickles anything. A header is accepted exactly when the
``safetensors`` package accepts it (its ``Metadata::validate``): at most 100,000,000
bytes of UTF-8 JSON; an object whose optional ``__metadata__`` maps strings to strings
and whose other members are tensors with a dtype of SOURCE_DTYPES, a shape of non-negative
integers and two integer offsets; the tensors, sorted by offsets, lying end to end from
0 and covering the data exactly, each of exactly its shape's size. Two deliberate
differences: a key given twice anywhere in the header is refused (the package silently
keeps the last one, which would lose a tensor without a word), and so are the format's
sub-byte dtypes (F4, F6), which safetensors.torch does not read either.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import math
import operator
import os
import struct
import sys
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_string  # json.dumps's own, for its exact text

import numpy as np
import pyarrow.fs as pafs

from ..codec.formats import DTYPE_ITEMSIZES, tensor_nbytes
from ..errors import MismatchError, SafetensorsFormatError, SourceError
from .paths import CompleteOrNothing, delete_quietly, is_utf8, move_into_place, os_reason, redact, resolve_output, temporary_name

MAX_HEADER = 100_000_000  # the safetensors package's limit on the JSON header
MAX_USIZE = 2**64 - 1
# Every dtype safetensors.torch reads, by its safetensors name, and fp8ray's (torch's) name
# of it: fp8 encodes the floats and stores the rest as they are (fp8ray.codec.frame). A
# header naming another (the format's sub-byte F4 and F6 among them) is refused.
SOURCE_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
SAFETENSORS_NAMES = {name: st for st, name in SOURCE_DTYPES.items()}
ITEMSIZES = {st: DTYPE_ITEMSIZES[name] for st, name in SOURCE_DTYPES.items()}
FRAME_DTYPE = "U8"  # frames travel in safetensors bodies as 1-D U8 tensors
# The __metadata__ member that marks a body of frames (the service's encode response),
# beside the body's own keys: {FRAMES_MARK: FRAMES_BODY}.
FRAMES_MARK, FRAMES_BODY = "fp8ray", "frames"


@dataclass(frozen=True)
class Entry:
    """One tensor of a header: its key, safetensors dtype name, shape and byte range in the data."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def fp8ray_dtype(self) -> str:
        """fp8ray's name of the dtype: ``"bfloat16"``..., or ``"uint8"`` for a frame."""
        return "uint8" if self.dtype == FRAME_DTYPE else SOURCE_DTYPES[self.dtype]


def header_length(first8: bytes, total: int, what: str) -> int:
    """The header length ``n`` from a file's or body's first 8 bytes, checked against the
    format's cap and the ``total`` bytes there are."""
    if total < 8:
        raise SafetensorsFormatError(f"{what}: {total} bytes is too short for safetensors (at least 8)", "header")
    (n,) = struct.unpack("<Q", first8)
    if n > MAX_HEADER:  # text, an archive, anything else: no header is this long
        noun = "body" if what == "safetensors body" else "file"
        raise SafetensorsFormatError(
            f"{what}: not a safetensors {noun} (its first 8 bytes are not a header length): they read as {n}, "
            f"the format allows at most {MAX_HEADER}",
            "header",
        )
    if 8 + n > total:
        raise SafetensorsFormatError(f"{what}: header length {n} runs past the end ({total} bytes in all)", "header")
    return n


@dataclass(frozen=True)
class HeaderTensors:
    """A header's tensors in byte order, as columns (one list per field, a row per
    tensor): what a file of thousands of small tensors is read into, without an object
    per tensor."""

    keys: list[str]
    dtypes: list[str]  # safetensors names
    shapes: list[tuple[int, ...]]
    begins: list[int]  # byte ranges in the data
    ends: list[int]

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self):
        return iter(self.entries())

    @classmethod
    def of(cls, entries: list[Entry]) -> HeaderTensors:
        return cls(*([getattr(e, name) for e in entries] for name in ("key", "dtype", "shape", "begin", "end")))

    def entries(self) -> list[Entry]:
        return [Entry(*row) for row in zip(self.keys, self.dtypes, self.shapes, self.begins, self.ends)]


def parse_header(raw: bytes, data_size: int, what: str, allowed: tuple[str, ...]) -> tuple[list[Entry], dict[str, str]]:
    """The tensors of a header, in byte order, and its ``__metadata__``, checked as the
    module docstring says against the ``data_size`` bytes after it; each tensor's dtype
    must also be one of ``allowed`` (safetensors names)."""
    tensors, metadata = parse_tensors(raw, data_size, what, allowed)
    return tensors.entries(), metadata


def parse_tensors(raw: bytes, data_size: int, what: str, allowed: tuple[str, ...]) -> tuple[HeaderTensors, dict[str, str]]:
    """:func:`parse_header`, the tensors as columns."""
    try:
        header = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_unique_members, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested past Python's stack
        raise SafetensorsFormatError(f"{what}: the header is not valid JSON text: {exc}", "header") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{what}: the header is a JSON {type(header).__name__}, not an object", "header")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsFormatError(f"{what}: __metadata__ must map strings to strings", "__metadata__")
    _check_text(metadata, what, "__metadata__")
    tensors = _valid_columns(header, data_size, allowed)
    if tensors is None:  # something is wrong: the checks tensor by tensor name it
        entries = _checked_entries(header, data_size, what, allowed)
        tensors = HeaderTensors.of(entries)
    return tensors, metadata


_DTYPE, _SHAPE, _OFFSETS = operator.itemgetter("dtype"), operator.itemgetter("shape"), operator.itemgetter("data_offsets")


def _valid_columns(header: dict, data_size: int, allowed: tuple[str, ...]) -> HeaderTensors | None:
    """The tensors of a header as columns, where every check of :func:`_checked_entries`
    holds; else ``None``. Each check runs over a whole column at once (the per-tensor
    checks cost 5 us a tensor, more than encoding a 16 KiB one)."""
    if not header or set(map(type, header.values())) != {dict}:
        return None
    keys, values = list(header), list(header.values())
    try:
        dtypes, shapes, offsets = list(map(_DTYPE, values)), list(map(_SHAPE, values)), list(map(_OFFSETS, values))
        if not set(dtypes) <= set(allowed):
            return None
    except (KeyError, TypeError):  # a field missing, a dtype that is no string
        return None
    if set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}:
        return None
    numbers = [*itertools.chain.from_iterable(shapes), *itertools.chain.from_iterable(offsets)]
    if set(map(type, numbers)) != {int} or min(numbers) < 0 or max(numbers) > MAX_USIZE:  # bool is no int here
        return None
    begins, ends = [o[0] for o in offsets], [o[1] for o in offsets]
    nbytes = list(map(operator.mul, map(math.prod, shapes), map(ITEMSIZES.__getitem__, dtypes)))
    if list(map(operator.sub, ends, begins)) != nbytes:
        return None
    if not is_utf8("".join(keys)):
        return None
    order = sorted(range(len(keys)), key=list(zip(begins, ends)).__getitem__)
    begins, ends = [begins[i] for i in order], [ends[i] for i in order]
    if begins[0] != 0 or begins[1:] != ends[:-1] or ends[-1] != data_size:
        return None
    return HeaderTensors([keys[i] for i in order], [dtypes[i] for i in order], [tuple(shapes[i]) for i in order], begins, ends)


def _checked_entries(header: dict, data_size: int, what: str, allowed: tuple[str, ...]) -> list[Entry]:
    """The tensors of a header, checked one by one: raises naming the first that is wrong."""
    entries = [_entry(key, value, what) for key, value in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    position = 0
    for e in entries:
        if e.begin != position:
            kind = "overlaps the tensor before it" if e.begin < position else f"leaves a gap after byte {position}"
            raise SafetensorsFormatError(f"{what}: key {e.key!r} at bytes [{e.begin}, {e.end}) {kind}", e.key)
        position = e.end
    if position != data_size:
        raise SafetensorsFormatError(f"{what}: the tensors cover {position} bytes of data, there are {data_size}", "header")
    for e in entries:
        if e.dtype not in allowed:
            raise SafetensorsFormatError(f"{what}: key {e.key!r} has dtype {e.dtype}; expected one of {list(allowed)}", e.key)
    return entries


def _unique_members(pairs: list[tuple[str, object]]) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise SafetensorsFormatError(f"key {key!r} appears twice in one object", "header")
        seen[key] = value
    return seen


def _no_constant(name: str):
    raise SafetensorsFormatError(f"{name} is not JSON", "header")


def _check_text(metadata: dict, what: str, field: str) -> None:
    """Strings must be valid Unicode (JSON lets ``\\ud800`` through; UTF-8 does not)."""
    if not all(map(is_utf8, (*metadata, *metadata.values()))):
        raise SafetensorsFormatError(f"{what}: {field} holds a string that is not valid Unicode", field)


def _is_usize(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_USIZE


def _entry(key: str, value, what: str) -> Entry:
    _check_text({key: ""}, what, "header")
    if not isinstance(value, dict) or not {"dtype", "shape", "data_offsets"} <= set(value):
        raise SafetensorsFormatError(f"{what}: key {key!r} needs an object with dtype, shape and data_offsets", key)
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZES:
        raise SafetensorsFormatError(
            f"{what}: key {key!r} has dtype {dtype!r}, which fp8ray does not read; it reads {list(ITEMSIZES)}", key
        )
    if not isinstance(shape, list) or not all(_is_usize(d) for d in shape):
        raise SafetensorsFormatError(
            f"{what}: key {key!r} has shape {json.dumps(shape)}; expected a list of integers from 0 to {MAX_USIZE}", key
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_usize(o) for o in offsets)):
        raise SafetensorsFormatError(
            f"{what}: key {key!r} has data_offsets {json.dumps(offsets)}; expected [begin, end], integers from 0 to {MAX_USIZE}",
            key,
        )
    begin, end = offsets
    nbytes = math.prod(shape) * ITEMSIZES[dtype]
    if end < begin or end - begin != nbytes:
        raise SafetensorsFormatError(
            f"{what}: key {key!r} claims bytes [{begin}, {end}) for shape {shape} {dtype} ({nbytes} bytes)", key
        )
    return Entry(key, dtype, tuple(shape), begin, end)


def read_file_header(
    fs: pafs.FileSystem, path: str, uri: str, allowed: tuple[str, ...]
) -> tuple[HeaderTensors, dict[str, str], int]:
    """The tensors (in byte order, as columns) and ``__metadata__`` of a safetensors file, and where
    its data starts. Raises :class:`SourceError` for an unreadable file and
    :class:`SafetensorsFormatError` for a malformed one."""
    what = redact(uri)
    try:
        with fs.open_input_file(path) as f:
            size = f.size()
            first8 = f.read_at(min(8, size), 0)
            n = header_length(first8, size, what)
            raw = f.read_at(n, 8)
    except OSError as exc:
        raise SourceError(f"{what} cannot be read: {os_reason(exc)}") from None
    tensors, metadata = parse_tensors(raw, size - 8 - n, what, allowed)
    return tensors, metadata, 8 + n


def parse_body(body, allowed: tuple[str, ...]) -> tuple[list[tuple[Entry, np.ndarray]], dict[str, str]]:
    """Split a safetensors body held in memory into ``(entry, uint8 view of its bytes)``
    pairs, in byte order, and its ``__metadata__``."""
    view = memoryview(body).cast("B")
    n = header_length(bytes(view[:8]), len(view), "safetensors body")
    data = np.frombuffer(view, dtype=np.uint8, offset=8 + n)
    entries, metadata = parse_header(view[8 : 8 + n], len(data), "safetensors body", allowed)
    return [(e, data[e.begin : e.end]) for e in entries], metadata


def header_prefix(tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file or body whose tensors,
    ``(key, safetensors dtype, shape, nbytes)``, follow it end to end in this order."""
    keys = [key for key, *_ in tensors]
    if "__metadata__" in keys:  # a Parquet source's key may be anything
        raise SafetensorsFormatError(
            "key '__metadata__' is the name safetensors gives its header's metadata: no tensor of a .safetensors file "
            "may have it (decompress such a Parquet source's archive to Parquet)",
            "__metadata__",
        )
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        twice = next(key for key in keys if key in seen or seen.add(key))
        raise SafetensorsFormatError(f"key {twice!r} appears twice; safetensors keys are unique", twice)
    # The text json.dumps(header, separators=(",", ":")) gives, written a tensor at a time:
    # json's encoder took 2 us a tensor, over a dict built for it. A file's tensors share a
    # few dtypes and shapes: the text between a key and its offsets is made once for each.
    members = [f'"__metadata__":{json.dumps(metadata, separators=(",", ":"))}'] if metadata else []
    middles: dict[tuple, str] = {}
    offset = 0
    for key, dtype, shape, nbytes in tensors:
        kind = (dtype, tuple(shape))  # a list, too
        middle = middles.get(kind)
        if middle is None:
            dims = ",".join(map(int.__repr__, shape))  # as json writes an int
            middle = middles[kind] = f':{{"dtype":{_json_string(dtype)},"shape":[{dims}],"data_offsets":['
        members.append(f"{_json_string(key)}{middle}{offset},{offset + nbytes}]}}")
        offset += nbytes
    raw = ("{" + ",".join(members) + "}").encode()
    raw += b" " * (-len(raw) % 8)  # data 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def build_body(tensors: list[tuple[str, str, tuple[int, ...], object]], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors body of ``(key, dtype, shape, bytes)`` tensors in order; ``dtype`` is
    an fp8ray dtype name or ``"uint8"`` (a frame)."""
    views = [memoryview(data).cast("B") for _, _, _, data in tensors]
    prefix = header_prefix(
        [
            (key, FRAME_DTYPE if dtype == "uint8" else SAFETENSORS_NAMES[dtype], shape, len(view))
            for (key, dtype, shape, _), view in zip(tensors, views)
        ],
        metadata,
    )
    return b"".join([prefix, *views])


@dataclass(frozen=True)
class SafetensorsLayout:
    """Where everything lies in a safetensors file of ``tensors``, ``(key, fp8ray dtype
    name, shape)``, in this order: the 8-byte length and header (``prefix``), then each
    tensor's ``sizes[i]`` bytes end to end."""

    prefix: bytes
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> SafetensorsLayout:
        sizes = tuple(tensor_nbytes(dtype, shape) for _, dtype, shape in tensors)
        prefix = header_prefix(
            [(key, SAFETENSORS_NAMES[dtype], shape, n) for (key, dtype, shape), n in zip(tensors, sizes)], metadata
        )
        return cls(prefix, sizes)

    @property
    def file_bytes(self) -> int:
        return len(self.prefix) + sum(self.sizes)


def create_presized(path: str, layout: SafetensorsLayout) -> None:
    """Create the local file ``path`` with its header and its full length, the data zeros
    for :class:`RangeWriter` s to fill: several processes at once, each its tensors' byte
    ranges. A file that is there is replaced. Its blocks are allocated here where the
    filesystem can (:func:`allocate`), so a disk without the room fails before any work."""
    with open(path, "wb") as f:
        f.write(layout.prefix)
        f.truncate(layout.file_bytes)
        allocate(f.fileno(), layout.file_bytes)


# Linux's fallocate(2) (64-bit offsets); elsewhere files stay holes.
_fallocate = getattr(ctypes.CDLL(None, use_errno=True), "fallocate64", None) if sys.platform.startswith("linux") else None
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def allocate(fd: int, size: int) -> None:
    """Allocate the first ``size`` bytes of the open file ``fd`` (``fallocate(2)``): the
    writers then fill pages that are there instead of each allocating its own under the
    file's lock, which they share (tmpfs, ext4). Where the filesystem cannot, the file
    stays a hole; any other failure (ENOSPC: a full disk) raises. Not
    ``os.posix_fallocate``: glibc emulates that by writing every block, a file's worth
    of small writes on a network filesystem."""
    while _fallocate is not None and _fallocate(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return
        if err != errno.EINTR:  # a signal: again
            raise OSError(err, os.strerror(err))


class RangeWriter:
    """Writes byte ranges of an existing local file in place: opened without truncation
    (and never created: a file that is gone is an error), each range written at its
    offset, so that several processes fill one file at once and a range written again
    (a retried task) leaves the same bytes. Object stores have no such writes."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)

    def write_at(self, offset: int, data) -> None:
        view = memoryview(data).cast("B")
        while view:  # pwrite may write less than asked (a signal, a full disk raises)
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> RangeWriter:
        return self

    def __exit__(self, *_) -> None:
        self.close()


class SafetensorsWriter(CompleteOrNothing):
    """Stream tensors into a safetensors file: the header (all offsets) first, then each
    tensor's bytes in order; written to a temporary name and renamed when complete. The
    one writer of a file on any filesystem, object stores included (where a file cannot
    be written at offsets, as :class:`RangeWriter` does locally).

    ``tensors`` are ``(key, fp8ray dtype name, shape)``; use as a context manager, or call
    :meth:`close` (rename) or :meth:`abort` (delete) yourself. ``replace=False``: a file
    another command put at ``uri`` meanwhile is kept (:func:`~fp8ray.io.paths.move_into_place`).
    """

    def __init__(
        self,
        uri: str,
        tensors: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        replace: bool = True,
    ):
        self.uri, self.replace = uri, replace
        self.fs, self.path = resolve_output(uri)
        self.tensors = tensors
        layout = SafetensorsLayout.of(tensors, metadata)
        self.sizes = layout.sizes
        self.tmp = temporary_name(self.path)
        try:
            self.stream = self.fs.open_output_stream(self.tmp)
            self.stream.write(layout.prefix)
        except BaseException:  # before the caller holds the writer to abort it
            delete_quietly(self.fs, self.tmp)
            raise
        self.written = 0

    def write(self, data) -> None:
        size = len(memoryview(data).cast("B"))
        if self.written == len(self.tensors):
            raise MismatchError(f"all {len(self.tensors)} tensors are already written")
        expected = self.sizes[self.written]
        if size != expected:
            key = self.tensors[self.written][0]
            raise MismatchError(f"tensor {key!r}: got {size} bytes, expected {expected}", field=key)
        self.stream.write(data)
        self.written += 1

    def write_block(self, key: str, dtype: str, shape, data) -> None:
        """:meth:`write`, checking that this is the block the header announced next."""
        if self.written < len(self.tensors) and (key, dtype, tuple(shape)) != self.tensors[self.written]:
            expected = self.tensors[self.written]
            raise MismatchError(f"expected tensor {expected} next, got {(key, dtype, tuple(shape))}", field=key)
        self.write(data)

    def write_blocks(self, tensors: list[tuple[str, str, tuple[int, ...]]], data) -> None:
        """The bytes of the next ``tensors`` (``(key, dtype, shape)``, those the header
        announced next), end to end in ``data``, in one write: a write per small block
        cost more than its decoding."""
        end = self.written + len(tensors)
        if end > len(self.tensors):
            raise MismatchError(f"{len(tensors)} more tensors, but {len(self.tensors) - self.written} are left to write")
        if list(tensors) != list(self.tensors[self.written : end]):
            got, expected = next((g, e) for g, e in zip(tensors, self.tensors[self.written : end]) if g != e)
            raise MismatchError(f"expected tensor {expected} next, got {got}", field=got[0])
        size = len(memoryview(data).cast("B"))
        expected_size = sum(self.sizes[self.written : end])
        if size != expected_size:
            raise MismatchError(f"tensors {tensors[0][0]!r} to {tensors[-1][0]!r}: got {size} bytes, expected {expected_size}")
        self.stream.write(data)
        self.written = end

    def close(self) -> None:
        try:
            self.stream.close()  # its last bytes go now: a full disk can fail it
            if self.written != len(self.tensors):
                raise MismatchError(f"only {self.written} of {len(self.tensors)} tensors were written")
            move_into_place(self.fs, self.tmp, self.path, self.uri, self.replace)
        except BaseException:  # nothing of it left behind
            delete_quietly(self.fs, self.tmp)
            raise

    def abort(self) -> None:
        self.stream.close()
        self.fs.delete_file(self.tmp)


__all__ = [
    "Entry",
    "HeaderTensors",
    "RangeWriter",
    "SafetensorsLayout",
    "SafetensorsWriter",
    "build_body",
    "create_presized",
    "header_prefix",
    "parse_body",
    "parse_header",
    "parse_tensors",
    "read_file_header",
]
