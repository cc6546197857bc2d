"""The environment Ray Serve reads as it is imported, set where the service starts.

Serve reads its switches from environment variables once, when ``ray.serve`` is first
imported, in every process of the cluster (controller, proxy, replicas). So they must be
in the environment of the process that starts Ray, before it starts: ``fp8ray serve`` and
``fp8ray bench serve`` set them on the embedded Ray they start (a value already in the
environment is kept); a cluster started otherwise (``ray start``, a config file) takes
them from its own environment.

What they buy, measured by ``fp8ray bench serve`` (BENCHMARKS.md, "Serve at the HTTP
limit"): HAProxy, a proxy written in C, answers HTTP on the service's port and passes
each request straight to the replica's own HTTP server (direct ingress), instead of
Serve's Python proxy relaying it to the replica as ASGI messages over Ray.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping

from ..errors import InvalidOptionError

# Serve's switches (and one of Ray's), each kept where the environment sets it already.
SERVE_SWITCHES = {
    # Serve's own throughput settings: user code on the replica's event loop, gRPC
    # between Serve's processes, request-path logs buffered.
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # A replica being removed serves on this long for an outside load balancer to notice;
    # here HAProxy is Serve's own and is told at once (Serve's default, 30 s, held every
    # shutdown of `fp8ray serve` that long).
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    # Ray's, not Serve's: objects up to this size travel inside the call that passes or
    # returns them, not through the object store (Ray's default: 100 KiB), so a body of up
    # to 2 MiB and its frame go to a QuantWorker and back without the raylet. Larger ones
    # still go through the store: its one copy costs less than the call's copies of 16 MiB.
    "RAY_max_direct_call_object_size": str(2 * 2**20),
}
# HAProxy in front (it implies direct ingress: each replica serves HTTP itself), asked for
# with `fp8ray serve --haproxy`: Ray's HAProxy also serves its statistics and Prometheus
# ports on every interface, whatever --host says, so it is not the default.
HAPROXY_SWITCHES = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # HAProxy sends one line per request to its metrics reader, a Python actor: off, the
    # service's own Prometheus metrics (fp8ray_serve_*) count requests in the replica.
    "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
}
# HAProxy's files, by default under /tmp/haproxy-serve: under the run's own directory
# instead, removed with it.
HAPROXY_FILES = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
}
# Serve puts each node's HAProxy files in a folder named by the node's id (56 hex digits),
# and HAProxy refuses a UNIX socket path of more bytes than this ("Fatal errors found in
# configuration", naming neither), so the run's directory must be short.
HAPROXY_SOCKETS = ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH")
NODE_ID_CHARS = 56
HAPROXY_SOCKET_MAX = 97
# HAProxy's statistics and Prometheus ports, by default 8404 and 9101 on every interface:
# a free port each, so that two services on one machine do not collide.
HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def apply_serve_environment(
    directory: str, haproxy: bool = False, environ: MutableMapping[str, str] = os.environ
) -> dict[str, str]:
    """Set Serve's switches and, with ``haproxy``, HAProxy's, its files (under
    ``directory``) and ports, each where ``environ`` does not set it already; returns every
    one of them as now in force."""
    wanted = dict(SERVE_SWITCHES)
    if haproxy:
        wanted.update(HAPROXY_SWITCHES)
        wanted.update({name: os.path.join(directory, leaf) for name, leaf in HAPROXY_FILES.items()})
        for name in HAPROXY_PORTS:
            if name not in environ:
                wanted[name] = str(_free_port())
    for name, value in wanted.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in wanted}


def check_haproxy_sockets(environ: Mapping[str, str]) -> None:
    """Refuse, in one line naming it, a HAProxy socket path longer than HAProxy takes."""
    for name in HAPROXY_SOCKETS:
        folder, leaf = os.path.split(environ[name])
        path = os.path.join(folder, "<node id>", leaf)
        size = _socket_bytes(folder, leaf)
        if size > HAPROXY_SOCKET_MAX:
            raise InvalidOptionError(
                f"--haproxy: HAProxy's socket {path} would be {size} bytes long, over HAProxy's limit of "
                f"{HAPROXY_SOCKET_MAX}: set {name} to a shorter path"
            )


def _socket_bytes(folder: str, leaf: str) -> int:
    """The length of the path Serve gives a HAProxy socket ``leaf`` under ``folder``."""
    return len(os.fsencode(os.path.join(folder, "x" * NODE_ID_CHARS, leaf)))


# A service's own folder (HAProxy's files), beside the embedded Ray's where HAProxy's
# socket paths fit under it, else in /tmp; marked, so that the embedded start of a later
# command removes one whose command was killed outright (its sweep of RAY_FOLDER_PREFIX,
# which this shares, in both places).
STATE_PREFIX = "fp8ray-srv-"
SHORT_PARENT = "/tmp"
MKDTEMP_CHARS = 8  # the random part tempfile.mkdtemp adds to the prefix


def state_parent() -> str:
    """Where :class:`StateFolder` makes its folder: ``RAY_TMPDIR`` (else /tmp), or /tmp
    where a socket path would be too long under it (a test's or a job's deep RAY_TMPDIR)."""
    parent = os.environ.get("RAY_TMPDIR") or SHORT_PARENT
    folder = os.path.join(parent, STATE_PREFIX + "x" * MKDTEMP_CHARS)
    fits = all(_socket_bytes(folder, HAPROXY_FILES[name]) <= HAPROXY_SOCKET_MAX for name in HAPROXY_SOCKETS)
    return parent if fits else SHORT_PARENT


class StateFolder:
    """The folder :func:`apply_serve_environment` puts HAProxy's files in, made now and
    marked (:mod:`fp8ray.io.leftovers`); :meth:`remove` when the service has stopped."""

    def __init__(self):
        import tempfile

        from ..io.leftovers import ScratchMark

        self.path = tempfile.mkdtemp(prefix=STATE_PREFIX, dir=state_parent())
        self._mark = ScratchMark(self.path)

    def remove(self) -> None:
        import shutil

        self._mark.release()
        shutil.rmtree(self.path, ignore_errors=True)
