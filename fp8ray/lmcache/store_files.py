"""The per-file work of converting an LMCache filesystem store, as a ``QuantWorker`` runs
it (:meth:`fp8ray.engine.worker.QuantWorker.convert_store_files`); the driver side is
:mod:`fp8ray.engine.stores`, the forms a chunk file takes :mod:`fp8ray.io.lmcache_store`.

Each file goes through the layout's dtype: read in its form (raw bytes; LMCache's plain
fp8 bytes through :class:`~fp8ray.lmcache.Fp8QuantizationDeserializer`; an fp8ray frame,
checksum verified, through :func:`~fp8ray.codec.decode`), then written in the target
form by the serializer an LMCache with that serde uses (:class:`~fp8ray.lmcache.Fp8QuantizationSerializer`
for ``fp8``, :class:`~fp8ray.lmcache.Fp8FrameSerializer` for ``fp8ray``), so the output
is byte for byte what LMCache would have stored. A file already in the target form is
copied unchanged (a frame after its checksum is verified).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..codec import CodecOptions, decode, frame
from ..codec.formats import DTYPES_BY_NAME
from ..errors import BadInputError, SourceError, block_error
from ..io.lmcache_store import FORMS, FP8, FRAMES, RAW, ChunkFile, Layout
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


def _read(path: str, size: int) -> bytearray:
    data = bytearray(size)
    with open(path, "rb") as f:
        got = f.readinto(data) + len(f.read(1))
    if got != size:  # changed since the scan
        raise SourceError(f"{'fewer' if got < size else 'more'} bytes than the {size} the scan found")
    return data


class _Converter:
    """The readers and writers of one conversion, built once per worker call."""

    def __init__(self, conversion: StoreConversion):
        self.c = conversion
        self.dtype = DTYPES_BY_NAME[conversion.layout.dtype]
        nonfinite = conversion.options.nonfinite
        self.fp8_reader = Fp8QuantizationDeserializer(conversion.fp8)
        self.fp8_writer = Fp8QuantizationSerializer(conversion.fp8, nonfinite)
        self.frame_writer = Fp8FrameSerializer(conversion.options)

    def to_tensor(self, data: bytearray, form: str) -> torch.Tensor:
        layout = self.c.layout
        raw = torch.frombuffer(data, dtype=torch.uint8)
        if form == RAW:
            return raw.view(self.dtype).reshape(layout.shape)
        out = torch.empty(layout.shape, dtype=self.dtype)
        if form == FP8:
            self.fp8_reader.deserialize_tensors(raw, [out])
        else:  # one frame, whatever its options: it describes itself
            decode(raw, out=out)
        return out

    def from_tensor(self, x: torch.Tensor) -> memoryview:
        if self.c.target == RAW:
            return memoryview(x.reshape(-1).view(torch.uint8).numpy())
        writer = self.fp8_writer if self.c.target == FP8 else self.frame_writer
        out = torch.empty(writer.serialized_size([(x.shape, x.dtype)]), dtype=torch.uint8)
        n = writer.serialize_tensors([x], out)
        return memoryview(out[:n].numpy())

    def convert(self, chunk: ChunkFile) -> ConvertedFile:
        data = _read(os.path.join(self.c.source, chunk.name), chunk.size)
        if chunk.form == self.c.target:
            if chunk.form == FRAMES:
                frame.parse(frame.as_byte_array(data))  # nothing damaged is passed on
            payload, copied = memoryview(data), True
        else:
            payload, copied = self.from_tensor(self.to_tensor(data, chunk.form)), False
        with open(os.path.join(self.c.scratch, chunk.name), "wb") as f:
            f.write(payload)
        return ConvertedFile(chunk.name, chunk.form, len(data), payload.nbytes, copied)


def convert_files(conversion: StoreConversion, chunks: list[ChunkFile]) -> list[ConvertedFile]:
    """Convert ``chunks`` from ``conversion.source`` into ``conversion.scratch``, each to
    the target form. A file that fails (non-finite values, a damaged frame, a file
    changed since the scan) raises, naming it."""
    converter = _Converter(conversion)
    done = []
    for chunk in chunks:
        try:
            done.append(converter.convert(chunk))
        except (ValueError, TypeError, OSError) as exc:
            where = f" ({chunk.form} -> {conversion.target} of {os.path.join(conversion.source, chunk.name)})"
            raise block_error(chunk.name, exc, where) from exc
    return done
