"""What the service makes of a request, without Serve: options, layouts, bodies, and the
HTTP status and JSON answer of every refusal. Tested on its own (tests/serve)."""

from __future__ import annotations

from collections.abc import Mapping

from ..codec import CodecOptions
from ..codec.formats import DTYPE_ITEMSIZES, tensor_nbytes
from ..codec.fp8codec import KEEP_HINT
from ..codec.frame import MAX_DIM, check_shape
from ..errors import (
    BadInputError,
    BlockError,
    CorruptDataError,
    NonFiniteError,
    RequestError,
    WorkerLostError,
)
from ..io.provenance import SHOWN_CHARS, short_repr

OCTET_STREAM = "application/octet-stream"
SAFETENSORS = "application/x-safetensors"
# Codec options a request may set: all but the non-finite policy (a service never
# stores NaN silently).
REQUEST_OPTIONS = tuple(name for name in CodecOptions.names() if name != "nonfinite")


def codec_options(params: Mapping[str, str], ignore: tuple[str, ...] = ()) -> CodecOptions:
    """Codec options from query parameters (the default mode for those left out); an
    unknown or bad one raises :class:`RequestError` 400 naming it."""
    given = {name: value for name, value in params.items() if name not in ignore}
    for name in given:
        if name not in REQUEST_OPTIONS:
            raise unknown_name("option", name, f"; expected one of {sorted((*REQUEST_OPTIONS, *ignore))}")
    try:
        return CodecOptions.parse(given)
    except BadInputError as exc:
        raise RequestError(str(exc), 400, exc.field) from None


def unknown_name(kind: str, name: str, why: str) -> RequestError:
    """The 400 answer to a query parameter ``name`` the route does not take (``kind``:
    "option" or "parameter"; ``why``: the rest of the message), the name cut short in
    both message and ``field``: a name of any length must keep the answer in its bound."""
    return RequestError(f"unknown {kind} {short_repr(name)}{why}", 400, name[:SHOWN_CHARS])


def raw_layout(dtype: str | None, shape: str | None, body_bytes: int) -> tuple[str, tuple[int, ...]]:
    """The dtype and shape query parameters of a raw encode, checked against the body."""
    names = sorted(DTYPE_ITEMSIZES)
    if dtype is None:
        raise RequestError(
            f"dtype is required for a raw body; one of {names} (a safetensors body is sent with Content-Type: {SAFETENSORS})",
            400,
            "dtype",
        )
    dtype = dtype.removeprefix("torch.")
    if dtype not in DTYPE_ITEMSIZES:
        raise RequestError(f"unknown dtype {dtype!r}; expected one of {names}", 400, "dtype")
    if shape is None:
        raise RequestError("shape is required, as comma-separated sizes such as 2,30,256,192", 400, "shape")
    parts = [d.strip() for d in shape.split(",")] if shape.strip() else []
    if any(d.startswith("-") and d[1:].isascii() and d[1:].isdigit() for d in parts):
        raise RequestError(f"shape {shape!r} has a negative size", 400, "shape")
    if not all(d.isascii() and d.isdigit() for d in parts):  # int() would take "1_6", "+16" and other digits
        raise RequestError(f"shape {shape!r} is not comma-separated integers", 400, "shape")
    longest = max(map(len, parts), default=0)
    if longest > len(str(MAX_DIM)):  # int() of over 4300 digits would raise Python's own error
        raise RequestError(f"shape has a size of {longest} digits; a frame holds sizes of 0 to {MAX_DIM}", 400, "shape")
    dims = tuple(int(d) for d in parts)
    try:
        check_shape(dims, dtype)
    except ValueError as exc:
        raise RequestError(str(exc), 400, "shape") from None
    expected = tensor_nbytes(dtype, dims)
    if expected != body_bytes:
        raise RequestError(f"shape {list(dims)} of {dtype} needs {expected} bytes but the body has {body_bytes}", 400, "shape")
    return dtype, dims


# Every response is bounded by its request: at most MAX_EXPANSION bytes per byte of body
# and query string, plus RESPONSE_SLACK, plus the bytes it carries that its request does
# not give: an encode's frames, which the request's shapes give before any work (an empty
# tensor still has a scale per channel or row: [0, 10**6] under channel scaling is a 4 MB
# frame of a 0-byte body); an archive read's block and its file's metadata. Derived:
# decoding turns each 1-byte code into at most 4 bytes (float32), a stored frame's bytes
# into as many (its header and checksum, 20 bytes and more, are dropped), and a frame's shape
# bytes (8 per dimension) into at most 21 characters of JSON; each dimension of a shape,
# at least 2 characters of query or JSON, becomes 8 bytes of frame header; what is left
# (JSON per tensor, a frame's 20 fixed bytes) is below 5x the request's own JSON per
# tensor, and the slack covers a response's fixed headers.
MAX_EXPANSION = 5
RESPONSE_SLACK = 1024


def response_limit(request_bytes: int, carried_bytes: int = 0) -> int:
    """The most bytes a response to a request of ``request_bytes`` (body and query) holds,
    one that carries ``carried_bytes`` its request does not give (frames it encodes into,
    a block it reads)."""
    return MAX_EXPANSION * request_bytes + RESPONSE_SLACK + carried_bytes


def single_params(counts: Mapping[str, int]) -> None:
    """Refuse a query that gives a parameter more than once (``counts``: how many times
    each is given): only one of them would be read, the body misread under it."""
    for name, count in counts.items():
        if count > 1:
            raise RequestError(
                f"query parameter {short_repr(name)} is given {count} times; give it once", 400, name[:SHOWN_CHARS]
            )


def split(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous groups of near-equal count (order kept)."""
    if not items:
        raise RequestError("the safetensors body holds no tensors", 400, "body")
    parts = max(1, min(parts, len(items)))
    size = -(-len(items) // parts)
    return [items[i : i + size] for i in range(0, len(items), size)]


def is_safetensors(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() == SAFETENSORS


def refusal(exc: BaseException) -> tuple[int, str, str | None] | None:
    """``(status, message, field)`` of the answer to a request that raised ``exc``, or
    ``None`` for an exception that is a bug (answered 500 without its details).

    400: the request itself is malformed (options, layout, safetensors body). 422: a
    block's data cannot be processed (non-finite values, a corrupt frame, a shape no
    frame holds). 503: no worker answered.
    """
    if isinstance(exc, RequestError):
        return exc.status, str(exc), exc.field
    if isinstance(exc, WorkerLostError):
        return 503, str(exc), None
    if isinstance(exc, NonFiniteError):  # its hint names an option the service does not take
        return 422, str(exc).replace(KEEP_HINT, " (the service stores none)"), "body"
    if isinstance(exc, (CorruptDataError, BlockError)):
        return 422, str(exc), "body"
    if isinstance(exc, BadInputError):
        return 400, str(exc), exc.field
    return None
