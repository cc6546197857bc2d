"""``ServiceOptions``: what the service application is built with (``build_app``'s
arguments, from ``fp8ray serve``, ``serve run ... key=value`` or a config file)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..errors import InvalidOptionError

# Each number's allowed values (NaN and inf pass a plain comparison: they are refused here).
_RANGES = {
    "workers": (lambda n: n >= 1, "at least 1"),
    "replicas": (lambda n: n >= 0, "0 (Serve's default) or more"),
    "cpus_per_worker": (lambda x: math.isfinite(x) and x > 0, "a finite number above 0"),
    "gpus_per_worker": (lambda x: math.isfinite(x) and x >= 0, "a finite number of at least 0"),
    "max_body_mb": (lambda x: math.isfinite(x * 2**20) and x * 2**20 >= 1, "a finite number of MiB of at least one byte"),
    "body_timeout_s": (lambda x: math.isfinite(x) and x > 0, "a finite number of seconds above 0"),
}


@dataclass(frozen=True)
class ServiceOptions:
    """What :func:`build_app` takes (as a dict, from ``serve run`` arguments or a config)."""

    workers: int = 2
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    replicas: int = 0  # 0: Serve's default, or what a config file sets (autoscaling)
    max_body_mb: float = 256.0  # larger bodies are answered 413
    # The directory whose archives GET /v1/archive/block reads ("": the route is off).
    archives: str = ""
    # A request whose body sends no byte for this long is answered 408, freeing its slot
    # (a replica takes 64 requests at a time: 64 stalled uploads held it for ever). Long
    # enough for a client's or a network's hiccup; a slow upload that keeps sending is
    # not cut, however long it takes.
    body_timeout_s: float = 30.0

    @classmethod
    def from_args(cls, args: dict | None) -> ServiceOptions:
        args = dict(args or {})
        unknown = set(args) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidOptionError(
                f"unknown fp8ray.serve option(s) {sorted(unknown)}; expected {sorted(cls.__dataclass_fields__)}"
            )
        options = cls(**{name: _converted(name, type(getattr(cls, name)), value) for name, value in args.items()})
        for name, (allowed, expected) in _RANGES.items():
            if not allowed(getattr(options, name)):
                raise InvalidOptionError(
                    f"fp8ray.serve option {name} must be {expected}, got {getattr(options, name)!r}", field=name
                )
        if options.archives and not os.path.isdir(options.archives):
            raise InvalidOptionError(f"archives root {options.archives!r} is not a directory", field="archives")
        return options

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)


def _converted(name: str, kind: type, value):
    """An option's value as its field's type: from a string (``serve run ... workers=2``)
    or a config file's number, never by cutting one (``workers: 2.9`` was 2, ``true`` 1,
    an empty ``archives:`` the directory ``'None'``)."""
    refused = InvalidOptionError(f"fp8ray.serve option {name} must be {_KINDS[kind]}, got {value!r}", field=name)
    if kind is int and isinstance(value, str):  # "2" or "2.0", as a config's 2.0 is taken
        try:
            value = int(value)
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                raise refused from None
    if (
        isinstance(value, bool)
        or not isinstance(value, (str, int, float))
        or (kind is str and not isinstance(value, str))
        or (kind is int and isinstance(value, float) and not value.is_integer())
    ):
        raise refused
    try:
        return kind(value)
    except (ValueError, OverflowError):  # float(10**400): past any float
        raise refused from None


_KINDS = {int: "a whole number", float: "a number", str: "a string"}
