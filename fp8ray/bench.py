"""``fp8ray bench codec``: throughput of the fast path beside the torch reference and a
memory copy, all measured in the same run. Figures are GB/s of bytes read plus written
(input plus frame), medians of ``repeat`` runs after a warm-up.

- encode: ``Fp8Codec.encode`` (allocates the frame, computes its CRC-32C) against
  ``reference.quantize``;
- decode: ``fp8ray.decode(frame, out=...)`` into a preallocated tensor (verifies the
  CRC-32C), like the copy baseline's preallocated ``dst``, against ``reference.dequantize``;
- decode, new tensor: ``fp8ray.decode(frame)``, which also pays for a fresh output
  tensor: the kernel's first touch of new pages can cost as much as the decode itself.

Besides the scalings, a default run covers :data:`KV_MODE`, the most accurate mode on
real K/V at the token mode's storage (docs/ACCURACY.md): blocks of 32, bfloat16 scales,
scales chosen by least squared error (about 10x the encoding time of plain amax scales).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from . import cpu, reference
from .codec import Fp8Codec, decode
from .formats import SCALINGS, resolve_options
from .sample import sample_kv_chunk


@dataclass(frozen=True)
class Mode:
    """One codec configuration to measure (the format and dtype are the run's)."""

    scaling: str
    block_size: int
    scale_dtype: str = "float32"
    scale_choice: str = "amax"

    @property
    def label(self) -> str:
        parts = [self.scaling + (f" {self.block_size}" if self.scaling == "block" and self.block_size != 128 else "")]
        if self.scale_dtype != "float32" and self.scaling != "none":
            parts.append(f"{self.scale_dtype} scales")
        if self.scale_choice != "amax":
            parts.append(self.scale_choice)
        return ", ".join(parts)


KV_MODE = Mode("block", 32, "bfloat16", "mse")


@dataclass
class Row:
    scaling: str  # the mode's label
    direction: str
    fast_gbps: float
    reference_gbps: float
    copy_gbps: float

    @property
    def vs_reference(self) -> float:
        return self.fast_gbps / self.reference_gbps

    @property
    def vs_copy(self) -> float:
        return self.fast_gbps / self.copy_gbps


def _seconds(fn, repeat: int) -> float:
    fn()  # warm up (JIT compile, page faults)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, repeat: int) -> float:
    """Bytes read plus written per second by a preallocated ``dst.copy_(src)``."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / _seconds(lambda: dst.copy_(src), repeat) / 1e9


def bench_codec(
    fp8: str = "e4m3fn",
    dtype: torch.dtype = torch.bfloat16,
    chunks: int = 4,
    block_size: int = 128,
    repeat: int = 5,
    scalings=tuple(SCALINGS),
    scale_dtype: str = "float32",
    scale_choice: str = "amax",
    extra_modes=(KV_MODE,),
) -> list[Row]:
    """Measure encode and decode of ``chunks`` sample KV chunks ([2, 30, 256, 192] each)
    for each of ``scalings`` (with ``block_size``, ``scale_dtype``, ``scale_choice``), then
    each of ``extra_modes`` not already measured."""
    modes = [Mode(s, block_size, scale_dtype, scale_choice) for s in scalings]
    modes += [m for m in extra_modes if m not in modes]
    x = torch.cat([sample_kv_chunk(seed=i, dtype=dtype) for i in range(chunks)], dim=1)
    in_bytes = x.numel() * x.element_size()
    # Bring the allocator to a long-running process's steady state: until a block this
    # large has been freed once, glibc maps each new one fresh from the kernel, and the
    # first "new tensor" rows would time page faults rather than the codec.
    torch.empty(4 * in_bytes, dtype=torch.uint8)
    rows = []
    for mode in modes:
        scaling, size = mode.scaling, mode.block_size
        codec = Fp8Codec(fp8, scaling, size, scale_dtype=mode.scale_dtype, scale_choice=mode.scale_choice)
        frame = codec.encode(x)
        moved_encode = in_bytes + len(frame)
        moved_decode = len(frame) + in_bytes
        copy = copy_bandwidth(in_bytes, repeat)
        options = (mode.scale_dtype, mode.scale_choice)
        t_fast_enc = _seconds(lambda: codec.encode(x), repeat)
        t_ref_enc = _seconds(lambda: reference.quantize(x, codec.fmt, scaling, size, False, *options), max(1, repeat // 2))
        codes, scales, _ = reference.quantize(x, codec.fmt, scaling, size, False, *options)
        out = torch.empty_like(x)
        t_fast_dec = _seconds(lambda: decode(frame, out=out), repeat)
        t_fast_dec_new = _seconds(lambda: decode(frame), repeat)
        t_ref_dec = _seconds(
            lambda: reference.dequantize(codes, scales, codec.fmt, scaling, tuple(x.shape), dtype, size),
            max(1, repeat // 2),
        )
        label = mode.label
        rows.append(Row(label, "encode", moved_encode / t_fast_enc / 1e9, moved_encode / t_ref_enc / 1e9, copy))
        rows.append(Row(label, "decode", moved_decode / t_fast_dec / 1e9, moved_decode / t_ref_dec / 1e9, copy))
        rows.append(
            Row(label, "decode, new tensor", moved_decode / t_fast_dec_new / 1e9, moved_decode / t_ref_dec / 1e9, copy)
        )
    return rows


def format_table(rows: list[Row], title: str) -> str:
    lines = [
        title,
        "",
        "| scaling | direction | fast GB/s | torch reference GB/s | copy GB/s | fast / reference | fast / copy |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.scaling} | {r.direction} | {r.fast_gbps:.2f} | {r.reference_gbps:.3f} | {r.copy_gbps:.1f} "
            f"| {r.vs_reference:.1f}x | {r.vs_copy:.2f} |"
        )
    return "\n".join(lines)


def describe_machine() -> str:
    import os
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{model}, {os.cpu_count()} CPUs, {cpu.num_threads()} codec threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def bench_pipeline(chunks: int = 16, max_workers: int = 2, scaling: str | None = None, repeat: int = 3) -> str:
    """End-to-end ``compress`` on a local Ray (Ray and actor start excluded) for 1..N
    workers, beside the single-process codec encoding the same blocks in the same run.
    Figures are GB/s of input. ``scaling`` None means the KV default mode."""
    import os
    import tempfile

    import ray
    from safetensors.torch import save_file

    from .operations import compress_archive
    from .pool import connect_ray

    tensors = {f"chunk{i:04d}": sample_kv_chunk(seed=i) for i in range(chunks)}
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    options = resolve_options(scaling=scaling)
    codec = Fp8Codec(**options)
    codec_gbps = raw / sum(_seconds(lambda t=t: codec.encode(t), repeat) for t in tensors.values()) / 1e9
    lines = [
        f"fp8ray bench pipeline: {chunks} x [2, 30, 256, 192] bfloat16 ({raw / 2**20:.0f} MiB), codec {options}",
        describe_machine(),
        "",
        f"single-process codec (Fp8Codec.encode, {cpu.num_threads()} threads, data in memory): {codec_gbps:.2f} GB/s",
        "",
        "| workers | compress GB/s of input | compress / codec alone |",
        "|---:|---:|---:|",
    ]
    owns = connect_ray("local", max(max_workers, os.cpu_count() or 1))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            source = f"{tmp}/kv.safetensors"
            save_file(tensors, source)
            for workers in range(1, max_workers + 1):
                runs = [
                    compress_archive(source, f"{tmp}/a{workers}", **options, workers=workers, part_bytes=16 << 20, overwrite=True)
                    for _ in range(repeat)
                ]
                best = statistics.median(r.input_gbps for r in runs)
                lines.append(f"| {workers} | {best:.2f} | {best / codec_gbps:.0%} |")
    finally:
        if owns:
            ray.shutdown()
    return "\n".join(lines)
