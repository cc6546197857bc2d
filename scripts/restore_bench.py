"""Decompress of one large safetensors file: each process's peak memory, and the work's
time with 1 and 2 QuantWorkers.

    .venv/bin/python scripts/restore_bench.py --mib 512 4096 [--runs 3] [--dir /tmp/restore-bench] [--out /dev/shm]

For each size: a single-file source of 8 MiB bfloat16 blocks (one random block, written
again under each key: decode's speed does not depend on the values), compressed with
``--scaling tensor --scale-choice amax --lossless none`` (the codec should not hide the
rest; 64 MiB parts, the default), then decompressed on one embedded local Ray (2 CPUs),
1 and 2 workers taking turns, ``--runs`` times each, each run on fresh actors. Prints
per run the work's seconds (``DecompressReport.seconds``: once the workers are up) and
the peak RSS (``VmHWM``) of the driver (reset before each run) and of each worker, and
what the driver and workers held before the run. Deletes what it wrote.

Figures quoted in BENCHMARKS.md ("One big file, every worker") come from this script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

BLOCK = (2, 4, 1024, 512)  # 8 MiB of bfloat16


def peak_rss(pid: int | str = "self") -> int:
    """The process's peak resident set (``VmHWM``), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def prepare(mib: int, directory: str) -> str:
    """Write the source and compress it (inline workers); returns the archive's path."""
    import torch

    from fp8ray import CodecOptions, PoolSettings
    from fp8ray.engine.archives import compress_archive
    from fp8ray.io.safetensors import SafetensorsWriter

    block = torch.randn(BLOCK, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    count = mib * 2**20 // block.nbytes
    src, arch = f"{directory}/kv{mib}.safetensors", f"{directory}/arch{mib}"
    with SafetensorsWriter(src, [(f"layer{i:04d}", "bfloat16", BLOCK) for i in range(count)]) as writer:
        for _ in range(count):
            writer.write(block.view(torch.uint8).numpy().reshape(-1))
    options = CodecOptions(scaling="tensor", scale_choice="amax")
    compress_archive(src, arch, options=options, lossless="none", pool=PoolSettings(num_workers=2, address="inline"))
    os.remove(src)
    return arch


def decompress_runs(arch: str, out: str, runs: int) -> list[dict]:
    """In this process: one embedded Ray, then 1 and 2 workers in turn, ``runs`` times each."""
    import torch

    from fp8ray import CodecOptions, Fp8Codec
    from fp8ray.engine.archives import decompress_archive
    from fp8ray.engine.pool import QuantPool
    from fp8ray.engine.runtime import connect_ray, disconnect_ray

    connect_ray("local", 2)
    # The archive's dtype: a kernel is loaded for each dtype it decodes into.
    block = torch.zeros(BLOCK[-1], dtype=torch.bfloat16)
    warm_up = bytes(Fp8Codec(options=CodecOptions(scaling="tensor", scale_choice="amax")).encode(block))
    results = []
    try:
        for _ in range(runs):
            for workers in (1, 2):
                with QuantPool(num_workers=workers) as pool:
                    pids = [w.pid for w in pool.worker_info()]
                    # One frame decoded on each worker first: loading the kernel is not the work.
                    pool.decode_many([warm_up] * workers, batch_size=1)
                    before = {"driver": rss(), "workers": [rss(p) for p in pids]}
                    with open("/proc/self/clear_refs", "w") as f:
                        f.write("5")  # resets this process's VmHWM
                    report = decompress_archive(arch, out, pool=pool, overwrite=True)
                    results.append(
                        {
                            "workers": workers,
                            "seconds": report.seconds,
                            "gbps": report.output_gbps,
                            "driver_peak": peak_rss(),
                            "worker_peaks": [peak_rss(p) for p in pids],
                            "before": before,
                        }
                    )
                os.remove(out)
    finally:
        disconnect_ray()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/restore-bench")
    parser.add_argument("--out", help="where the output is written (default: --dir; /dev/shm: no disk)")
    parser.add_argument("--_decompress", nargs=2, help=argparse.SUPPRESS)  # ARCH OUT: one measuring process
    args = parser.parse_args()
    if args._decompress:
        print(json.dumps(decompress_runs(*args._decompress, args.runs)))
        return
    os.makedirs(args.dir, exist_ok=True)
    gib = 2**30
    try:
        for mib in args.mib:
            start = time.perf_counter()
            arch = prepare(mib, args.dir)
            print(f"{mib} MiB: source written and compressed in {time.perf_counter() - start:.0f} s", flush=True)
            out = f"{args.out or args.dir}/out.safetensors"
            done = subprocess.run(
                [sys.executable, __file__, "--runs", str(args.runs), "--_decompress", arch, out],
                capture_output=True,
                text=True,
                check=True,
            )
            results = json.loads(done.stdout.strip().splitlines()[-1])
            shutil.rmtree(arch)
            for r in results:
                print(
                    f"  {r['workers']} worker(s): {r['seconds']:.2f} s ({r['gbps']:.2f} GB/s); peak RSS driver "
                    f"{r['driver_peak'] / gib:.2f} GiB, workers "
                    + ", ".join(f"{p / gib:.2f}" for p in r["worker_peaks"])
                    + f" GiB (before: driver {r['before']['driver'] / gib:.2f}, workers "
                    + ", ".join(f"{p / gib:.2f}" for p in r["before"]["workers"])
                    + ")",
                    flush=True,
                )
            for workers in (1, 2):
                times = sorted(r["seconds"] for r in results if r["workers"] == workers)
                print(f"  {workers} worker(s): min {times[0]:.2f} s, median {statistics.median(times):.2f} s")
            one = sorted(r["seconds"] for r in results if r["workers"] == 1)
            two = sorted(r["seconds"] for r in results if r["workers"] == 2)
            median = statistics.median(one) / statistics.median(two)
            print(f"  2 workers against 1: {one[0] / two[0]:.2f}x (min), {median:.2f}x (median)")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
