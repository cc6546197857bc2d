"""``fp8ray serve``: run the online service until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import os

from ..errors import BadInputError, InvalidOptionError
from .common import non_empty, non_negative_float, port_number, positive_float, positive_int

APP_NAME = "fp8ray"


def add_commands(commands) -> None:
    serve = commands.add_parser("serve", help="run the HTTP encode/decode service on Ray Serve until SIGINT/SIGTERM")
    serve.add_argument(
        "--host", type=non_empty, default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=port_number, default=8000, help="port to listen on (default 8000)")
    service_arguments(serve)
    serve.add_argument(
        "--archives",
        type=non_empty,
        metavar="DIR",
        help="serve GET /v1/archive/block for the archives under this local directory (paths outside it are refused); "
        "without it the route answers 404",
    )
    serve.add_argument("--address", type=non_empty, help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray)")
    serve.add_argument(
        "--haproxy",
        action="store_true",
        help="put Ray Serve's HAProxy in front of the replicas (an embedded Ray only): near bare-HTTP throughput "
        "(BENCHMARKS.md), but HAProxy also opens its statistics and Prometheus ports on every interface, "
        "whatever --host says",
    )
    serve.set_defaults(handler=run_serve)


def service_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=positive_int, default=2, help="QuantWorker actors (default 2)")
    parser.add_argument(
        "--gpus-per-worker", type=non_negative_float, default=0.0, help="GPUs per worker; fractions share one (default 0)"
    )
    parser.add_argument(
        "--cpus-per-worker", type=positive_float, default=1.0, help="CPUs (and codec threads) per worker (default 1)"
    )
    parser.add_argument("--replicas", type=positive_int, default=1, help="Fp8Service replicas (default 1)")
    parser.add_argument("--max-body-mb", type=positive_float, default=256.0, help="larger request bodies get 413 (default 256)")


def service_args(args) -> dict:
    return {
        "workers": args.workers,
        "gpus_per_worker": args.gpus_per_worker,
        "cpus_per_worker": args.cpus_per_worker,
        "replicas": args.replicas,
        "max_body_mb": args.max_body_mb,
    }


def _check_port(host: str, port: int) -> None:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def run_serve(args) -> int:
    from ..serve import ServiceOptions
    from ..serve.environment import StateFolder, apply_serve_environment, check_haproxy_sockets

    # No call of this process may start a Ray of its own (Ray's auto-init): one left waiting
    # on the GCS of an embedded Ray killed with this process did, as Ray was being removed.
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    options = service_args(args)
    if args.archives:
        options["archives"] = os.path.abspath(args.archives)  # the replicas' working directory is Ray's, not ours
    ServiceOptions.from_args(options)  # bad options fail before Ray starts
    state = None
    embedded = (args.address or os.environ.get("RAY_ADDRESS") or "local") == "local"
    if args.haproxy and not embedded:  # a cluster's Serve proxies are set where the cluster starts
        raise InvalidOptionError("--haproxy applies to an embedded Ray (no --address, no RAY_ADDRESS), not to a cluster's")
    if embedded:
        # An embedded Ray's proxy binds here, on this machine, sharing a port another
        # service holds (SO_REUSEPORT) without a word: refuse first.
        _check_port(args.host, args.port)
        # Serve reads these as it is imported, in every process of the Ray started below.
        state = StateFolder()
        try:
            apply_serve_environment(state.path, args.haproxy)
            if args.haproxy:
                check_haproxy_sockets(os.environ)
        except BaseException:
            state.remove()
            raise
    try:
        return _serve(args, options)
    finally:
        if state:
            state.remove()


def _serve(args, options: dict) -> int:
    import logging
    import signal
    import threading

    import ray
    from ray import serve

    from ..engine.runtime import check_placeable, connect_ray, disconnect_ray, started_embedded
    from ..serve import ServiceOptions, build_app

    owns_ray = connect_ray(args.address, None)
    # Serve's own lines (started, "Connecting to existing Serve app ... will not be
    # applied" from its second start inside serve.run, ready) say nothing ours does not.
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    deployed = False
    ray_lost = False
    try:
        if started_embedded():  # nothing else will join it: QuantWorkers it cannot hold would wait forever
            service = ServiceOptions.from_args(options)
            check_placeable(service.workers, service.cpus_per_worker, service.gpus_per_worker, ray.cluster_resources())
        if APP_NAME in serve.status().applications:
            raise BadInputError(f"a Serve application named {APP_NAME!r} already runs on this cluster; not replacing it")
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(options), name=APP_NAME, route_prefix="/")
        deployed = True
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        ray_address = ray.get_runtime_context().gcs_address
        archives = f"reading the archives under {options['archives']}" if options.get("archives") else "no --archives"
        print(
            f"fp8ray serve: listening on {listening_on(args.host, args.port)} with {args.workers} QuantWorkers, "
            f"{archives}; Serve handles join RAY_ADDRESS={ray_address} (serve.get_app_handle({APP_NAME!r})); "
            "SIGINT or SIGTERM stops it",
            flush=True,
        )
        stop.wait()
        print("fp8ray serve: shutting down", flush=True)
    finally:
        if deployed:
            ray_lost = not _stop_service(started_embedded())
        if owns_ray:
            disconnect_ray()
    if ray_lost:
        print("fp8ray serve: the embedded Ray's processes were stopped by the same signal: requests in flight were lost")
        raise KeyboardInterrupt  # exit 130, the interrupted line: not a clean stop
    return 0


def listening_on(host: str, port: int) -> str:
    """Where the service answers HTTP: ``host:port`` on a Serve this command started; on a
    cluster whose Serve already ran, its own (Serve keeps the first start's)."""
    from ..engine.runtime import started_embedded

    return f"http://{host}:{port}" if started_embedded() else "the cluster's Serve HTTP address (its first start set it)"


def _stop_service(embedded: bool) -> bool:
    """Drain the service (new requests 503, those in flight finished, up to DRAIN_S), then
    remove it: on a cluster, the application this run deployed; an embedded Ray goes whole
    next (serve.delete would answer new requests 404 as it ran). Returns False where the
    embedded Ray died meanwhile (a signal to the whole process group): nothing waits for it."""
    import asyncio
    import threading

    from ray import serve

    from ..engine.runtime import embedded_ray_alive
    from ..serve.deployment import DRAIN_S

    # In an event loop: Serve's throughput setting routes a handle's calls on the caller's.
    # The replica drains for DRAIN_S at most; the call may first wait as long for a slot
    # (stalled uploads hold them until the body timeout, of the same default).
    async def drain():
        await asyncio.wait_for(serve.get_app_handle(APP_NAME).drain.remote(), 2 * DRAIN_S)

    def drain_and_delete():
        try:
            asyncio.run(drain())
        except Exception as exc:  # noqa: BLE001 (the stop goes on: say why it did not drain)
            print(f"fp8ray serve: draining failed ({type(exc).__name__}: {exc}); stopping now", flush=True)
        if not embedded:
            serve.delete(APP_NAME)

    if not embedded:
        drain_and_delete()
        return True
    # In a thread: a call to a GCS that has died waits a minute, then ends the process.
    worker = threading.Thread(target=drain_and_delete, daemon=True)
    worker.start()
    while worker.is_alive():
        if not embedded_ray_alive():
            return False
        worker.join(0.2)
    return True
