"""HTTP bodies of the online service: safetensors bodies of many blocks, parsed and built
in memory.

A safetensors body is 8 bytes of little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes. Nothing here unpickles anything,
and every entry is checked against the body before a byte of it is used.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np

from .sources import MAX_HEADER, SAFETENSORS_DTYPES, SAFETENSORS_NAMES, TORCH_DTYPES, TORCH_NAMES

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
    entries = []
    for key, entry in header.items():
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError) as exc:
            raise BodyError(f"tensor {key!r}: malformed safetensors header entry", field=key) from exc
        if dtype_name not in allowed:
            raise BodyError(f"tensor {key!r} has dtype {dtype_name}; expected one of {list(allowed)}", field=key)
        itemsize = 1 if dtype_name == FRAME_DTYPE else SAFETENSORS_DTYPES[dtype_name].itemsize
        expected = math.prod(shape) * itemsize
        if any(d < 0 for d in shape) or begin < 0 or end - begin != expected or end > len(data):
            raise BodyError(
                f"tensor {key!r} claims bytes [{begin}, {end}) for shape {list(shape)} {dtype_name} "
                f"({expected} bytes) in a data section of {len(data)} bytes",
                field=key,
            )
        dtype = "uint8" if dtype_name == FRAME_DTYPE else TORCH_NAMES[SAFETENSORS_DTYPES[dtype_name]]
        entries.append((begin, key, dtype, shape, data[begin:end]))
    entries.sort(key=lambda e: e[0])
    return [e[1:] for e in entries], metadata


def build_safetensors(entries: list[tuple[str, str, tuple[int, ...], np.ndarray | bytes]], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors body of ``(key, dtype, shape, bytes)`` entries, in order; ``dtype`` is
    an fp8ray dtype name or ``"uint8"`` (a frame)."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, dtype, shape, data in entries:
        nbytes = len(memoryview(data).cast("B"))
        name = FRAME_DTYPE if dtype == "uint8" else SAFETENSORS_NAMES[TORCH_DTYPES[dtype]]
        header[key] = {"dtype": name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data 8-byte aligned, as safetensors writes it
    return b"".join([struct.pack("<Q", len(raw)), raw, *(memoryview(d).cast("B") for _, _, _, d in entries)])
