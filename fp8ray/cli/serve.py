"""``fp8ray serve``: run the online service until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import os

from ..errors import BadInputError, InvalidOptionError
from .common import non_empty, non_negative_float, port_number, positive_float, positive_int

APP_NAME = "fp8ray"


def add_commands(commands) -> None:
    serve = commands.add_parser("serve", help="run the HTTP encode/decode service on Ray Serve until SIGINT/SIGTERM")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
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
    import shutil
    import tempfile

    from ..serve import ServiceOptions
    from ..serve.environment import apply_serve_environment

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
        state = tempfile.mkdtemp(prefix="fp8ray-serve-")
        apply_serve_environment(state, args.haproxy)
    try:
        return _serve(args, options)
    finally:
        if state:
            shutil.rmtree(state, ignore_errors=True)


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
        where = f"http://{args.host}:{args.port}" if owns_ray else "the cluster's Serve HTTP address (its first start set it)"
        ray_address = ray.get_runtime_context().gcs_address
        print(
            f"fp8ray serve: listening on {where} with {args.workers} QuantWorkers; Serve handles join "
            f"RAY_ADDRESS={ray_address} (serve.get_app_handle({APP_NAME!r})); SIGINT or SIGTERM stops it",
            flush=True,
        )
        stop.wait()
        print("fp8ray serve: shutting down", flush=True)
    finally:
        # Only what this run deployed; an embedded Ray then goes whole, Serve's controller
        # with it (serve.shutdown would have it kill itself mid-call: "graceful_shutdown failed").
        if deployed:
            serve.delete(APP_NAME)
        if owns_ray:
            disconnect_ray()
    return 0
