"""Where a pool's workers run when no address is given: the Ray this process is already
connected to, ``RAY_ADDRESS``, a cluster running on this machine, else inline.

Nothing here imports Ray: finding that no cluster is running must not cost a one-shot
command Ray's import (a third of a second), let alone its start (seconds). A running
local cluster is found as Ray 2.60's own ``ray.init()`` finds it
(``ray._private.services.get_ray_address_from_environment``): ``ray start`` writes its
GCS address to ``ray_current_cluster`` in Ray's temporary directory; that file outlives
the cluster (a crash, a ``kill``), so the address counts only if its port answers.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

from ..errors import PoolStartError

# The addresses fp8ray gives a meaning of its own; any other names a Ray cluster.
INLINE = "inline"  # no Ray at all: QuantWorker objects on threads of this process
LOCAL = "local"  # an embedded Ray, started for the pool and removed with it

# Codec threads per CPU that may run on this machine alone (inline workers, or an embedded
# Ray's): beyond that they only add memory (a process each, on Ray) and wait for the
# cores, and a typo (``--workers 1000``) would start a thousand processes.
LOCAL_THREADS_PER_CPU = 4

# How long the GCS port of the address in ray_current_cluster gets to accept a connection.
# The address is this machine's (or its cluster head's, from a `ray start --address`): a
# refused connection comes back at once, so this bounds only an unreachable head.
ANSWER_SECONDS = 0.5
# How long an address given (RAY_ADDRESS, --address) gets: its head may be across a network.
CONNECT_SECONDS = 5.0


def default_address() -> str:
    """The address a pool given none uses, in this order: the Ray this process already
    runs in (``ray.init`` done, or a Ray task or actor); ``RAY_ADDRESS`` (set in Ray
    jobs); the cluster a ``ray start`` runs on this machine; else :data:`INLINE`."""
    if ray_connected():
        return sys.modules["ray"].get_runtime_context().gcs_address
    return os.environ.get("RAY_ADDRESS") or running_local_cluster() or INLINE


def ray_connected() -> bool:
    """Whether this process runs in a Ray (``ray.init`` done, or a Ray task or actor),
    without importing Ray: imported only if something else already has."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def check_local_size(threads: int, joinable: bool = True, option: str = "--workers") -> None:
    """Refuse ``threads`` codec threads (workers times CPUs each) on this machine alone
    beyond :data:`LOCAL_THREADS_PER_CPU` per CPU. ``joinable``: whether the command
    could join a cluster instead (``--address``), which the message offers; ``option``:
    the command's option that sets the number of workers."""
    cpus = os.cpu_count() or 1
    if threads > LOCAL_THREADS_PER_CPU * cpus:
        raise PoolStartError(
            f"{threads} codec threads (QuantWorkers times CPUs per worker) on this machine alone, which has {cpus} "
            f"CPU(s): more than {LOCAL_THREADS_PER_CPU * cpus} only add memory and wait for the CPUs: lower {option}"
            + (", or join a cluster with --address" if joinable else "")
        )


def running_local_cluster() -> str | None:
    """The GCS address of the Ray cluster ``ray start`` left running on this machine, or
    None: no ``ray_current_cluster`` file, one another user wrote, an unreadable one, or a
    cluster gone (its port does not answer)."""
    path = os.path.join(ray_temp_dir(), "ray_current_cluster")
    try:
        # Another user's cluster (a shared /tmp) is not one to send this user's data to.
        if os.stat(path).st_uid != os.getuid():
            return None
        with open(path) as f:
            address = f.read().strip()
    except OSError:
        return None
    return address if endpoint(address) is not None and answers(address, ANSWER_SECONDS) else None


def endpoint(address: str) -> tuple[str, int] | None:
    """The host and port of a Ray address (``host:port``, or a Ray client's
    ``ray://host:port``), or None for any other form (``auto``: Ray's to resolve)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def answers(address: str, seconds: float) -> bool:
    """Whether the port of a Ray address with an :func:`endpoint` accepts a connection
    within ``seconds`` (a refused one comes back at once)."""
    try:
        with socket.create_connection(endpoint(address), timeout=seconds):
            return True
    except OSError:
        return False


# What an HTTP/2 client sends first (RFC 9113, 3.4): the preface, then a SETTINGS frame.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def answers_grpc(address: str, seconds: float) -> bool:
    """Whether the port of a Ray address with an :func:`endpoint` answers as a gRPC
    server does (Ray's GCS and client server are): its first frame a SETTINGS frame. Ray
    retries any other port that accepts connections for a quarter of an hour (a
    dashboard's, whose port ``ray job submit`` takes, is the easy mistake). Where Ray's
    TLS is on (``RAY_USE_TLS``) the question cannot be asked in plain text: True."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return True
    try:
        with socket.create_connection(endpoint(address), timeout=seconds) as connection:
            connection.sendall(_HTTP2_PREFACE)
            header = b""
            while len(header) < 9:
                chunk = connection.recv(9 - len(header))
                if not chunk:
                    break
                header += chunk
    except OSError:
        return False
    return len(header) == 9 and header[3] == 4  # a frame header: 3 bytes of length, then the type


def ray_temp_dir() -> str:
    """Ray's default temporary directory, where ``ray start`` records its cluster
    (``ray._common.utils.get_default_ray_temp_dir`` in Ray 2.60): under ``RAY_TMPDIR``,
    else (Linux) ``TMPDIR``, else ``/tmp``."""
    if "RAY_TMPDIR" in os.environ:
        base = os.environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and "TMPDIR" in os.environ:
        base = os.environ["TMPDIR"]
    elif sys.platform.startswith(("linux", "darwin")):
        base = "/tmp"
    else:
        base = tempfile.gettempdir()
    return os.path.join(base, "ray")
