"""``fp8ray bench serve``: the online service's throughput and latency over HTTP, beside
a bare FastAPI/uvicorn app (:mod:`fp8ray.bench.bare_http`) that reads the same bodies and
answers as many bytes, in the same run, with the CPU each process spent per request.

The ratio serve/bare is what Serve, the replica and the QuantWorker calls cost over HTTP
itself. The two paths take turns, ``ROUNDS`` times per block size, and the best round of
each is shown (2 shared cores: the best is the least disturbed). Every answer of the
service is checked against the codec's own frame.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from ..codec import CodecOptions, Fp8Codec
from ..codec.blocks import tensor_to_bytes
from ..errors import InvalidOptionError

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}
ROW = 1024  # bf16 elements per row of a bench block
ROUNDS = 3  # turns of each path per block size
START_TIMEOUT_S = 60.0
# Process roles by what a process's command line holds, the first match naming it.
ROLES = (
    ("ServeReplica", "replica"),
    ("ProxyActor", "proxy"),
    ("HAProxyManager", "haproxy manager"),
    ("haproxy", "haproxy"),
    ("QuantWorker", "workers"),
    ("ServiceStats", "stats actor"),
    ("ServeController", "controller"),
    ("raylet", "raylet"),
    ("gcs_server", "gcs"),
    ("bare_http", "bare app"),
)


BENCH_APP = "fp8ray-bench"


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536; a plain number is bytes."""
    given = text
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = UNITS.get(text[-1:], 1)
    try:
        size = int(float(text[:-1] if text[-1:] in UNITS else text) * scale)
    except (ValueError, OverflowError):  # OverflowError: "inf", "1e400"
        raise InvalidOptionError(f"bad block size {given!r}; expected e.g. 64K, 1M or 16M", field="sizes") from None
    if size < 2 * ROW:
        raise InvalidOptionError(f"block size {given!r} is below the smallest bench block ({2 * ROW} bytes)", field="sizes")
    return size


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _digest(data) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _role(process: psutil.Process) -> str:
    try:
        line = " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    return next((role for mark, role in ROLES if mark in line), "other")


def _cpu_seconds() -> Counter:
    """CPU seconds so far of this process (the client) and every process it started (the
    embedded Ray, the bare app), by role."""
    me = psutil.Process()
    seconds: Counter = Counter()
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = "client" if process.pid == me.pid else _role(process)
        seconds[role] += times.user + times.system
    return seconds


@dataclass
class Round:
    seconds: float
    latencies: list[float]
    cpu: Counter  # CPU seconds by role during the round

    def rate(self, nbytes: int) -> float:
        return len(self.latencies) * nbytes / self.seconds / 1e6


async def _load(url: str, params: dict, body: bytes, requests: int, concurrency: int, check) -> Round:
    """``requests`` POSTs of ``body`` with ``concurrency`` in flight, through httpx (the
    client of the issue's measurement); ``check(answer)`` raises on a wrong one."""
    import httpx

    latencies: list[float] = []
    pending = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def client_loop():
            for _ in pending:
                t0 = time.perf_counter()
                r = await client.post("/v1/encode", params=params, content=body)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise AssertionError(f"{url} answered {r.status_code}: {r.text[:200]}")
                check(r.content)

        cpu_before = _cpu_seconds()
        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        cpu = _cpu_seconds()
        cpu.subtract(cpu_before)
        return Round(seconds, latencies, cpu)


def _start_bare_app() -> tuple[subprocess.Popen, str]:
    import urllib.request

    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "fp8ray.bench.bare_http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            urllib.request.urlopen(f"{url}/healthz", timeout=5).read()
            return process, url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise ChildProcessError(f"the bare app did not start: {process.stderr.read().decode()[-2000:]}") from None
            time.sleep(0.2)


def _cpu_line(label: str, best: Round) -> str:
    per_request = {role: s * 1e3 / len(best.latencies) for role, s in best.cpu.items() if s > 0}
    parts = ", ".join(f"{role} {ms:.2f}" for role, ms in sorted(per_request.items(), key=lambda kv: -kv[1]))
    return f"{'':>8}   CPU ms/request, {label}: total {sum(per_request.values()):.2f} ({parts})"


def bench_serve(sizes: list[int], concurrency: int, bytes_per_size: int, service_options: dict) -> str:
    """Start a local Ray, the service and the bare app; run both per block size; a table."""
    import ray

    from ..serve.environment import StateFolder, apply_serve_environment, check_haproxy_sockets
    from ..serve.options import ServiceOptions

    service = ServiceOptions.from_args(service_options)
    too_large = [size for size in sizes if size > service.max_body_bytes]
    if too_large:  # the service would answer 413, after Ray and Serve had started
        raise InvalidOptionError(
            f"block size {too_large[0]} bytes is over --max-body-mb {service.max_body_mb:g}: raise it, or bench smaller sizes",
            field="sizes",
        )
    state = StateFolder()
    try:
        if not ray.is_initialized():
            # The Ray started below runs Serve as `fp8ray serve --haproxy` does: set before it starts.
            apply_serve_environment(state.path, haproxy=True)  # measured as `fp8ray serve --haproxy` runs
            check_haproxy_sockets(os.environ)
        from ray import serve  # after the environment (Serve reads it as it is imported); the serve extra may be missing

        from ..engine.address import LOCAL
        from ..engine.runtime import check_placeable, connect_ray, disconnect_ray
        from ..serve.deployment import build_app
        from .codec import describe_machine
    except BaseException:
        state.remove()
        raise

    bare = None
    owns_ray = deployed = False
    try:
        bare, bare_url = _start_bare_app()
        # Always a Ray of its own (or this process's, already connected): on a cluster's Ray
        # Serve's port, its route "/" and its shutdown would be another's (RAY_ADDRESS too).
        owns_ray = connect_ray(None if ray.is_initialized() else LOCAL, None)
        if owns_ray:  # nothing else joins it: QuantWorkers it cannot hold would wait forever
            have = ray.cluster_resources()
            check_placeable(service.workers, service.cpus_per_worker, service.gpus_per_worker, have, joinable=False)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(service_options), name=BENCH_APP, route_prefix="/")
        deployed = True
        serve_url = f"http://127.0.0.1:{port}"
        # A fast plain mode, so that the figures are the service's cost, not the scale search's.
        query = {"scaling": "tensor", "scale_dtype": "float32", "scale_choice": "amax"}
        codec = Fp8Codec(options=CodecOptions.parse(query))
        lines = [
            f"fp8ray bench serve: POST /v1/encode of bf16 blocks (scaling tensor), {concurrency} in flight, "
            f"{service_options.get('workers', 2)} QuantWorkers, {service_options.get('replicas') or 1} replica(s); "
            "bare = a FastAPI/uvicorn app that reads the body and answers as many bytes as the service; "
            f"best of {ROUNDS} rounds each, taking turns",
            describe_machine(),
            f"{'block':>8} {'requests':>8} | {'bare MB/s':>10} {'p50 ms':>7} {'p99 ms':>7} "
            f"| {'serve MB/s':>10} {'p50 ms':>7} {'p99 ms':>7} | {'serve/bare':>10}",
        ]
        for size in sizes:
            rows = size // (2 * ROW)
            t = torch.randn(rows, ROW, generator=torch.Generator().manual_seed(size)).to(torch.bfloat16)
            body = tensor_to_bytes(t).tobytes()
            frame = bytes(codec.encode(t))
            expected = _digest(frame)

            def check_frame(answer: bytes, expected=expected) -> None:
                if _digest(answer) != expected:
                    raise AssertionError("the service answered a wrong frame")

            def check_length(answer: bytes, frame=frame) -> None:
                if len(answer) != len(frame):
                    raise AssertionError(f"the bare app answered {len(answer)} bytes, not {len(frame)}")

            requests = max(16, min(2000, bytes_per_size // len(body)) // ROUNDS)
            serve_params = {"dtype": "bfloat16", "shape": f"{rows},{ROW}", **query}
            paths = {
                "bare": (bare_url, {"answer": str(len(frame))}, check_length),
                "serve": (serve_url, serve_params, check_frame),
            }
            best: dict[str, Round] = {}
            for url, params, check in paths.values():  # warm up
                asyncio.run(_load(url, params, body, min(requests, 2 * concurrency), concurrency, check))
            for _ in range(ROUNDS):
                for path, (url, params, check) in paths.items():
                    result = asyncio.run(_load(url, params, body, requests, concurrency, check))
                    if path not in best or result.seconds < best[path].seconds:
                        best[path] = result
            b, s = best["bare"], best["serve"]
            b_ms = [_percentile(b.latencies, q) * 1e3 for q in (50, 99)]
            s_ms = [_percentile(s.latencies, q) * 1e3 for q in (50, 99)]
            b_rate, s_rate = b.rate(len(body)), s.rate(len(body))
            lines.append(
                f"{_human(len(body)):>8} {requests:>8} | {b_rate:>10.1f} {b_ms[0]:>7.2f} {b_ms[1]:>7.2f} | "
                f"{s_rate:>10.1f} {s_ms[0]:>7.2f} {s_ms[1]:>7.2f} | {s_rate / b_rate:>10.2f}"
            )
            lines += [_cpu_line("bare", b), _cpu_line("serve", s)]
        return "\n".join(lines)
    finally:
        if bare is not None:
            bare.kill()
            bare.wait()
        # Only what it deployed; its own Ray then goes whole (as `fp8ray serve` stops).
        if deployed:
            serve.delete(BENCH_APP)
        if owns_ray:
            disconnect_ray()
        state.remove()


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"
