"""``fp8ray bench serve``: the online service's throughput and latency over HTTP, beside
direct calls on the same ``QuantWorker`` actors with the same blocks, in the same run.

The ratio serve/direct is what the HTTP path (proxy, replica, body copies) costs. Every
answer of both paths is checked against the codec's own frame.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time

import numpy as np
import torch

from ..codec import CodecOptions, Fp8Codec
from ..codec.blocks import Block, tensor_to_bytes
from ..errors import InvalidOptionError

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}
ROW = 1024  # bf16 elements per row of a bench block


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536; a plain number is bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = UNITS.get(text[-1:], 1)
    try:
        size = int(float(text[:-1] if text[-1:] in UNITS else text) * scale)
    except ValueError:
        raise InvalidOptionError(f"bad block size {text!r}; expected e.g. 64K, 1M or 16M", field="sizes") from None
    if size < 2 * ROW:
        raise InvalidOptionError(f"block size {text!r} is below the smallest bench block ({2 * ROW} bytes)", field="sizes")
    return size


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _digest(data) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _direct(
    workers: list, block: Block, options: CodecOptions, requests: int, concurrency: int, expected: str
) -> tuple[float, list[float]]:
    """``encode_batch`` on the actors from the driver, ``concurrency`` calls in flight."""
    import ray

    latencies: list[float] = []
    started: dict = {}
    start = time.perf_counter()
    submitted = 0
    while submitted < requests or started:
        while submitted < requests and len(started) < concurrency:
            ref = workers[submitted % len(workers)].encode_batch.remote([block], options)
            started[ref] = time.perf_counter()
            submitted += 1
        [ref], _ = ray.wait(list(started), num_returns=1)
        [(frame, _)] = ray.get(ref)
        latencies.append(time.perf_counter() - started.pop(ref))
        if _digest(frame) != expected:
            raise AssertionError("a direct call answered a wrong frame")
    return time.perf_counter() - start, latencies


async def _http(url: str, params: dict, body: bytes, requests: int, concurrency: int, expected: str) -> tuple[float, list[float]]:
    import httpx

    latencies: list[float] = []
    counter = iter(range(requests))

    async def client_loop(client):
        for _ in counter:
            t0 = time.perf_counter()
            r = await client.post("/v1/encode", params=params, content=body)
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200 or _digest(r.content) != expected:
                raise AssertionError(f"the service answered {r.status_code}: {r.text[:200]}")

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return time.perf_counter() - start, latencies


def bench_serve(sizes: list[int], concurrency: int, bytes_per_size: int, service_options: dict) -> str:
    """Start a local Ray and the service, run both paths per block size, return a table."""
    import ray
    from ray import serve
    from ray.util import list_named_actors

    from ..engine.runtime import connect_ray, disconnect_ray
    from ..serve.deployment import WORKER_PREFIX, build_app
    from .codec import describe_machine

    owns_ray = connect_ray(None, None)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(service_options), name="fp8ray-bench", route_prefix="/")
        names = [a for a in list_named_actors(all_namespaces=True) if WORKER_PREFIX in a["name"]]
        workers = [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names]
        # A fast plain mode, so that the figures are the service's cost, not the scale search's.
        query = {"scaling": "token", "scale_dtype": "float32", "scale_choice": "amax"}
        options = CodecOptions.parse(query)
        codec = Fp8Codec(options=options)
        lines = [
            f"fp8ray bench serve: POST /v1/encode of bf16 blocks (scaling token), {concurrency} in flight, "
            f"{len(workers)} QuantWorkers, {service_options.get('replicas') or 1} replica(s); "
            "direct = QuantWorker.encode_batch from the driver",
            describe_machine(),
            f"{'block':>8} {'requests':>8} | {'direct MB/s':>11} {'p50 ms':>7} {'p99 ms':>7} "
            f"| {'serve MB/s':>10} {'p50 ms':>7} {'p99 ms':>7} | {'serve/direct':>12}",
        ]
        for size in sizes:
            rows = size // (2 * ROW)
            t = torch.randn(rows, ROW, generator=torch.Generator().manual_seed(size)).to(torch.bfloat16)
            raw = tensor_to_bytes(t)
            expected = _digest(codec.encode(t))
            requests = max(16, min(2000, bytes_per_size // raw.nbytes))
            block = Block("bench", "bfloat16", tuple(t.shape), raw)
            _direct(workers, block, options, min(requests, 2 * concurrency), concurrency, expected)  # warm up
            d_time, d_lat = _direct(workers, block, options, requests, concurrency, expected)
            params = {"dtype": "bfloat16", "shape": f"{rows},{ROW}", **query}
            body = raw.tobytes()
            asyncio.run(_http(f"http://127.0.0.1:{port}", params, body, min(requests, 2 * concurrency), concurrency, expected))
            s_time, s_lat = asyncio.run(_http(f"http://127.0.0.1:{port}", params, body, requests, concurrency, expected))
            d_rate, s_rate = requests * raw.nbytes / d_time / 1e6, requests * raw.nbytes / s_time / 1e6
            d_ms = [_percentile(d_lat, q) * 1e3 for q in (50, 99)]
            s_ms = [_percentile(s_lat, q) * 1e3 for q in (50, 99)]
            lines.append(
                f"{_human(raw.nbytes):>8} {requests:>8} | {d_rate:>11.1f} {d_ms[0]:>7.2f} {d_ms[1]:>7.2f} | "
                f"{s_rate:>10.1f} {s_ms[0]:>7.2f} {s_ms[1]:>7.2f} | {s_rate / d_rate:>12.2f}"
            )
        return "\n".join(lines)
    finally:
        if owns_ray:
            serve.shutdown()
            disconnect_ray()
        else:
            serve.delete("fp8ray-bench")


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"
