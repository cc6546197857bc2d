"""What an LMCache adapter's ``"serde"`` kwargs ask of fp8ray's registered serde type:
the codec options, ``max_workers`` and ``fp8_input``, each checked by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from ..codec.options import CodecOptions
from ..errors import BadInputError, InvalidOptionError
from ..io.provenance import Provenance
from .frames import check_fp8_input

SERDE_KWARGS = (*CodecOptions.names(), "max_workers", "fp8_input")


class SerdeSettings(NamedTuple):
    """What an adapter's ``"serde"`` kwargs ask of the registered type."""

    options: CodecOptions
    max_workers: int = 1
    fp8_input: str = "refuse"


def serde_options(kwargs: Mapping[str, object] | None = None) -> SerdeSettings:
    """The codec options, ``max_workers`` and ``fp8_input`` from an adapter's ``"serde"``
    kwargs (the JSON object less its ``"type"``). None given: the default mode, one
    worker thread, as LMCache's own serdes, and 1-byte sources refused. An unknown key
    or a bad value raises :class:`~fp8ray.errors.InvalidOptionError` (a ``ValueError``)
    naming it."""
    values = kwargs_dict(kwargs)
    for name in values:
        if name in Provenance.names():  # asked for by users of archives' provenance: say why not here
            raise InvalidOptionError(
                f"the fp8ray serde takes no {name!r}: a frame records no provenance (LMCache's object keys name the model; "
                f"each frame's dtype and shape are checked against the tensor it is read into); docs/LMCACHE.md, 'Provenance'",
                field=name,
            )
        if name not in SERDE_KWARGS:
            raise InvalidOptionError(
                f"unknown option {name!r} of the fp8ray serde; expected some of {list(SERDE_KWARGS)}", field=name
            )
    max_workers = values.pop("max_workers", 1)
    if isinstance(max_workers, str) and max_workers.isascii() and max_workers.isdigit():
        max_workers = int(max_workers)
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise InvalidOptionError(f"max_workers must be a positive integer, got {max_workers!r}", field="max_workers")
    fp8_input = values.pop("fp8_input", "refuse")
    check_fp8_input(fp8_input)
    return SerdeSettings(CodecOptions.parse(values), max_workers, fp8_input)


def kwargs_dict(kwargs: Mapping[str, object] | None) -> dict:
    """A serde factory's kwargs as a new dict; anything but a mapping (a JSON list or
    string where the adapter's config wants an object) raises :class:`BadInputError`."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise BadInputError(
            f"a serde's kwargs must be a mapping of option names to values (a JSON object), got {type(kwargs).__name__} "
            f"{kwargs!r:.80}"
        )
    return dict(kwargs)
