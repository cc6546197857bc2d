"""A load client for a running `fp8ray serve`: POST /v1/encode of one float32 block,
N requests with C in flight, through aiohttp or httpx; prints MB/s of request bodies.

    .venv/bin/fp8ray serve --port 18000 --workers 2 &
    .venv/bin/python scripts/serve_load.py --client aiohttp --requests 600 --size 1048576
    top -b -n 2 -d 4 -o %CPU      # meanwhile: where the service's CPU goes

Figures quoted in BENCHMARKS.md ("bench serve") come from this script.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np


async def run(client: str, url: str, requests: int, concurrency: int, body: bytes, params: dict) -> float:
    pending = iter(range(requests))
    if client == "httpx":
        import httpx

        async with httpx.AsyncClient(base_url=url, timeout=300) as session:

            async def loop():
                for _ in pending:
                    r = await session.post("/v1/encode", params=params, content=body)
                    r.raise_for_status()

            start = time.perf_counter()
            await asyncio.gather(*(loop() for _ in range(concurrency)))
            return time.perf_counter() - start
    import aiohttp

    async with aiohttp.ClientSession(url) as session:

        async def loop():
            for _ in pending:
                async with session.post("/v1/encode", params=params, data=body) as r:
                    r.raise_for_status()
                    await r.read()

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:18000")
    parser.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--size", type=int, default=2**20, help="bytes per block (a multiple of 4)")
    args = parser.parse_args()
    body = np.random.default_rng(0).standard_normal(args.size // 4, dtype=np.float32).tobytes()
    params = {"dtype": "float32", "shape": str(args.size // 4), "scaling": "token"}
    seconds = asyncio.run(run(args.client, args.url, args.requests, args.concurrency, body, params))
    print(
        f"{args.client}: {args.requests} x {args.size} bytes, {args.concurrency} in flight: "
        f"{args.requests * len(body) / seconds / 1e6:.1f} MB/s"
    )


if __name__ == "__main__":
    main()
