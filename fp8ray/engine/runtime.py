"""Joining Ray, or starting an embedded one, and leaving the machine as it was found."""

from __future__ import annotations

import logging
import os
import shutil

import ray

# The session directory of the embedded Ray this process started, removed when it stops.
_started_session: str | None = None


def connect_ray(address: str | None, num_cpus: int | None) -> bool:
    """Connect to Ray, or start an embedded one. Returns whether this call started it.

    ``address`` ``None`` means ``RAY_ADDRESS`` if set, else an embedded local Ray
    (``"local"``) with ``num_cpus`` CPUs, no dashboard and Ray's auth mode pinned
    (``FP8RAY_RAY_AUTH_MODE``, default ``disabled``) so a later ``ray start`` cannot
    disagree with it.
    """
    global _started_session
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        os.environ["RAY_AUTH_MODE"] = os.environ.get("FP8RAY_RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        _started_session = _session_dir()
    else:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    return True


def disconnect_ray() -> None:
    """Shut down the Ray that :func:`connect_ray` started; an embedded one's session
    directory (its logs and sockets, under Ray's temp directory) goes with it."""
    global _started_session
    ray.shutdown()
    session, _started_session = _started_session, None
    if session and os.path.basename(session).startswith("session_"):
        latest = os.path.join(os.path.dirname(session), "session_latest")
        if os.path.islink(latest) and os.path.realpath(latest) == os.path.realpath(session):
            os.unlink(latest)
        shutil.rmtree(session, ignore_errors=True)


def _session_dir() -> str | None:
    try:  # Ray has no public accessor for it
        from ray._private import worker

        return worker._global_node.get_session_dir_path()
    except (ImportError, AttributeError):
        return None
