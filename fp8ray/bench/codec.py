"""``fp8ray bench codec``: throughput of the fast path beside the torch reference and a
memory copy, all measured in the same run. Figures are GB/s of bytes read plus written
(input plus frame), medians of ``repeat`` runs after a warm-up.

- encode: ``Fp8Codec.encode(x, out=...)`` into a reused frame (computes its CRC-32C),
  like the copy baseline's preallocated ``dst``, against ``reference.quantize``;
- encode, new frame: ``Fp8Codec.encode(x)``, which also pays for the frame's fresh pages;
- decode: ``fp8ray.decode(frame, out=...)`` into a preallocated tensor (verifies the
  CRC-32C), like the copy baseline's preallocated ``dst``, against ``reference.dequantize``;
- decode, new tensor: ``fp8ray.decode(frame)``, which also pays for a fresh output
  tensor: the kernel's first touch of new pages can cost as much as the decode itself.

A default run covers every scaling with the default mode's other options (bfloat16
scales, chosen by least squared error where the scaling allows it); ``--scale-choice
amax`` and ``--scale-dtype float32`` measure the plain modes. Each mode with the scale
search is measured beside its plain twin (the same options with amax scales), and the
table ends with what the search costs: its encode over the twin's, the two timed in
turn, call after call, and the best of each kept (the rows' medians are taken mode after
mode, seconds apart, and the machine's speed moves in between).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from ..codec import CodecOptions, Fp8Codec, cpu, decode, reference
from ..eval.sample import sample_kv_chunk


@dataclass
class Row:
    options: CodecOptions
    direction: str
    fast_gbps: float
    reference_gbps: float
    copy_gbps: float

    @property
    def mode(self) -> str:
        return self.options.label()

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
    modes: list[CodecOptions], dtype: torch.dtype = torch.bfloat16, chunks: int = 4, repeat: int = 5, tokens: int = 256
) -> tuple[list[Row], list[str]]:
    """Measure encode and decode of ``chunks`` sample KV chunks ([2, 30, ``tokens``, 192]
    each) under each of ``modes`` (and each searched one's plain twin): the rows, and a
    :func:`search_cost` line per searched mode."""
    x = torch.cat([sample_kv_chunk(tokens=tokens, seed=i, dtype=dtype) for i in range(chunks)], dim=1)
    in_bytes = x.numel() * x.element_size()
    # Bring the allocator to a long-running process's steady state: until a block this
    # large has been freed once, glibc maps each new one fresh from the kernel, and the
    # first "new tensor" rows would time page faults rather than the codec.
    torch.empty(4 * in_bytes, dtype=torch.uint8)
    rows = []
    for mode in dict.fromkeys(with_plain_twins(modes)):  # each once, in order
        rows += _measure(mode, x, repeat)
    return rows, [search_cost(mode, x, rows, repeat) for mode in modes if mode.scale_choice != "amax"]


def search_cost(mode: CodecOptions, x: torch.Tensor, rows: list[Row], repeat: int) -> str:
    """What the scale search costs ``mode``: its encode of ``x`` against its plain twin's,
    the two taking turns ``max(repeat, 5)`` times (each into a reused frame), the best of
    each; and each one's fraction of the copy its rows measured."""
    codecs = [Fp8Codec(options=mode), Fp8Codec(options=plain_twin(mode))]
    frames = [torch.empty(codec.encoded_size(x.shape, x.dtype), dtype=torch.uint8).numpy() for codec in codecs]
    times: list[list[float]] = [[], []]
    for _ in range(max(repeat, 5) + 1):
        for codec, frame, spent in zip(codecs, frames, times):
            start = time.perf_counter()
            codec.encode(x, out=frame)
            spent.append(time.perf_counter() - start)
    best = [min(spent[1:]) for spent in times]  # the first round warms up
    moved = [(x.numel() * x.element_size() + frame.size) / t / 1e9 for frame, t in zip(frames, best)]
    copy = next(r.copy_gbps for r in rows if r.options == mode and r.direction == "encode")
    return (
        f"search cost: {mode.label()} encodes at {moved[0] / moved[1]:.2f} of its plain twin "
        f"({moved[0]:.2f} against {moved[1]:.2f} GB/s, timed in turn, best of {max(repeat, 5)} each; "
        f"{moved[0] / copy:.2f} and {moved[1] / copy:.2f} of the copy)"
    )


def _measure(mode: CodecOptions, x: torch.Tensor, repeat: int) -> list[Row]:
    """The four rows of one mode: encode and decode, each also into a new frame or tensor."""
    in_bytes = x.numel() * x.element_size()
    codec = Fp8Codec(options=mode)
    frame = codec.encode(x)
    moved = in_bytes + len(frame)  # read plus written, either way
    copy = copy_bandwidth(in_bytes, repeat)
    args = (codec.fmt, mode.scaling, mode.block_size)
    reused = torch.empty(len(frame), dtype=torch.uint8).numpy()
    t_fast_enc = _seconds(lambda: codec.encode(x, out=reused), repeat)
    t_fast_enc_new = _seconds(lambda: codec.encode(x), repeat)
    t_ref_enc = _seconds(lambda: reference.quantize(x, *args, False, mode.scale_dtype, mode.scale_choice), max(1, repeat // 2))
    codes, scales, _ = reference.quantize(x, *args, False, mode.scale_dtype, mode.scale_choice)
    out = torch.empty_like(x)
    t_fast_dec = _seconds(lambda: decode(frame, out=out), repeat)
    t_fast_dec_new = _seconds(lambda: decode(frame), repeat)
    t_ref_dec = _seconds(
        lambda: reference.dequantize(codes, scales, codec.fmt, mode.scaling, tuple(x.shape), x.dtype, mode.block_size),
        max(1, repeat // 2),
    )
    return [
        Row(mode, "encode", moved / t_fast_enc / 1e9, moved / t_ref_enc / 1e9, copy),
        Row(mode, "encode, new frame", moved / t_fast_enc_new / 1e9, moved / t_ref_enc / 1e9, copy),
        Row(mode, "decode", moved / t_fast_dec / 1e9, moved / t_ref_dec / 1e9, copy),
        Row(mode, "decode, new tensor", moved / t_fast_dec_new / 1e9, moved / t_ref_dec / 1e9, copy),
    ]


def plain_twin(mode: CodecOptions) -> CodecOptions:
    """The same options with amax scales: what the scale search is measured against."""
    return dataclasses.replace(mode, scale_choice="amax")


def with_plain_twins(modes: list[CodecOptions]) -> list[CodecOptions]:
    """``modes``, each searched one followed by its :func:`plain_twin`."""
    out = []
    for mode in modes:
        out.append(mode)
        if mode.scale_choice != "amax":
            out.append(plain_twin(mode))
    return out


def format_table(rows: list[Row], costs: list[str], title: str) -> str:
    lines = [
        title,
        "",
        "| mode | direction | fast GB/s | torch reference GB/s | copy GB/s | fast / reference | fast / copy |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mode} | {r.direction} | {r.fast_gbps:.2f} | {r.reference_gbps:.3f} | {r.copy_gbps:.1f} "
            f"| {r.vs_reference:.1f}x | {r.vs_copy:.2f} |"
        )
    return "\n".join(lines + ([""] + costs if costs else []))


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
