"""HTTP bodies of the online service: safetensors bodies of many blocks, parsed and built
in memory.

A safetensors body is 8 bytes of little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes. Nothing here unpickles anything,
and every entry is checked against the body before a byte of it is used.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from .sources import (
    MAX_HEADER,
    SAFETENSORS_DTYPES,
    SAFETENSORS_NAMES,
    TORCH_DTYPES,
    TORCH_NAMES,
    SafetensorsEntryError,
    safetensors_entries,
    safetensors_prefix,
)

# Frames travel in safetensors bodies as 1-D U8 tensors.
FRAME_DTYPE = "U8"


class BodyError(ValueError):
    """A request body is malformed; ``field`` names what was wrong, for the JSON answer."""

    def __init__(self, message: str, field: str = "body"):
        super().__init__(message)
        self.field = field


def parse_safetensors(body: bytes | memoryview, allowed: tuple[str, ...]) -> tuple[list[tuple[str, str, tuple[int, ...], np.ndarray]], dict]:
    """Split a safetensors body into ``(key, dtype, shape, uint8 view)`` entries in byte
    order, and its ``__metadata__``. ``allowed`` are the safetensors dtype names accepted
    (``"BF16"``, ``"F16"``, ``"F32"``, ``"U8"``); ``dtype`` comes back as fp8ray names the
    torch dtypes (``"bfloat16"``, ...) and ``"uint8"`` for U8."""
    view = memoryview(body).cast("B")
    if len(view) < 8:
        raise BodyError(f"a safetensors body needs at least 8 bytes, got {len(view)}")
    (header_len,) = struct.unpack_from("<Q", view, 0)
    if header_len > min(MAX_HEADER, len(view) - 8):
        raise BodyError(f"safetensors header length {header_len} exceeds the body ({len(view)} bytes)")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BodyError(f"safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise BodyError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data = np.frombuffer(view, dtype=np.uint8, offset=8 + header_len)
    try:
        entries = safetensors_entries(header, len(data), allowed)
    except SafetensorsEntryError as exc:
        raise BodyError(str(exc), field=exc.key) from exc
    return [(key, _dtype(name), shape, data[begin:end]) for key, name, shape, begin, end in entries], metadata


def _dtype(safetensors_name: str) -> str:
    """fp8ray's name of a safetensors dtype: a torch dtype's name, or "uint8" for a frame."""
    return "uint8" if safetensors_name == FRAME_DTYPE else TORCH_NAMES[SAFETENSORS_DTYPES[safetensors_name]]


def build_safetensors(entries: list[tuple[str, str, tuple[int, ...], np.ndarray | bytes]], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors body of ``(key, dtype, shape, bytes)`` entries, in order; ``dtype`` is
    an fp8ray dtype name or ``"uint8"`` (a frame)."""
    views = [memoryview(data).cast("B") for _, _, _, data in entries]
    prefix = safetensors_prefix(
        [(key, FRAME_DTYPE if dtype == "uint8" else SAFETENSORS_NAMES[TORCH_DTYPES[dtype]], shape, len(view))
         for (key, dtype, shape, _), view in zip(entries, views)],
        metadata,
    )
    return b"".join([prefix, *views])
