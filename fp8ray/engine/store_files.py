"""The per-file work of converting an LMCache filesystem store, as a ``QuantWorker`` runs
it (:meth:`fp8ray.engine.worker.QuantWorker.convert_store_files`); the driver side is
:mod:`fp8ray.engine.stores`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..codec.formats import DTYPES_BY_NAME
from ..codec.lmcache import Fp8QuantizationDeserializer, Fp8QuantizationSerializer
from ..errors import block_error
from ..io.lmcache_store import Layout


@dataclass(frozen=True)
class ConvertedFile:
    """One LMCache chunk file converted: its name and sizes."""

    name: str
    bytes_in: int
    bytes_out: int


def convert_files(mode: str, source: str, scratch: str, names: list[str], layout: Layout, fp8: str) -> list[ConvertedFile]:
    """Convert chunk files from ``source`` into ``scratch``: ``"compress"`` from the
    layout's dtype to LMCache's plain fp8 bytes, ``"decompress"`` back. A file that
    fails raises, naming it."""
    dtype = DTYPES_BY_NAME[layout.dtype]
    serializer = Fp8QuantizationSerializer(fp8) if mode == "compress" else None
    deserializer = Fp8QuantizationDeserializer(fp8) if mode == "decompress" else None
    expected = layout.raw_bytes if mode == "compress" else layout.numel
    done = []
    for name in names:
        try:
            data = bytearray(expected)
            with open(os.path.join(source, name), "rb") as f:
                size = f.readinto(data) + len(f.read(1))
            if size != expected:  # changed since the scan
                raise ValueError(f"{'fewer' if size < expected else 'more'} bytes than the layout's {expected}")
            raw = torch.frombuffer(data, dtype=torch.uint8)
            if serializer is not None:
                dst = torch.empty(layout.numel, dtype=torch.uint8)
                serializer.serialize(SimpleNamespace(tensor=raw.view(dtype).reshape(layout.shape)), SimpleNamespace(tensor=dst))
            else:
                dst = torch.empty(layout.shape, dtype=dtype)
                deserializer.deserialize(SimpleNamespace(tensor=raw), SimpleNamespace(tensor=dst))
            payload = dst.reshape(-1).view(torch.uint8).numpy()
            with open(os.path.join(scratch, name), "wb") as f:
                f.write(memoryview(payload))
        except (ValueError, TypeError, OSError) as exc:
            raise block_error(name, exc, f" ({mode} of {os.path.join(source, name)})") from exc
        done.append(ConvertedFile(name, len(data), int(payload.size)))
    return done
