"""``fp8ray bench pipeline``: end-to-end compress on a local Ray beside the codec alone."""

from __future__ import annotations

import os
import statistics
import tempfile

from ..codec import CodecOptions, Fp8Codec, cpu
from ..engine.archives import compress_archive
from ..engine.runtime import connect_ray, disconnect_ray
from ..eval.sample import sample_kv_chunk
from ..io.blocks import tensor_to_bytes
from ..io.safetensors import SafetensorsWriter
from .codec import _seconds, describe_machine


def bench_pipeline(chunks: int = 16, max_workers: int = 2, options: CodecOptions | None = None, repeat: int = 3) -> str:
    """End-to-end ``compress`` on a local Ray (Ray and actor start excluded) for 1..N
    workers, beside the single-process codec encoding the same blocks in the same run.
    Figures are GB/s of input. ``options`` None means the default mode."""
    tensors = {f"chunk{i:04d}": sample_kv_chunk(seed=i) for i in range(chunks)}
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    options = options or CodecOptions()
    codec = Fp8Codec(options=options)
    codec_gbps = raw / sum(_seconds(lambda t=t: codec.encode(t), repeat) for t in tensors.values()) / 1e9
    lines = [
        f"fp8ray bench pipeline: {chunks} x [2, 30, 256, 192] bfloat16 ({raw / 2**20:.0f} MiB), codec {options.label()}",
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
            with SafetensorsWriter(source, [(k, "bfloat16", tuple(t.shape)) for k, t in tensors.items()]) as writer:
                for t in tensors.values():
                    writer.write(tensor_to_bytes(t))
            for workers in range(1, max_workers + 1):
                runs = [
                    compress_archive(source, f"{tmp}/a{workers}", options=options, workers=workers, part_bytes=16 << 20, overwrite=True)
                    for _ in range(repeat)
                ]
                best = statistics.median(r.input_gbps for r in runs)
                lines.append(f"| {workers} | {best:.2f} | {best / codec_gbps:.0%} |")
    finally:
        if owns:
            disconnect_ray()
    return "\n".join(lines)
