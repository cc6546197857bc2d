"""``fp8ray bench lmcache``: fp8ray's serde inside the real LMCache beside LMCache's own
``"fp8"`` serde (the baseline), on a real model's KV cache, in the same run.

Every serde is built the way an L2 adapter's config builds it
(``create_serde_processor(SerdeConfig(type, kwargs))``) and driven through LMCache's
``AsyncSerdeProcessor``: one ``submit_serialize`` of all chunks, waited on through its
event fd and ``query_serialize_result``, then the same for ``submit_deserialize``. The
chunks are the shipped model's KV cache (SmolLM2-135M over the shipped text) in LMCache's
layout ``[2 (K, V), layers, chunk_tokens, kv_heads * head_dim]``, bfloat16, held in
LMCache ``TensorMemoryObj`` s.

Figures per serde: bytes stored per chunk (its ``estimate_serialized_size``, which is
what the adapter stores), the relative Frobenius error of K and V over all chunks
(:mod:`fp8ray.codec.metrics`), and serialize / deserialize throughput in GB/s of KV (the
chunks' bf16 bytes) per second, the median of ``repeat`` timed runs after a warm-up, the
serdes taking turns run after run. Each row's ratios are against LMCache's ``fp8`` row.

Each run stores ``copies`` copies of the chunks, each in memory of its own. The shipped
model's chunks are small (5.9 MB for 256 tokens); stored again and again they stay in
the CPU's cache, where LMCache's plain cast runs about twice as fast as from memory. A
chunk of an 8B model (33.5 MB) is larger than that cache, and LMCache stores each chunk
once, after the GPU wrote it to host memory: enough copies put the run's chunks out of
the cache, as LMCache's are (BENCHMARKS.md, "LMCache serde").
"""

from __future__ import annotations

import select
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..codec import CodecOptions
from ..codec.metrics import ErrorSums, error_sums
from ..errors import WorkerLostError
from ..eval.capture import capture_kv
from ..eval.models import load_model, read_text, tokenize
from .codec import describe_machine

SHIPPED_TEXT = Path(__file__).resolve().parents[1] / "eval" / "texts" / "lighthouse.txt"
# The fast alternative to the default mode (README): same bytes, amax scales.
FAST_MODE = "e4m3fn:block:block_size=32:scale_dtype=bfloat16:scale_choice=amax"


def kv_chunks(blocks: dict[str, torch.Tensor], chunk_tokens: int) -> list[torch.Tensor]:
    """LMCache KV chunks ``[2, layers, tokens, kv_heads * head_dim]`` from captured blocks
    (``layer007.k``: ``[kv_heads, tokens, head_dim]``, as :func:`~fp8ray.eval.capture.capture_kv`
    returns them), ``chunk_tokens`` tokens each; a last, shorter chunk is kept, as LMCache
    keeps one."""
    layers = sorted({key.rsplit(".", 1)[0] for key in blocks})

    def rows(kind: str) -> torch.Tensor:  # [layers, tokens, kv_heads * head_dim]
        per_layer = [blocks[f"{layer}.{kind}"] for layer in layers]
        return torch.stack([t.permute(1, 0, 2).reshape(t.shape[1], -1) for t in per_layer])

    kv = torch.stack([rows("k"), rows("v")])
    return [c.contiguous() for c in kv.split(chunk_tokens, dim=2)]


def capture_chunks(tokens: int, chunk_tokens: int = 256, model=None, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """The shipped (or given) model's KV cache over the first ``tokens`` tokens of the
    shipped text, as LMCache chunks."""
    loaded = load_model(model)
    ids = tokenize(loaded, read_text(SHIPPED_TEXT), tokens, what=f"text file {SHIPPED_TEXT}")
    return kv_chunks(capture_kv(loaded, ids, dtype), chunk_tokens)


def memory_obj(shapes, dtypes):
    """A fresh LMCache ``TensorMemoryObj`` of this layout (one shape and dtype per kernel
    group), on the CPU, as LMCache's allocators make them."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    shapes = [torch.Size(s) for s in shapes]
    size = sum(s.numel() * d.itemsize for s, d in zip(shapes, dtypes))
    meta = MemoryObjMetadata(shapes[0], dtypes[0], 0, size, 1, 0, MemoryFormat.KV_2LTD, shapes=shapes, dtypes=list(dtypes))
    return TensorMemoryObj(torch.zeros(size, dtype=torch.uint8), meta, None)


def kv_obj(tensor: torch.Tensor):
    """An LMCache memory object holding a copy of one KV tensor."""
    obj = memory_obj([tensor.shape], [tensor.dtype])
    obj.tensor.copy_(tensor)
    return obj


def byte_obj(size: int):
    """An LMCache byte buffer of ``size`` bytes, as the serde wrapper allocates for a serde."""
    return memory_obj([(size,)], [torch.uint8])


def run_task(processor, direction: str, srcs: list, dsts: list, keys: list, timeout: float = 600.0) -> bool:
    """Submit one ``direction`` ("serialize" or "deserialize") task to an LMCache
    ``SerdeProcessor`` and wait for it on its event fd, as LMCache's serde wrapper does;
    returns the task's result (True: every object succeeded)."""
    from lmcache.v1.platform import consume_fd

    task = getattr(processor, f"submit_{direction}")(srcs, dsts, keys)
    query = getattr(processor, f"query_{direction}_result")
    fd = getattr(processor, f"get_{direction}_event_fd")()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while (result := query(task)) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"LMCache {direction} task {task} did not finish in {timeout:.0f} s")
        if poller.poll(int(left * 1000) + 1):
            consume_fd(fd)  # the notifier fired: the result is stored, query again
    return result


@dataclass
class Row:
    serde: str  # the name in the table
    bytes_per_chunk: int
    raw_per_chunk: int
    k_err: float
    v_err: float
    serialize_gbps: float
    deserialize_gbps: float


def keys_for(count: int) -> list:
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(chunk_hash=i.to_bytes(8, "big"), model_name="bench/model", kv_rank=0x01000100) for i in range(count)]


class _Subject:
    """One serde under test: its processor, and buffers for ``chunks`` (all of one shape;
    each in memory of its own)."""

    def __init__(self, name: str, processor, chunks: list[torch.Tensor]):
        from lmcache.v1.distributed.api import MemoryLayoutDesc

        shape, dtype = chunks[0].shape, chunks[0].dtype
        self.name, self.processor = name, processor
        self.size = processor.estimate_serialized_size(MemoryLayoutDesc(shapes=[shape], dtypes=[dtype]))
        self.srcs = [kv_obj(c) for c in chunks]
        self.bufs = [byte_obj(self.size) for _ in chunks]
        self.outs = [memory_obj([shape], [dtype]) for _ in chunks]
        self.keys = keys_for(len(chunks))
        self.times: dict[str, list[float]] = {"serialize": [], "deserialize": []}

    def run(self, direction: str) -> float:
        a, b = (self.srcs, self.bufs) if direction == "serialize" else (self.bufs, self.outs)
        start = time.perf_counter()
        if not run_task(self.processor, direction, a, b, self.keys):
            raise WorkerLostError(f"{self.name}: an LMCache {direction} task failed")
        return time.perf_counter() - start


def bench_lmcache(
    chunks: list[torch.Tensor], modes: list[CodecOptions], repeat: int = 9, max_workers: int = 1, copies: int = 1
) -> list[Row]:
    """LMCache's ``fp8`` serde (the baseline), then fp8ray's serde (registered as
    ``"fp8ray"``) in each of ``modes``, on ``chunks`` (full chunks of one shape), each run
    storing ``copies`` copies of them (the module's docstring says why).

    The serdes take turns, run after run (after one warm-up run each), so a change in
    the machine's load during the benchmark reaches every row alike."""
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    from ..lmcache import SERDE_TYPE, register

    register()
    configs = [("LMCache fp8", SerdeConfig("fp8", {"max_workers": max_workers}))]
    for mode in modes:
        kwargs = {**mode.as_dict(), "max_workers": max_workers}  # as an adapter's "serde" JSON gives them
        configs.append((f"fp8ray {mode.label()}", SerdeConfig(SERDE_TYPE, kwargs)))
    stored = chunks * copies  # _Subject copies each into memory of its own
    subjects = []
    try:
        for name, config in configs:
            subjects.append(_Subject(name, create_serde_processor(config), stored))
        for direction in ("serialize", "deserialize"):
            for attempt in range(repeat + 1):  # the first is a warm-up (JIT, page faults)
                for subject in subjects:
                    seconds = subject.run(direction)
                    if attempt:
                        subject.times[direction].append(seconds)
    finally:
        for subject in subjects:
            subject.processor.close()
    raw = sum(c.numel() * c.element_size() for c in stored)
    rows = []
    for subject in subjects:
        k, v = ErrorSums(), ErrorSums()
        for chunk, out in zip(stored, subject.outs):
            k.add(error_sums(chunk[0], out.tensor[0]))
            v.add(error_sums(chunk[1], out.tensor[1]))
        t_ser, t_de = (statistics.median(subject.times[d]) for d in ("serialize", "deserialize"))
        rows.append(
            Row(subject.name, subject.size, raw // len(stored), k.rel_fro, v.rel_fro, raw / t_ser / 1e9, raw / t_de / 1e9)
        )
    return rows


def format_table(rows: list[Row], title: str) -> str:
    base = rows[0]
    lines = [
        title,
        "",
        "| serde | bytes/chunk | of bf16 | K rel err | V rel err | err / fp8 (K, V) | serialize GB/s | deserialize GB/s "
        "| serialize / fp8 | deserialize / fp8 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.serde} | {r.bytes_per_chunk} | {r.bytes_per_chunk / r.raw_per_chunk:.4f} | {r.k_err:.3%} | {r.v_err:.3%} "
            f"| {r.k_err / base.k_err:.2f}, {r.v_err / base.v_err:.2f} | {r.serialize_gbps:.2f} | {r.deserialize_gbps:.2f} "
            f"| {r.serialize_gbps / base.serialize_gbps:.2f}x | {r.deserialize_gbps / base.deserialize_gbps:.2f}x |"
        )
    return "\n".join(lines)


def describe(chunks: list[torch.Tensor], tokens: int, max_workers: int, load: float | None = None, copies: int = 1) -> str:
    """The table's title: the data, how much of it a run stores, the machine, and its
    1-minute load average when the run began (other processes on the same cores slow
    every row)."""
    shape = list(chunks[0].shape)
    load_text = f", load average {load:.2f} at the start" if load is not None else ""
    raw = copies * sum(c.numel() * c.element_size() for c in chunks)
    return (
        f"fp8ray bench lmcache: SmolLM2-135M KV cache of {tokens} tokens as {len(chunks)} LMCache chunks {shape} "
        f"bfloat16, each run storing {copies} {'copy' if copies == 1 else 'copies'} of them "
        f"({copies * len(chunks)} chunks, {raw / 1e6:.1f} MB of bf16), "
        f"through AsyncSerdeProcessor(max_workers={max_workers})\n{describe_machine()}{load_text}"
    )
