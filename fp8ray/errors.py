"""Every exception fp8ray raises of its own, grouped by failure class.

Each class derives from :class:`Fp8rayError` and from the builtin a caller would catch
without knowing fp8ray (``ValueError``, ``FileExistsError``, ``RuntimeError``), so
``except ValueError`` keeps working and ``except fp8ray.errors.BadInputError`` is
precise. Errors raised inside a ``QuantWorker`` reach the driver as these same classes
(``QuantPool`` re-raises the worker's exception, not Ray's wrapper).

An argument of the wrong type (a list where a tensor belongs) raises the builtin
``TypeError``, as in any library.

=================  =========================================================================
failure class      classes
=================  =========================================================================
bad input          :class:`BadInputError` and its :class:`InvalidOptionError`,
                   :class:`BlockError`, :class:`SafetensorsFormatError`,
                   :class:`DestinationError`, :class:`MismatchError`;
                   :class:`ArchiveExistsError` (a ``FileExistsError``)
corrupt data       :class:`CorruptDataError` and its :class:`CorruptFrameError`,
                   :class:`CorruptArchiveError`
non-finite values  :class:`NonFiniteError`
source             :class:`SourceError`
worker loss        :class:`WorkerLostError` and its :class:`PoolStartError`,
                   :class:`WorkersUnavailableError`
service            :class:`RequestError` (an HTTP status and the field at fault)
=================  =========================================================================
"""

from __future__ import annotations


class Fp8rayError(Exception):
    """Base class of every exception fp8ray defines."""


# --- bad input ----------------------------------------------------------------------


class BadInputError(Fp8rayError, ValueError):
    """Input that fp8ray refuses: a block it cannot encode, a malformed file, a bad
    option or destination. ``field`` names what was wrong where that is one thing (an
    option, a tensor's key), for the service's JSON answer."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # keep ``field`` across pickling (Ray)
        return type(self), (str(self), self.field)


class BlockError(BadInputError):
    """One block could not be processed; the message starts with the block's key."""


class InvalidOptionError(BadInputError):
    """A codec or service option is unknown or has a bad value; ``field`` names it."""


class SafetensorsFormatError(BadInputError):
    """A safetensors file or body is malformed; ``field`` names the tensor's key, or
    ``"header"``/``"body"``."""


class DestinationError(BadInputError):
    """A destination cannot be written as asked: it overlaps the source, its parent is
    missing, it is the wrong kind of file, or a write to it failed (a full disk)."""


class WriteError(DestinationError):
    """A worker could not write one file of a destination (an archive's part, a store's
    chunk file): the message names the file and the system's reason, and the driver names
    the destination."""


class MismatchError(BadInputError):
    """Two things compared do not correspond: an archive and the source it is checked
    against hold other keys, shapes or dtypes, or a decoded block strays past its bound."""


class ArchiveExistsError(Fp8rayError, FileExistsError):
    """The destination already exists (``--overwrite`` replaces it, ``--resume`` continues)."""


# --- corrupt data -------------------------------------------------------------------


class CorruptDataError(Fp8rayError, ValueError):
    """Stored bytes are damaged, truncated or inconsistent."""


class CorruptFrameError(CorruptDataError):
    """A frame is truncated, malformed or fails its checksum."""


class CorruptArchiveError(CorruptDataError):
    """An archive is incomplete, or a part or frame in it is damaged."""


# --- non-finite values --------------------------------------------------------------


class NonFiniteError(Fp8rayError, ValueError):
    """The input holds NaN or infinity and the codec was asked to refuse it."""


# --- sources ------------------------------------------------------------------------


class SourceError(Fp8rayError, ValueError):
    """A source is missing, unreadable or malformed."""


# --- worker loss --------------------------------------------------------------------


class WorkerLostError(Fp8rayError, RuntimeError):
    """A shard's worker died more times than the pool retries."""


class PoolStartError(WorkerLostError):
    """The pool's workers did not start: no Ray cluster answers at the address, or the
    cluster lacks the resources asked for."""


class WorkersUnavailableError(WorkerLostError):
    """No QuantWorker of the service answered a request, even after the one retry."""


# --- service ------------------------------------------------------------------------


class RequestError(Fp8rayError, ValueError):
    """A request the service refuses: ``status`` is the HTTP status to answer, ``field``
    the query parameter, header or tensor key at fault."""

    def __init__(self, message: str, status: int = 400, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field

    def __reduce__(self):
        return type(self), (str(self), self.status, self.field)


def block_error(key: str, exc: Exception, where: str = "") -> Exception:
    """The error to raise when block ``key`` failed with ``exc``: fp8ray's own class kept,
    with the key in front of its message; any other ``ValueError``, ``TypeError`` or
    ``OSError`` becomes a :class:`BlockError`."""
    message = f"block {key!r}{where}: {exc}"
    if isinstance(exc, BadInputError):
        return type(exc)(message, field=exc.field or key)
    if isinstance(exc, RequestError):
        return type(exc)(message, exc.status, exc.field)
    if isinstance(exc, Fp8rayError):
        try:
            return type(exc)(message)
        except TypeError:  # a class with a richer constructor
            pass
    return BlockError(message, field=key)
