"""Joining Ray, or starting an embedded one, and leaving it as it was found."""

from __future__ import annotations

import os

import ray


def connect_ray(address: str | None, num_cpus: int | None) -> bool:
    """Connect to Ray, or start an embedded one. Returns whether this call started it.

    ``address`` ``None`` means ``RAY_ADDRESS`` if set, else an embedded local Ray
    (``"local"``) with ``num_cpus`` CPUs, no dashboard and Ray's auth mode pinned
    (``FP8RAY_RAY_AUTH_MODE``, default ``disabled``) so a later ``ray start`` cannot
    disagree with it.
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        os.environ["RAY_AUTH_MODE"] = os.environ.get("FP8RAY_RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    return True


def disconnect_ray() -> None:
    """Shut down the Ray that :func:`connect_ray` started."""
    ray.shutdown()
