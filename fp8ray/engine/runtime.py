"""Joining Ray, or starting an embedded one, and leaving the machine as it was found."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading

import psutil
import ray

from ..errors import Fp8rayError, InvalidOptionError, PoolStartError
from ..io.leftovers import ScratchMark, remove_dead
from ..io.paths import one_line, os_reason
from .address import (
    CONNECT_SECONDS,
    LOCAL,
    answers,
    answers_grpc,
    check_local_size,
    endpoint,
    ray_temp_dir,
    running_local_cluster,
)
from .dispositions import keeping_dispositions

# What the embedded Ray this process started left on the machine, removed when it stops:
# its temporary directory (the session's logs and sockets) and the processes it started.
_started_dir: str | None = None
_started_mark: ScratchMark | None = None  # held while the embedded Ray runs (fp8ray.io.leftovers)
RAY_FOLDER_PREFIX = "fp8ray-"
_before: set[int] = set()  # this process's children before the embedded Ray started
_holders = 0  # callers of connect_ray holding the connection it made (disconnect_ray lets go)
_lock = threading.RLock()
# How long the embedded Ray's processes get to end after ray.shutdown before they are told
# to (its agents otherwise linger for a minute or two once the raylet has gone), and then
# before they are killed.
STOP_SECONDS = 0.5
KILL_SECONDS = 3.0


def connect_ray(address: str | None, num_cpus: int | None, *, inline_possible: bool = False) -> bool:
    """Connect to Ray, or start an embedded one. Returns whether the caller now holds a
    connection this module made (this call started one or joined a cluster, or another
    caller's is in place): then it calls :func:`disconnect_ray` once done, and the last
    holder to do so ends the connection, so that two pools of one process (two threads)
    share one embedded Ray and neither removes it under the other. A Ray this process
    connected to itself (``ray.init``, a Ray task) is joined, not held: False.
    :func:`started_embedded` tells an embedded Ray from a cluster.
    ``inline_possible``: whether the caller could run without Ray (a pool's ``"inline"``),
    which the messages then offer; otherwise ``"inline"`` is refused as needing no Ray.

    ``address`` ``None`` means ``RAY_ADDRESS`` if set, else an embedded local Ray (for
    what needs Ray whatever runs, as Serve; a pool given no address chooses its own,
    :func:`~fp8ray.engine.address.default_address`). An embedded Ray (``"local"``) has
    ``num_cpus`` CPUs, no dashboard, its own temporary directory (under ``RAY_TMPDIR``
    or the system's) and Ray's auth mode pinned (``FP8RAY_RAY_AUTH_MODE``, default
    ``disabled``) so a later ``ray start`` cannot disagree with it.

    The process's SIGINT and SIGTERM handlers are kept as they were (``ray.init``
    installs its own). SIGINT or SIGTERM while Ray starts is held until it has started;
    then Ray is stopped (an embedded one removed) and the signal delivered.
    """
    global _holders
    with _lock:  # one start at a time: a second caller joins the first's Ray
        if ray.is_initialized():
            if address is not None:
                _check_connected_to(address)
            if not _holders:
                return False
        else:
            _connect(address, num_cpus, inline_possible)
        _holders += 1
        return True


def _connect(address: str | None, num_cpus: int | None, inline_possible: bool) -> None:
    """:func:`connect_ray`'s start of a connection, none being in place."""
    global _started_dir, _before, _started_mark
    address = address or os.environ.get("RAY_ADDRESS") or LOCAL
    where = " (RAY_ADDRESS)" if address == os.environ.get("RAY_ADDRESS") else ""  # a pool's default is it too
    forms = "HOST:PORT or ray://HOST:PORT (a cluster), auto (the cluster ray start runs here), local (an embedded Ray)"
    if address == "inline" and not inline_possible:
        raise InvalidOptionError(f"address 'inline'{where} runs no Ray, and this needs one: give {forms}", field="address")
    if address == "auto":
        # Found as the default address finds it, its port answering: Ray's own search
        # retried a cluster gone for minutes, or joined another process's embedded Ray.
        found = running_local_cluster()
        if found is None:
            raise PoolStartError(
                f"no Ray cluster runs on this machine (address 'auto'{where} is the one ray start records in "
                f"{os.path.join(ray_temp_dir(), 'ray_current_cluster')}, its port answering): start one (ray start "
                "--head), or give its HOST:PORT"
            )
        address, where = found, f" (auto){where}"
    cluster = address != LOCAL
    if address.startswith(("http://", "https://")):  # a dashboard's, as ray job submit takes it
        raise InvalidOptionError(
            f"address {address!r}{where} is a URL (the dashboard's, for ray job submit): give {forms}", field="address"
        )
    if cluster and endpoint(address) is None:  # Ray's own message names no form
        raise InvalidOptionError(
            f"address {address!r}{where} is not a Ray address: give {forms}" + (" or inline (no Ray)" if inline_possible else ""),
            field="address",
        )
    # Ray retries an address that does not answer for minutes, printing its warnings: say so at once.
    if cluster and not answers(address, CONNECT_SECONDS):
        instead = "--address inline (no Ray) or --address local" if inline_possible else "--address local"
        raise PoolStartError(
            f"no Ray cluster answers at {address}{where}: start one (ray start --head), or pass {instead} (an embedded one)"
        )
    if cluster and not answers_grpc(address, CONNECT_SECONDS):
        raise PoolStartError(
            f"{address}{where} answers, but not as a Ray cluster's GCS or client server does (gRPC): the dashboard's "
            "port (8265, ray job submit's)? Give the port ray start printed (6379 by default; ray:// takes 10001)"
        )
    if address == LOCAL and num_cpus is not None:  # the CPUs its caller's workers take
        check_local_size(num_cpus)
    handlers = _signal_handlers()
    # An interrupt inside ray.init leaves a driver half connected that ray.shutdown does
    # not stop, and whose threads crash the process as it exits (SIGSEGV): one that comes
    # while Ray starts is held until it has started, then Ray is stopped and it is delivered.
    held: list[int] = []
    for sig, handler in (handlers or {}).items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, _: held.append(signum))
    try:
        if address == LOCAL:
            os.environ["RAY_AUTH_MODE"] = os.environ.get("FP8RAY_RAY_AUTH_MODE", "disabled")
            _before = _children()
            # Short, own and removed whole: Ray's socket paths are limited to ~100 bytes.
            parent = os.environ.get("RAY_TMPDIR") or "/tmp"
            for folder in {parent, "/tmp"}:  # those of killed runs (a service's in /tmp where RAY_TMPDIR is long)
                remove_dead(folder, lambda name: name.startswith(RAY_FOLDER_PREFIX))
            try:
                _started_dir = tempfile.mkdtemp(prefix=RAY_FOLDER_PREFIX, dir=parent)
            except OSError as exc:  # its message named the folder it would have made, not RAY_TMPDIR
                where = " (RAY_TMPDIR)" if os.environ.get("RAY_TMPDIR") else ""
                raise PoolStartError(f"cannot make the embedded Ray's folder in {parent}{where}: {os_reason(exc)}") from None
            try:
                _started_mark = ScratchMark(_started_dir)
                _init_holding_sigterm(
                    held,
                    address="local",
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                    _temp_dir=_started_dir,
                )
            except BaseException:
                _shutdown()
                raise
        else:
            _init_holding_sigterm(held, address=address, log_to_driver=False, logging_level=logging.WARNING)
        if held:
            _shutdown()
    except BaseException:
        if not held:
            raise
        # Ray did not start, and an interrupt came meanwhile: the interrupt is answered (it was dropped).
    finally:
        _restore_signal_handlers(handlers)
    if held:
        signal.raise_signal(held[0])  # the caller's handler runs now (SIGINT: KeyboardInterrupt)
        raise KeyboardInterrupt  # a handler that returned: still, Ray is not connected
    if _started_dir is not None:  # removed at exit too, where no holder disconnects (a notebook's pool)
        atexit.register(_shutdown, False)


def _check_connected_to(address: str) -> None:
    """Refuse an ``address`` naming another Ray than the one this process is already
    connected to: a process holds one Ray connection, and work sent silently to another
    cluster than the one named is not what was asked. A ``host:port`` names it where its
    port is the connected GCS's and its host the same machine (a name, ``localhost`` and
    the node's own IP all are); ``local`` (an embedded Ray) and ``auto`` (the cluster
    ``ray start`` runs here) where the connected Ray runs on this machine; a Ray client's
    ``ray://`` where this process is a Ray client (whose server is not compared)."""
    connected = ray.get_runtime_context().gcs_address
    given, have = endpoint(address), endpoint(connected)
    if address == connected:
        return
    if address.startswith("ray://"):
        from ray.util.client import ray as client

        if client.is_connected():
            return
    elif address in (LOCAL, "auto"):
        if have is not None and _addresses(have[0]) & _this_machine():
            return
    elif given is not None and have is not None and given[1] == have[1] and _same_machine(given[0], have[0]):
        return
    wanted = "an embedded Ray" if address == LOCAL else f"Ray at {address}"
    raise InvalidOptionError(
        f"this process is already connected to Ray at {connected}, and one process holds one connection: "
        f"{wanted} was asked for; give no address to use the one connected, or call ray.shutdown() first",
        field="address",
    )


def _same_machine(a: str, b: str) -> bool:
    """Whether hosts ``a`` and ``b`` are one machine: an address in common, or both this one."""
    ours, theirs, here = _addresses(a), _addresses(b), _this_machine()
    return bool(ours & theirs) or bool(ours & here and theirs & here)


def _addresses(host: str) -> set[str]:
    """The IP addresses ``host`` resolves to (itself, where it does not resolve)."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return {host}


def _this_machine() -> set[str]:
    """This machine's addresses: loopback, its name's, the node IP Ray chose."""
    return {"127.0.0.1", "::1", ray.util.get_node_ip_address(), *_addresses(socket.gethostname())}


def _init_holding_sigterm(held: list[int], **kwargs) -> None:
    """``ray.init(**kwargs)``. As it starts it puts its own SIGTERM handler in place of
    the one holding signals (``sys.exit(SIGTERM)``): a SIGTERM then ends the process with
    exit code 15 and no word. That exit is taken back here and the signal held as any
    other (``held``). A start that fails (Ray raises a bare ``Exception`` for a node that
    timed out starting) is a :class:`PoolStartError` saying so."""
    try:
        ray.init(**kwargs)
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        held.append(signal.SIGTERM)
    except Fp8rayError:
        raise
    except Exception as exc:
        what = "the embedded Ray did not start" if kwargs["address"] == LOCAL else f"cannot join Ray at {kwargs['address']}"
        raise PoolStartError(f"{what}: {one_line(exc)}") from exc


def started_embedded() -> bool:
    """Whether the Ray this process is connected to is one :func:`connect_ray` started
    here (``"local"``), which nothing else will join, not a cluster it joined."""
    return _started_dir is not None


def embedded_ray_alive() -> bool:
    """Whether the GCS of the embedded Ray this process started still answers (False where
    none was started). A signal to this process's whole group (``timeout``, ``kill --
    -PGID``, systemd) stops Ray's processes too; a call needing the GCS then waits a minute
    for it before Ray ends the process. (A GCS told to stop closes its port at once, its
    process lingering on for seconds.)"""
    return _started_dir is not None and answers(ray.get_runtime_context().gcs_address, CONNECT_SECONDS)


def check_placeable(workers: int, cpus_per_worker: float, gpus_per_worker: float, have: dict, joinable: bool = True) -> None:
    """On a Ray the caller started (``have``: its ``ray.cluster_resources()``), which
    nothing else will ever join: QuantWorkers asking for more CPUs or GPUs than it has
    would wait out the start timeout, or forever. Refuse them, naming what is short. (A
    cluster's autoscaler may add nodes: there they wait, as asked.) ``joinable``: whether
    the command could join a cluster instead (``--address``), which the message offers."""
    need = {"CPU": workers * cpus_per_worker, "GPU": workers * gpus_per_worker}
    for name, amount in need.items():
        if amount > have.get(name, 0):
            flag = "--cpus-per-worker" if name == "CPU" else "--gpus-per-worker"
            raise PoolStartError(
                f"{workers} QuantWorkers need {amount:g} {name}(s), and the Ray this command started has "
                f"{have.get(name, 0):g}: lower --workers or {flag}" + (", or join a cluster with --address" if joinable else "")
            )


def holders() -> int:
    """How many callers of :func:`connect_ray` hold the connection it made (0: none made)."""
    return _holders


def disconnect_ray() -> None:
    """Let go of a connection :func:`connect_ray` made; the last holder shuts Ray down."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if not _holders:
            _shutdown()


def _shutdown(deliver_held: bool = True) -> None:
    """Shut down Ray. An embedded one goes whole: the processes it started (terminated if
    they linger, then killed) and its temporary directory. SIGINT and SIGTERM are held
    meanwhile, so that they cannot cut the clean-up short, then delivered to the
    process's handlers (``deliver_held``; not as the process exits). ``ray.shutdown``
    resets SIGTERM to the default action, which would end the process at once: it is
    put back within milliseconds (:mod:`fp8ray.engine.dispositions`), which narrows that
    window from the second ``ray.shutdown`` takes."""
    global _started_dir, _before, _started_mark
    atexit.unregister(_shutdown)
    started, _started_dir = _started_dir, None
    ours = _children() - _before if started else set()
    family = _with_descendants(ours)
    handlers = _signal_handlers()
    held: list[int] = []
    for sig, handler in (handlers or {}).items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, _: held.append(signum))
    try:
        try:
            keeping_dispositions(ray.shutdown)
        finally:
            if started:
                _end(family)
                shutil.rmtree(started, ignore_errors=True)
                if _started_mark is not None:
                    _started_mark.release()
                    _started_mark = None
    finally:
        _restore_signal_handlers(handlers)
    if held and deliver_held:
        signal.raise_signal(held[0])  # the caller's handler runs now (SIGINT: KeyboardInterrupt)


def _signal_handlers():
    if threading.current_thread() is not threading.main_thread():
        return None
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_signal_handlers(handlers) -> None:
    for sig, handler in (handlers or {}).items():
        if handler is not None:
            signal.signal(sig, handler)


def _children() -> set[int]:
    try:
        return {p.pid for p in psutil.Process().children()}
    except psutil.Error:
        return set()


def _with_descendants(pids: set[int]) -> list[psutil.Process]:
    family = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            family += [p, *p.children(recursive=True)]
        except psutil.Error:
            pass
    return family


def _end(family: list[psutil.Process]) -> None:
    """End the embedded Ray's processes that ``ray.shutdown`` left (only those: children
    of this process that it started, and their descendants)."""
    _, alive = psutil.wait_procs(family, timeout=STOP_SECONDS)
    for stop in (psutil.Process.terminate, psutil.Process.kill):
        for p in alive:
            try:
                stop(p)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(alive, timeout=KILL_SECONDS)
        if not alive:
            return
