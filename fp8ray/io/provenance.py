"""What a cache was made for (model, revision, KV layout): recorded by ``compress`` in an
archive's manifest, checked by whoever loads it (``open_archive(expect=...)``,
``decompress --expect-model``...). No heavy import: the command line's flags are its fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from ..errors import CorruptArchiveError, InvalidOptionError, MismatchError

SHOWN_CHARS = 60  # the most of a value from outside an error message shows


def short_repr(value: object) -> str:
    """``repr(value)``, cut to :data:`SHOWN_CHARS` characters: a bad value as an error message shows it."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


@dataclass(frozen=True)
class Provenance:
    """What a cache was made for: the model's name, its revision and the KV layout, each
    optional and free text (as the user names them: ``"meta-llama/Llama-3.1-8B"``,
    a commit, ``"[2,L,T,H] bf16"``). Compared for equality only, never interpreted."""

    model: str | None = None
    revision: str | None = None
    kv_layout: str | None = None

    def __post_init__(self):
        for name, value in self.recorded().items():
            if not isinstance(value, str) or not value or not value.isprintable():
                raise InvalidOptionError(
                    f"provenance {name!r} must be a non-empty printable string, got {short_repr(value)}", field=name
                )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def parse(cls, given: Provenance | Mapping[str, object] | None) -> Provenance:
        """A provenance from a mapping of some of :meth:`names` (``None`` values left
        out); an unknown name raises :class:`InvalidOptionError` naming it."""
        if isinstance(given, Provenance):
            return given
        if given is not None and not isinstance(given, Mapping):
            raise InvalidOptionError(
                f"provenance must be a mapping of some of {list(cls.names())} (or a Provenance), got {type(given).__name__}",
                field="provenance",
            )
        values = {k: v for k, v in dict(given or {}).items() if v is not None}
        for name in values:
            if name not in cls.names():
                raise InvalidOptionError(f"unknown provenance field {name!r}; expected some of {list(cls.names())}", field=name)
        return cls(**values)

    def recorded(self) -> dict[str, str]:
        """The fields given, by name (``{}``: none)."""
        return {name: getattr(self, name) for name in self.names() if getattr(self, name) is not None}

    @classmethod
    def from_json(cls, obj: object, label: str) -> Provenance:
        if not isinstance(obj, dict):
            raise CorruptArchiveError(f"{label} is {short_repr(obj)}, not an object")
        unknown = sorted(set(obj) - set(cls.names()))
        if unknown:
            raise CorruptArchiveError(f"{label} holds {unknown[0]!r}, not one of {list(cls.names())}")
        for name, value in obj.items():
            if not isinstance(value, str):
                raise CorruptArchiveError(f"{label}'s {name!r} is {short_repr(value)}, not a string")
        try:
            return cls(**obj)
        except InvalidOptionError as exc:
            raise CorruptArchiveError(f"{label}: {exc}") from None

    def to_json(self) -> dict[str, str]:
        return self.recorded()

    def describe(self) -> str:
        """``"model 'm', revision 'r'"``: the fields given, as messages name them."""
        return ", ".join(f"{name.replace('_', ' ')} {value!r}" for name, value in self.recorded().items())


def check_provenance(recorded: Provenance | None, expect: Provenance | Mapping[str, object] | None, what: str) -> None:
    """Refuse, with a one-line :class:`MismatchError` naming the field, ``what`` (an
    archive or store, as messages name it) whose ``recorded`` provenance differs from
    ``expect`` in any field ``expect`` gives, or lacks it. Nothing expected: no check."""
    wanted = Provenance.parse(expect).recorded()
    if not wanted:
        return
    name, value = next(iter(wanted.items()))
    if recorded is None or not recorded.recorded():
        raise MismatchError(f"{what} records no provenance, expected {name.replace('_', ' ')} {value!r}", field=name)
    for name, value in wanted.items():
        has = getattr(recorded, name)
        shown = name.replace("_", " ")
        if has is None:
            raise MismatchError(f"{what} records no {shown}, expected {shown} {value!r}", field=name)
        if has != value:
            raise MismatchError(f"{what} was made for {shown} {has!r}, expected {shown} {value!r}", field=name)
