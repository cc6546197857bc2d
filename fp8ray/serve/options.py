"""``ServiceOptions``: what the service application is built with (``build_app``'s
arguments, from ``fp8ray serve``, ``serve run ... key=value`` or a config file)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import InvalidOptionError


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
        if (
            options.workers < 1
            or options.replicas < 0
            or options.cpus_per_worker <= 0
            or options.gpus_per_worker < 0
            or options.max_body_mb <= 0
        ):
            raise InvalidOptionError(f"fp8ray.serve options out of range: {options}")
        if options.archives and not os.path.isdir(options.archives):
            raise InvalidOptionError(f"archives root {options.archives!r} is not a directory", field="archives")
        return options
