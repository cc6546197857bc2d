"""Where one archive part's time goes: read, encode, Arrow column, Parquet write, timed
in-process with one codec thread (as a one-CPU QuantWorker runs it), then the same parts
written by QuantWorker.compress_part in-process and through one Ray actor.

    .venv/bin/python scripts/part_phases.py [--chunks 16] [--scaling token]

Figures quoted in BENCHMARKS.md ("bench pipeline") come from this script.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ["FP8RAY_NUM_THREADS"] = "1"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from fp8ray import CodecOptions, Fp8Codec  # noqa: E402
from fp8ray.engine.worker import QuantWorker  # noqa: E402
from fp8ray.eval.sample import sample_kv_chunk  # noqa: E402
from fp8ray.io import archive  # noqa: E402
from fp8ray.io.blocks import bytes_to_tensor, list_blocks, read_blocks  # noqa: E402
from fp8ray.io.paths import resolve  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument(
        "--scaling", default="token", help="plain scaling (float32 scales by amax; default token), or 'kv' for the default mode"
    )
    args = parser.parse_args()
    options = (
        CodecOptions() if args.scaling == "kv" else CodecOptions(scaling=args.scaling, scale_dtype="float32", scale_choice="amax")
    )
    codec = Fp8Codec(options=options)
    tmp = tempfile.mkdtemp()
    save_file({f"c{i:03d}": sample_kv_chunk(seed=i) for i in range(args.chunks)}, f"{tmp}/kv.safetensors")
    refs = list_blocks(f"{tmp}/kv.safetensors")
    fs, out = resolve(f"{tmp}/phases")
    os.makedirs(out)
    phases = dict.fromkeys(("read", "encode", "column", "write"), 0.0)
    for _ in range(2):  # the second pass is timed: files and buffers are warm
        phases = dict.fromkeys(phases, 0.0)
        for i, ref in enumerate(refs):
            t0 = time.perf_counter()
            [data] = read_blocks([ref])
            t1 = time.perf_counter()
            size = codec.encoded_size(ref.shape, ref.dtype)
            frames = np.empty(size, np.uint8)
            codec.encode(bytes_to_tensor(data, ref.dtype, ref.shape), out=frames)
            t2 = time.perf_counter()
            rows = archive.part_rows([ref], options, [size], archive.frame_column(frames, [size]))
            t3 = time.perf_counter()
            archive.write_part(fs, out, i, rows)
            t4 = time.perf_counter()
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[name] += dt
    mb = refs[0].nbytes / 1e6
    print(f"codec {options.label()}; parts of one {mb:.1f} MB block, mean of {len(refs)}:")
    print("  " + ", ".join(f"{name} {total / len(refs) * 1e3:.2f} ms" for name, total in phases.items()))

    total = sum(r.nbytes for r in refs)
    worker = QuantWorker(1)
    os.makedirs(f"{tmp}/a0")
    worker.compress_part(refs[:1], options, f"{tmp}/a0", 0)  # warm-up
    t = time.perf_counter()
    for i, ref in enumerate(refs):
        worker.compress_part([ref], options, f"{tmp}/a0", i)
    print(f"  QuantWorker.compress_part in-process: {total / (time.perf_counter() - t) / 1e9:.2f} GB/s")

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(QuantWorker).options(num_cpus=1).remote(1)
        os.makedirs(f"{tmp}/a1")
        ray.get(actor.compress_part.remote(refs[:1], options, f"{tmp}/a1", 0))  # warm-up
        t = time.perf_counter()
        for i, ref in enumerate(refs):
            ray.get(actor.compress_part.remote([ref], options, f"{tmp}/a1", i))
        print(f"  the same through one Ray actor, one part at a time: {total / (time.perf_counter() - t) / 1e9:.2f} GB/s")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
