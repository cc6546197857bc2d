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
    "max_body_mb": (lambda x: math.isfinite(x) and x * 2**20 >= 1, "a finite number of MiB of at least one byte"),
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

    @classmethod
    def from_args(cls, args: dict | None) -> ServiceOptions:
        args = dict(args or {})
        unknown = set(args) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidOptionError(
                f"unknown fp8ray.serve option(s) {sorted(unknown)}; expected {sorted(cls.__dataclass_fields__)}"
            )
        try:
            options = cls(**{k: type(getattr(cls, k))(v) for k, v in args.items()})
        except (TypeError, ValueError) as exc:
            raise InvalidOptionError(f"bad fp8ray.serve option: {exc}") from exc
        for name, (allowed, expected) in _RANGES.items():
            if not allowed(getattr(options, name)):
                raise InvalidOptionError(
                    f"fp8ray.serve option {name} must be {expected}, got {getattr(options, name)!r}", field=name
                )
        if options.archives and not os.path.isdir(options.archives):
            raise InvalidOptionError(f"archives root {options.archives!r} is not a directory", field="archives")
        return options
