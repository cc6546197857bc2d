"""``CodecOptions``: the one place codec options are defined, checked, defaulted and parsed.

The default mode is the one measured best on a real model's KV cache (BENCHMARKS.md,
``fp8ray eval-model`` on SmolLM2): e4m3fn, 32-element blocks, bfloat16 scales chosen
by least squared error. Every entry point (``Fp8Codec()``, the archive commands, the
engine, the service, the demo) starts from it, and an option given overrides only
itself: ``CodecOptions(scaling="token")`` is token scaling with bfloat16 scales chosen
by least squared error. ``scale_choice`` left out means ``"mse"`` where the scaling can
search (token and block) and ``"amax"`` elsewhere, so ``scaling="tensor"`` alone is valid;
over options whose ``scale_choice`` was given (:meth:`CodecOptions.parse`'s ``base``,
:meth:`CodecOptions.replace`), a new ``scaling`` keeps that choice.

Parsed from keyword arguments or query parameters (:meth:`CodecOptions.parse`), from
mode strings ``FP8:SCALING[:key=value...]`` (:meth:`CodecOptions.from_mode`), and from
a manifest's ``codec`` record (:meth:`CodecOptions.parse` too). Bad values raise
:class:`~fp8ray.errors.InvalidOptionError` (a ``ValueError``) naming the option.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from ..errors import InvalidOptionError
from .formats import Fp8Format, get_format, is_torch_dtype
from .names import CHOICES, DEFAULT_MODE, SEARCHED_SCALINGS, default_scale_choice, mode_label

MAX_BLOCK_SIZE = 2**32 - 1  # the frame stores it in a uint32


@dataclass(frozen=True)
class CodecOptions:
    """How :class:`~fp8ray.codec.Fp8Codec` encodes; the scale convention is in
    :mod:`fp8ray.codec.formats`.

    Attributes:
        fp8: ``"e4m3fn"`` (more precision, range +-448) or ``"e5m2"`` (range +-57344,
            keeps inf). Torch dtypes and ``"float8_..."`` names are accepted and stored
            by name.
        scaling: ``"none"`` (clamped cast), ``"tensor"``, ``"channel"`` (per index of the
            last dimension), ``"token"`` (per row of the last dimension) or ``"block"``
            (per ``block_size`` contiguous elements).
        block_size: group length under block scaling (ignored by the others).
        scale_dtype: ``"float32"`` or ``"bfloat16"`` (each scale truncated to bfloat16
            before quantizing, so it is exact); scaling ``none`` stores no scales.
        scale_choice: ``"amax"`` (``scale = amax / finfo.max``) or ``"mse"`` (token and
            block: the least-squared-error scale of 8 candidates; 2.6-3.2x the encode
            kernel's time, decoding unchanged). ``None``: ``"mse"`` where it applies, else ``"amax"``.
        nonfinite: ``"error"`` refuses NaN and inf (:class:`~fp8ray.errors.NonFiniteError`);
            ``"keep"`` stores them (inf as NaN in e4m3fn, which has no inf).
    """

    fp8: str = DEFAULT_MODE["fp8"]
    scaling: str = DEFAULT_MODE["scaling"]
    block_size: int = DEFAULT_MODE["block_size"]
    scale_dtype: str = DEFAULT_MODE["scale_dtype"]
    scale_choice: str | None = DEFAULT_MODE["scale_choice"]
    nonfinite: str = DEFAULT_MODE["nonfinite"]

    def __post_init__(self):
        try:
            fmt = get_format(self.fp8)
        except ValueError as exc:
            raise InvalidOptionError(f"fp8: {exc}", field="fp8") from None
        object.__setattr__(self, "fp8", fmt.name)
        for name in ("scaling", "scale_dtype", "nonfinite"):
            _check_choice(name, getattr(self, name))
        block_size = self.block_size
        if isinstance(block_size, np.integer):  # numpy's ints (np.int64(32)) are ints here
            block_size = int(block_size)
            object.__setattr__(self, "block_size", block_size)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= MAX_BLOCK_SIZE:
            raise InvalidOptionError(
                f"block_size must be a positive integer (at most {MAX_BLOCK_SIZE}), got {block_size!r}", field="block_size"
            )
        # Whether scale_choice was left out (not a field: equal options may differ in it),
        # so that options made over these derive it again for a new scaling, and keep it
        # where it was given.
        object.__setattr__(self, "_scale_choice_derived", self.scale_choice is None)
        if self.scale_choice is None:
            object.__setattr__(self, "scale_choice", default_scale_choice(self.scaling))
        _check_choice("scale_choice", self.scale_choice)
        if self.scale_choice != "amax" and self.scaling not in SEARCHED_SCALINGS:
            raise InvalidOptionError(
                f"scale_choice {self.scale_choice!r} needs scaling {' or '.join(map(repr, SEARCHED_SCALINGS))}, "
                f"not {self.scaling!r}",
                field="scale_choice",
            )

    @property
    def fmt(self) -> Fp8Format:
        return get_format(self.fp8)

    def replace(self, **changes) -> CodecOptions:
        """These options with ``changes`` applied, each overriding only itself: a
        ``scale_choice`` left out here and where these options were made is derived again
        for the new ``scaling``; one given there is kept."""
        return _over(self, dict(changes))

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def parse(cls, values: Mapping[str, object], *, base: CodecOptions | None = None) -> CodecOptions:
        """Options from a mapping of names to values or their strings (keyword arguments,
        query parameters, a manifest's record); what it leaves out comes from ``base``
        (default: the default mode). An unknown name or a bad value raises
        :class:`InvalidOptionError` naming it."""
        if base is not None and not isinstance(base, CodecOptions):
            raise TypeError(f"options must be a CodecOptions (or None), got {type(base).__name__}")
        if not isinstance(values, Mapping):
            raise TypeError(f"codec options must be a mapping of names to values, got {type(values).__name__}")
        given = {}
        for name, value in values.items():
            if name not in _FIELDS:
                raise InvalidOptionError(f"unknown codec option {name!r}; expected one of {list(_FIELDS)}", field=name)
            given[name] = _convert(name, value)
        return _over(base or DEFAULT_OPTIONS, given)

    @classmethod
    def from_mode(cls, text: str) -> CodecOptions:
        """Options from a mode string ``FP8:SCALING[:key=value...]`` (``e4m3fn:token``,
        ``e4m3fn:block:block_size=64:scale_dtype=float32``); the rest as by default."""
        try:
            return cls.parse(cls.mode_values(text))
        except InvalidOptionError as exc:
            raise InvalidOptionError(f"mode {text!r}: {exc}", field=exc.field) from None

    @staticmethod
    def mode_values(text: str) -> dict[str, object]:
        """The options a mode string gives, by name, each in its own type (not checked
        together: :meth:`from_mode` does that)."""
        if not isinstance(text, str):
            raise InvalidOptionError(f"a mode must be a string, got {type(text).__name__}", field="mode")
        parts = text.strip().split(":")
        if len(parts) < 2:
            raise InvalidOptionError("expected FP8:SCALING[:key=value...] (e.g. e4m3fn:token)", field="mode")
        values: dict[str, object] = {"fp8": parts[0], "scaling": parts[1]}
        for option in parts[2:]:
            key, sep, value = option.partition("=")
            if not sep or not key or not value:
                raise InvalidOptionError(f"option {option!r} is not key=value", field="mode")
            if key in values:
                raise InvalidOptionError(f"option {key!r} is given twice", field=key)
            values[key] = value
        return {name: _convert(name, value) for name, value in values.items()}

    def label(self) -> str:
        """A short description: ``e4m3fn, block 32, bfloat16 scales by mse``."""
        return mode_label(**self.as_dict())


def _over(base: CodecOptions, given: dict) -> CodecOptions:
    """``base`` with the options ``given`` over it (:meth:`CodecOptions.parse`, ``replace``)."""
    if "scale_choice" in given or base._scale_choice_derived:
        given.setdefault("scale_choice", None)  # derived again, for the scaling given if any
        return replace(base, **given)
    try:
        return replace(base, **given)
    except InvalidOptionError as exc:
        if exc.field != "scale_choice":
            raise
        raise InvalidOptionError(
            f"scaling {given['scaling']!r} given over options whose scale_choice is {base.scale_choice!r}, "
            f"which needs scaling {' or '.join(map(repr, SEARCHED_SCALINGS))}: give scale_choice too",
            field="scale_choice",
        ) from None


def _check_choice(name: str, value) -> None:
    if value not in CHOICES[name]:
        what = "nonfinite policy" if name == "nonfinite" else name
        raise InvalidOptionError(f"unknown {what} {value!r}; expected one of {list(CHOICES[name])}", field=name)


def _convert(name: str, value):
    """A value given as a string (query parameter, mode string) in the option's own type."""
    if name == "block_size" and isinstance(value, str):
        if not (value.isascii() and value.isdigit()) or len(value) > len(str(MAX_BLOCK_SIZE)):  # int() of 4300 digits raises
            shown = value if len(value) <= 40 else f"{value[:40]}... ({len(value)} characters)"
            raise InvalidOptionError(
                f"block_size must be a positive integer (at most {MAX_BLOCK_SIZE}), got {shown!r}", field=name
            )
        return int(value)
    if name == "fp8" and is_torch_dtype(value):
        return value
    if name != "block_size" and value is not None and not isinstance(value, str):
        raise InvalidOptionError(f"{name} must be a string, got {value!r}", field=name)
    return value


_FIELDS = CodecOptions.names()
DEFAULT_OPTIONS = CodecOptions()  # the default mode
