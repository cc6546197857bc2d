"""Where a CUDA encode's time goes: ``reference.quantize`` of 128 Mi bf16 elements (block
32, mse with the search's Triton kernel where there is one, and amax), best of 5 each,
then a torch profiler table of one mse quantize (kernels by GPU time) and of one
``Fp8Codec().encode`` into a reused pinned frame (calls by CPU time: the copies, the
checksum, the syncs).

    python3 scripts/gpu_profile.py [--mib 256]

Needs a CUDA GPU (and fp8ray's dependencies; on the lent machine, crc32c carried as a
wheel). The quantize figures in BENCHMARKS.md ("The CUDA path made fast") come from it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fp8ray from this checkout

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from fp8ray.codec import Fp8Codec, cuda_search, reference  # noqa: E402
from fp8ray.codec.devices import host_buffer  # noqa: E402
from fp8ray.codec.formats import FORMATS  # noqa: E402


def best_ms(fn, runs: int = 5) -> float:
    fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="MiB of bf16 input (default 256)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA GPU here")
        return 0
    fmt = FORMATS["e4m3fn"]
    x = (torch.randn(args.mib * 2**19 // 4096, 4096, device="cuda") * 3).bfloat16()
    lanes = cuda_search.lanes_for(x.device)
    kernel = "the search's Triton kernel" if lanes is cuda_search.error_lanes else "the search in torch ops"
    mse = lambda: reference.quantize(x, fmt, "block", 32, True, "bfloat16", "mse", lanes)  # noqa: E731
    amax = lambda: reference.quantize(x, fmt, "block", 32, True, "bfloat16", "amax")  # noqa: E731
    print(f"{torch.cuda.get_device_name(0)}, {x.numel() / 2**20:.0f} Mi elements, {kernel}")
    print(f"reference.quantize, block 32: mse {best_ms(mse):.2f} ms, amax {best_ms(amax):.2f} ms (best of 5)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        mse()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    codec = Fp8Codec()
    out = host_buffer(codec.encoded_size(x.shape, x.dtype), x.device)
    print(f"Fp8Codec().encode into a reused pinned frame: {best_ms(lambda: codec.encode(x, out=out)):.2f} ms (best of 5)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        codec.encode(x, out=out)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
