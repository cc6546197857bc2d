"""``fp8ray bench pipeline``: compress and decompress end to end, each against the
machine's own I/O bound measured in the same run, and the object-store path against the
codec alone.

- **I/O bound**: the time plain sequential file I/O takes to read what the operation
  reads and write what it writes (a new file in the same directory, 8 MiB writes, no
  sync, as fp8ray writes): compress reads the source and writes the archive's bytes;
  decompress reads the archive's size and writes the source's bytes back. Every timed
  step starts after ``sync``, so that no step pays for the write-back of the one
  before, and the bound's writes go where the outputs were, as the operations' did.
- **compress / decompress**: with the pool already up (its start is reported apart), the
  work as the operations' reports time it, GB/s of source bytes; as a ratio of the I/O
  bound (``/ I/O``) and of the codec alone on the same bytes (``/ codec``): whichever
  bound is lower is the one the machine sets.
- **object store**: ``QuantPool.encode_many``/``decode_many`` of the same blocks against
  ``Fp8Codec`` in this process with all its threads; and **by reference**,
  ``encode_refs``/``decode_refs`` of the blocks already in Ray's object store (as upstream
  tasks leave them), until every result is there, the driver fetching nothing: refs of
  ``Block`` s (which a worker reads in place) and of torch tensors (which Ray
  deserialises by copy). Their ``of the codec alone`` is the median over runs of the
  codec alone timed just before each run over the run: the load of a shared machine
  moves within seconds, and a ratio of two figures taken a minute apart measured it.
- **small blocks**: the same bytes as blocks of ``small_block_kib`` KiB (as per-layer KV
  files and small LMCache chunks come), compressed and decompressed on the same pool,
  each run right after a run of the sample chunks: the best work of each as a multiple of
  the chunks', and the per-block overhead, the extra seconds over the extra blocks.

Each figure is the median of ``repeat`` runs, but the I/O bound, which is the best of
them: on a VM, writes into memory the guest has not touched before run at a fraction of
the speed of writes into pages it reuses, and which a run gets is chance.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from ..codec import CodecOptions, Fp8Codec, cpu, decode
from ..codec.blocks import Block
from ..engine.address import INLINE, LOCAL, check_local_size, default_address
from ..engine.archives import compress_archive, decompress_archive
from ..engine.pool import QuantPool
from ..engine.runtime import connect_ray, disconnect_ray
from ..errors import InvalidOptionError
from ..eval.sample import sample_kv_chunk
from ..io.archive import DEFAULT_LOSSLESS
from ..io.blocks import tensor_to_bytes
from ..io.safetensors import SafetensorsWriter
from .codec import describe_machine

CHUNK_BYTES = 2 * 30 * 256 * 192 * 2  # one sample chunk, [2, 30, 256, 192] bf16
IO_PIECE = 8 << 20


def _read_seconds(path: str, buffer: bytearray, limit: int | None = None) -> float:
    """Seconds to read a file or a directory's files (the first ``limit`` bytes)."""
    paths = [os.path.join(path, n) for n in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
    left = limit if limit is not None else sum(os.path.getsize(p) for p in paths)
    start = time.perf_counter()
    for p in paths:
        with open(p, "rb") as f:
            while left > 0 and (n := f.readinto(buffer)):
                left -= n
    return time.perf_counter() - start


def _write_seconds(directory: str, nbytes: int, buffer: bytearray) -> float:
    path = os.path.join(directory, "io-bound.bin")
    view = memoryview(buffer)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(view))
            f.write(view[:n])
            left -= n
    seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return os.path.getsize(path)


def bench_pipeline(
    mib: int = 512,
    max_workers: int = 2,
    options: CodecOptions | None = None,
    repeat: int = 3,
    lossless: str = DEFAULT_LOSSLESS,
    address: str | None = None,
    files: int = 8,
    small_block_kib: int = 16,
) -> str:
    """The table of the module docstring, for 1..``max_workers`` workers, on a source of
    ``files`` safetensors files (a directory, or one file for ``files=1``)."""
    options = options or CodecOptions()
    if (address or default_address()) in (INLINE, LOCAL):  # at once, not after the runs of fewer workers
        check_local_size(max_workers, option="--max-workers")
    chunk_kib = CHUNK_BYTES // 1024
    if small_block_kib >= chunk_kib or chunk_kib % small_block_kib:  # each chunk cut into whole [rows, 64] pieces
        raise InvalidOptionError(
            f"--small-block-kib {small_block_kib}: a small block's KiB divide a sample chunk's {chunk_kib}, "
            "and are fewer (16, 32, 64, 128, ...)",
            field="small_block_kib",
        )
    chunks = max(files, mib * 2**20 // CHUNK_BYTES)
    tensors = {f"chunk{i:04d}": sample_kv_chunk(seed=i) for i in range(chunks)}
    raw = chunks * CHUNK_BYTES
    blocks = list(tensors.values())
    alone = _CodecAlone(Fp8Codec(options=options), blocks)
    codec_seconds = statistics.median(_timed(alone.encode) for _ in range(repeat))
    decode_seconds = statistics.median(_timed(alone.decode) for _ in range(repeat))
    buffer = bytearray(IO_PIECE)
    where = "one safetensors file" if files == 1 else f"a directory of {files} safetensors files"
    lines = [
        f"fp8ray bench pipeline: {chunks} x [2, 30, 256, 192] bfloat16 ({raw / 2**20:.0f} MiB) in {where}; "
        f"codec {options.label()}; lossless {lossless}; median of {repeat}",
        describe_machine(),
        "",
        f"codec alone, in this process ({cpu.num_threads()} threads, data in memory): "
        f"encode {raw / codec_seconds / 1e9:.2f} GB/s, decode {raw / decode_seconds / 1e9:.2f} GB/s",
        "",
        "| workers | pool start s | compress GB/s | I/O bound | / I/O | / codec "
        "| decompress GB/s | I/O bound | / I/O | / codec |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    owns = connect_ray(address, max(max_workers, os.cpu_count() or 1), inline_possible=True) if address != "inline" else False
    tmp = tempfile.mkdtemp(prefix="fp8ray-bench-", dir=os.environ.get("FP8RAY_BENCH_DIR"))
    try:
        source = _write_source(tmp, tensors, files)
        store_row = refs_row = None
        for workers in range(1, max_workers + 1):
            start = time.perf_counter()
            with QuantPool(num_workers=workers, address=address) as pool:
                pool_start = time.perf_counter() - start
                runs = []
                for _ in range(repeat):
                    compressed, restored, archive_bytes = _round_trip(source, tmp, files, options, lossless, pool)
                    # The bound's writes go where the outputs were, as the operations' did.
                    os.sync()
                    bound_c = _read_seconds(source, buffer) + _write_seconds(tmp, archive_bytes, buffer)
                    os.sync()
                    bound_d = _read_seconds(source, buffer, archive_bytes) + _write_seconds(tmp, raw, buffer)
                    runs.append((compressed.seconds, bound_c, restored.seconds, bound_d))
                # The operations' medians; the bound's best run (plain I/O at its fastest here).
                c, d = statistics.median(r[0] for r in runs), statistics.median(r[2] for r in runs)
                bc, bd = min(r[1] for r in runs), min(r[3] for r in runs)
                lines.append(
                    f"| {workers} | {pool_start:.1f} | {raw / c / 1e9:.2f} | {raw / bc / 1e9:.2f} | {bc / c:.2f} "
                    f"| {codec_seconds / c:.2f} "
                    f"| {raw / d / 1e9:.2f} | {raw / bd / 1e9:.2f} | {bd / d:.2f} | {decode_seconds / d:.2f} |"
                )
                if workers == max_workers:
                    small_row = _small_blocks(pool, tmp, source, tensors, files, small_block_kib, options, lossless, repeat)
                    store_row = _object_store(pool, blocks, options, repeat, alone)
                    refs_row = None if pool.inline else _by_reference(pool, blocks, options, repeat, alone)
        (enc, enc_ratio), (dec, dec_ratio) = store_row
        lines += [
            "",
            small_row,
            "",
            f"object store, {max_workers} workers (QuantPool.encode_many / decode_many, blocks in and out of this process; "
            f"/ codec: the codec alone timed beside each run): "
            f"encode {raw / enc / 1e9:.2f} GB/s ({enc_ratio:.2f} of the codec alone), "
            f"decode {raw / dec / 1e9:.2f} GB/s ({dec_ratio:.2f} of the codec alone)",
        ]
        if refs_row is not None:
            (enc, enc_ratio), (enc_tensors, tensors_ratio), (dec, dec_ratio) = refs_row
            lines.append(
                f"by reference, {max_workers} workers (QuantPool.encode_refs / decode_refs, blocks already in the object store, "
                f"results left there): encode of Blocks {raw / enc / 1e9:.2f} GB/s ({enc_ratio:.2f} of the codec "
                f"alone), of torch tensors {raw / enc_tensors / 1e9:.2f} GB/s ({tensors_ratio:.2f}), "
                f"decode {raw / dec / 1e9:.2f} GB/s ({dec_ratio:.2f} of the codec alone)"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if owns:
            disconnect_ray()
    return "\n".join(lines)


def _write_source(tmp: str, tensors: dict, files: int) -> str:
    """The chunks as one safetensors file, or spread over ``files`` files in a directory."""
    keys = list(tensors)
    groups = [keys[i::files] for i in range(files)] if files > 1 else [keys]
    root = os.path.join(tmp, "kv") if files > 1 else tmp
    os.makedirs(root, exist_ok=True)
    for i, group in enumerate(groups):
        path = os.path.join(root, f"kv{i:03d}.safetensors" if files > 1 else "kv.safetensors")
        with SafetensorsWriter(path, [(k, "bfloat16", tuple(tensors[k].shape)) for k in group]) as writer:
            for k in group:
                writer.write(tensor_to_bytes(tensors[k]))
    return root if files > 1 else os.path.join(tmp, "kv.safetensors")


def _round_trip(source: str, tmp: str, files: int, options, lossless: str, pool):
    """Compress ``source`` into ``tmp`` and decompress it back, removing both after; the
    two reports and the archive's size."""
    arch, out = os.path.join(tmp, "arch"), os.path.join(tmp, "out" if files > 1 else "out.safetensors")
    # Each timed step starts with no dirty pages left by the one before: the kernel's
    # write-back of earlier writes would otherwise land on it.
    os.sync()
    compressed = compress_archive(source, arch, options=options, lossless=lossless, pool=pool)
    os.sync()
    restored = decompress_archive(arch, out, pool=pool)
    archive_bytes = _size(arch)
    shutil.rmtree(arch)
    shutil.rmtree(out) if files > 1 else os.unlink(out)
    return compressed, restored, archive_bytes


def _small_blocks(pool, tmp, source, tensors, files, block_kib, options, lossless, repeat) -> str:
    """The line of the small blocks: the same bytes cut into ``block_kib`` KiB blocks,
    each run right after a run of the sample chunks (``source``), and the best of each
    compared: a per-block figure of microseconds is smaller than the drift of a shared
    machine's load between two medians taken a minute apart."""
    rows = block_kib * 1024 // (2 * 64)  # [rows, 64] bf16 blocks
    small = {f"{key}.{j:04d}": piece for key, t in tensors.items() for j, piece in enumerate(t.reshape(-1, rows, 64))}
    root = os.path.join(tmp, "small")
    small_source = _write_source(root, small, files)
    runs = []
    for _ in range(repeat):
        big_c, big_d, _ = _round_trip(source, tmp, files, options, lossless, pool)
        small_c, small_d, _ = _round_trip(small_source, root, files, options, lossless, pool)
        runs.append((big_c.seconds, big_d.seconds, small_c.seconds, small_d.seconds))
    shutil.rmtree(root)
    big_c, big_d, small_c, small_d = (min(r[i] for r in runs) for i in range(4))
    extra = len(small) - len(tensors)
    return (
        f"small blocks, {pool.num_workers} workers: {len(small)} blocks of {block_kib} KiB instead of {len(tensors)} "
        f"(each run right after one of the chunks; best of {repeat} each): "
        f"compress {small_c / big_c:.2f} times the work ({(small_c - big_c) / extra * 1e6:.1f} us per extra block), "
        f"decompress {small_d / big_d:.2f} times ({(small_d - big_d) / extra * 1e6:.1f} us per extra block)"
    )


class _CodecAlone:
    """The codec alone on the same blocks, in this process, to time beside each run of a
    pool's: on a shared machine the load moves within seconds, and a ratio of two figures
    taken minutes apart measures the load as much as the pool."""

    def __init__(self, codec: Fp8Codec, blocks: list):
        self.codec, self.blocks = codec, blocks
        self.frames = [codec.encode(t) for t in blocks]

    def encode(self) -> None:
        for t in self.blocks:
            self.codec.encode(t)

    def decode(self) -> None:
        for f in self.frames:
            decode(f)


def _beside(fn, alone, repeat: int) -> tuple[float, float]:
    """``fn``'s median seconds, and the median over runs of the seconds ``alone`` takes
    just before it over ``fn``'s (its fraction of the codec alone)."""
    runs = [(_timed(alone), _timed(fn)) for _ in range(repeat)]
    return statistics.median(s for _, s in runs), statistics.median(a / s for a, s in runs)


def _object_store(pool: QuantPool, blocks: list, options: CodecOptions, repeat: int, alone: _CodecAlone):
    """``(seconds, fraction of the codec alone)`` of encode_many and of decode_many."""
    frames = pool.encode_many(blocks, options=options)  # warm up
    pool.decode_many(frames)
    return (
        _beside(lambda: pool.encode_many(blocks, options=options), alone.encode, repeat),
        _beside(lambda: pool.decode_many(frames), alone.decode, repeat),
    )


def _by_reference(pool: QuantPool, blocks: list, options: CodecOptions, repeat: int, alone: _CodecAlone):
    """``(seconds, fraction of the codec alone)`` to encode blocks already in the object
    store (as upstream tasks leave them) until every frame is there, as ``Block`` s and
    as torch tensors, and to decode those frames likewise; the driver fetches nothing."""
    import ray

    block_refs = [ray.put(Block.of(str(i), t)) for i, t in enumerate(blocks)]
    tensor_refs = [ray.put(t) for t in blocks]

    def settled(results: list) -> list:
        ray.wait(results, num_returns=len(results), fetch_local=False)
        return results

    frames = settled(pool.encode_refs(block_refs, options=options))  # warm up
    settled(pool.encode_refs(tensor_refs, options=options))
    settled(pool.decode_refs(frames))
    return (
        _beside(lambda: settled(pool.encode_refs(block_refs, options=options)), alone.encode, repeat),
        _beside(lambda: settled(pool.encode_refs(tensor_refs, options=options)), alone.encode, repeat),
        _beside(lambda: settled(pool.decode_refs(frames)), alone.decode, repeat),
    )


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
