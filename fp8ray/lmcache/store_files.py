"""The per-file work of converting an LMCache filesystem store, as a ``QuantWorker`` runs
it (:meth:`fp8ray.engine.worker.QuantWorker.convert_store_files`); the driver side is
:mod:`fp8ray.engine.stores`, the forms a chunk file takes :mod:`fp8ray.io.lmcache_store`.

Each file goes through the layout's dtype: read in its form (raw bytes; LMCache's plain
fp8 bytes through :class:`~fp8ray.lmcache.Fp8QuantizationDeserializer`; an fp8ray frame,
checksum verified, through :func:`~fp8ray.codec.decode`), then written in the target
form by the serializer an LMCache with that serde uses (:class:`~fp8ray.lmcache.Fp8QuantizationSerializer`
for ``fp8``, :class:`~fp8ray.lmcache.Fp8FrameSerializer` for ``fp8ray``), so the output
is byte for byte what LMCache would have stored. A file already in the target form is
copied unchanged (a frame, only in the codec options asked, after its checksum is
verified; one in other options is decoded and encoded again).

A store is also an archive's source (``fp8ray compress STORE ARCHIVE --lmcache-layout``)
and an archive gives a store back (``fp8ray decompress ARCHIVE STORE --lmcache-form``):
:func:`encode_chunk_files` and :func:`restore_chunk_files` are a ``QuantWorker``'s part
of each, one archive part or one restore task at a time.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field

import numpy as np
import pyarrow.fs as pafs
import torch

from ..codec import CodecOptions, Fp8Codec, decode, frame
from ..codec.formats import tensor_nbytes, torch_dtype
from ..errors import BadInputError, CorruptArchiveError, MismatchError, SourceError, WriteError, block_error
from ..io import archive
from ..io.blocks import BlockRef, bytes_to_tensor
from ..io.lmcache_store import FORMS, FP8, FRAMES, HEADER_BYTES, RAW, ChunkFile, Layout, form_of
from ..io.paths import os_reason, printable, resolve, write_atomic
from ..io.restore import RestoreTask
from .frames import Fp8FrameSerializer
from .seed import Fp8QuantizationDeserializer, Fp8QuantizationSerializer


@dataclass(frozen=True)
class StoreConversion:
    """One store conversion, as every worker call of it needs it: read chunk files from
    ``source``, write them in the ``target`` form into ``scratch``. ``fp8`` is the format
    of LMCache's plain fp8 files (read and written); ``options`` the codec options of the
    frames written (and the non-finite policy of both writers)."""

    source: str
    scratch: str
    layout: Layout
    target: str
    fp8: str = "e4m3fn"
    options: CodecOptions = field(default_factory=CodecOptions)

    def __post_init__(self):
        if self.target not in FORMS:
            raise BadInputError(f"target form must be one of {list(FORMS)}, got {self.target!r}", field="target")


@dataclass(frozen=True)
class ConvertedFile:
    """One LMCache chunk file written: its name, the form it had, its sizes, and whether
    it was copied unchanged (already in the target form)."""

    name: str
    form: str
    bytes_in: int
    bytes_out: int
    copied: bool = False


def _read(path: str, size: int | None = None) -> bytearray:
    """A chunk file's bytes; ``size``: what the scan found (a file of another size has
    changed since)."""
    with open(path, "rb") as f:
        data = bytearray(size if size is not None else os.fstat(f.fileno()).st_size)
        got = f.readinto(data) + len(f.read(1))
    if size is not None and got != size:  # changed since the scan
        raise SourceError(f"{'fewer' if got < size else 'more'} bytes than the {size} the scan found")
    return data


def chunk_tensor(data: bytearray, form: str, layout: Layout, fp8_reader: Fp8QuantizationDeserializer) -> torch.Tensor:
    """A chunk file's tensor in the layout's dtype, read in its ``form``: raw bytes as
    they are, plain fp8 bytes through LMCache's deserializer (exact), a frame, checksum
    verified, through :func:`~fp8ray.codec.decode`, whatever its options (it describes itself)."""
    dtype = torch_dtype(layout.dtype)
    raw = torch.frombuffer(data, dtype=torch.uint8)
    if form == RAW:
        return raw.view(dtype).reshape(layout.shape)
    out = torch.empty(layout.shape, dtype=dtype)
    if form == FP8:
        fp8_reader.deserialize_tensors(raw, [out])
    else:
        decode(raw, out=out)
    return out


class _Converter:
    """The readers and writers of one conversion, built once per worker call."""

    def __init__(self, conversion: StoreConversion):
        self.c = conversion
        nonfinite = conversion.options.nonfinite
        self.fp8_reader = Fp8QuantizationDeserializer(conversion.fp8)
        self.fp8_writer = Fp8QuantizationSerializer(conversion.fp8, nonfinite)
        self.frame_writer = Fp8FrameSerializer(conversion.options)
        self.frame_header = frame.header_for(conversion.options, conversion.layout.dtype, conversion.layout.shape)

    def to_tensor(self, data: bytearray, form: str) -> torch.Tensor:
        return chunk_tensor(data, form, self.c.layout, self.fp8_reader)

    def from_tensor(self, x: torch.Tensor) -> memoryview:
        if self.c.target == RAW:
            return memoryview(x.reshape(-1).view(torch.uint8).numpy())
        writer = self.fp8_writer if self.c.target == FP8 else self.frame_writer
        out = torch.empty(writer.serialized_size([(x.shape, x.dtype)]), dtype=torch.uint8)
        n = writer.serialize_tensors([x], out)
        return memoryview(out[:n].numpy())

    def convert(self, chunk: ChunkFile) -> tuple[ConvertedFile, memoryview]:
        """The file's record and its bytes in the target form."""
        data = _read(os.path.join(self.c.source, chunk.name), chunk.size)
        # a frame in other codec options is not in the target form: the serde asked refuses it
        if chunk.form == self.c.target and (chunk.form != FRAMES or frame.parse_header(data) == self.frame_header):
            if chunk.form == FRAMES:
                frame.parse(frame.as_byte_array(data))  # nothing damaged is passed on
            payload, copied = memoryview(data), True
        else:
            payload, copied = self.from_tensor(self.to_tensor(data, chunk.form)), False
        return ConvertedFile(chunk.name, chunk.form, len(data), payload.nbytes, copied), payload

    def write(self, name: str, payload: memoryview) -> None:
        target = os.path.join(self.c.scratch, name)
        try:
            if "/" in name:  # in hash-prefix folders: the same folders in the output
                os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(payload)
        except OSError as exc:  # a full disk, above all: the destination's, not the chunk's
            raise WriteError(f"{name}: {os_reason(exc)}") from None


def convert_files(conversion: StoreConversion, chunks: list[ChunkFile]) -> list[ConvertedFile]:
    """Convert ``chunks`` from ``conversion.source`` into ``conversion.scratch``, each to
    the target form. A file that fails (non-finite values, a damaged frame, a file
    changed since the scan) raises, naming it; a failed write (a full disk) raises
    :class:`~fp8ray.errors.WriteError`, for the caller to name its destination."""
    converter = _Converter(conversion)
    done = []
    for chunk in chunks:
        try:
            converted, payload = converter.convert(chunk)
        except (ValueError, TypeError, OSError) as exc:
            where = f" ({chunk.form} -> {conversion.target} of {printable(os.path.join(conversion.source, chunk.name))})"
            raise block_error(chunk.name, exc, where) from exc
        converter.write(chunk.name, payload)
        done.append(converted)
    return done


# --- a store as an archive's source, and a store out of an archive --------------------


def encode_chunk_files(refs: list[BlockRef], codec: Fp8Codec, out: np.ndarray, sizes: list[int], threads: int = 1) -> None:
    """The frames of the chunk files ``refs`` (an archive part's blocks, each a whole
    file of an LMCache store: :mod:`fp8ray.io.store_source`), end to end into ``out``,
    ``sizes`` being their sizes in ``codec``'s options.

    Each file's form is found again from its bytes (:func:`~fp8ray.io.lmcache_store.form_of`,
    as the scan found it), and plain fp8 files are read in the codec's fp8 format, as
    ``lmcache-compress`` reads them. A frame already in the codec's options (an fp8ray
    serde store in the archive's mode) is kept as it is, checksum verified, so that
    archiving it adds no error; every other file is read into the layout's dtype and
    encoded. A file that fails (of no form, changed since the scan, a damaged frame,
    non-finite values) raises naming it."""
    options = codec.options
    fp8_reader = Fp8QuantizationDeserializer(options.fp8)
    start = 0
    for ref, size in zip(refs, sizes, strict=True):
        slot = out[start : start + size]
        start += size
        try:
            data = _read(ref.path)
            layout = Layout(ref.dtype, ref.shape)
            form, reason = form_of(layout, len(data), bytes(data[:HEADER_BYTES]))
            if form is None:
                raise SourceError(f"no longer a chunk file of the layout {layout}: {reason}")
            if form == FRAMES and frame.parse_header(data) == frame.header_for(options, layout.dtype, layout.shape):
                frame.parse(frame.as_byte_array(data))  # nothing damaged goes into the archive
                slot[:] = np.frombuffer(data, dtype=np.uint8)
            else:
                codec.encode(chunk_tensor(data, form, layout, fp8_reader), out=slot, threads=threads)
        except (ValueError, TypeError, OSError) as exc:
            raise block_error(ref.file, exc, f" (chunk file {printable(ref.path)})") from exc


@dataclass
class RestoredFiles:
    """What :func:`restore_chunk_files` wrote."""

    files: int = 0
    raw_bytes: int = 0


def restore_chunk_files(
    archive_uri: str, parts: dict[int, archive.Part], task: RestoreTask, directory: str, form: str, threads: int = 1
) -> RestoredFiles:
    """Write the chunk files of ``task`` (one block each) into ``directory`` (local path or
    URI) in ``form``: ``"raw"``, the frame decoded into the layout's dtype (what LMCache
    with no serde stores), or ``"fp8ray"``, the archive's frame as it is, checksum
    verified (what the ``fp8ray`` serde in the archive's codec options stores). Each part
    is checked against its CRC-32C once; each file is written under a temporary name and
    renamed, hash-prefix folders and all. A damaged part or frame raises, naming the file."""
    if form not in (RAW, FRAMES):
        raise BadInputError(f"an LMCache store comes back in form 'raw' or 'fp8ray', not {form!r}", field="lmcache_form")
    fs, path = resolve(archive_uri)
    out_fs, out_dir = resolve(directory)
    local = isinstance(out_fs, pafs.LocalFileSystem)
    last_use = {p: i for i, f in enumerate(task.files) for p, *_ in f.blocks}
    frames: dict[int, list] = {}
    done = RestoredFiles()
    for i, f in enumerate(task.files):
        if len(f.blocks) != 1:
            raise CorruptArchiveError(
                f"the archive records {len(f.blocks)} blocks of chunk file {f.name}, a chunk file holds one"
            )
        ((part, row, key, dtype, shape),) = f.blocks
        if part not in frames:
            table = archive.read_part(fs, path, parts[part], columns=["frame"], uri=archive_uri)
            frames[part] = list(archive.iter_frames(table))
        try:
            data = frame.as_byte_array(frames[part][row])
            header = frame.parse(data)
            if (header.dtype, header.shape) != (dtype, tuple(shape)):
                raise MismatchError(
                    f"the frame holds {list(header.shape)} {header.dtype}, the part's columns say {list(shape)} {dtype}"
                )
            if form == RAW:
                nbytes = header.tensor_nbytes
                payload = np.empty(nbytes, np.uint8)
                decode(data, out=bytes_to_tensor(payload, dtype, shape), threads=threads)
            else:
                payload = data
        except (ValueError, TypeError) as exc:
            raise block_error(f.name, exc, f" in {parts[part].name}") from exc
        target = f"{out_dir}/{f.name}"
        if local and "/" in f.name:
            out_fs.create_dir(posixpath.dirname(target), recursive=True)
        write_atomic(out_fs, target, payload)
        done.files += 1
        done.raw_bytes += tensor_nbytes(dtype, shape)
        for p in [p for p, last in last_use.items() if last == i and p in frames]:
            del frames[p]  # not needed by the files still to write
    return done
