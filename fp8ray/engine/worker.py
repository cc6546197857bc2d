"""``QuantWorker``: the Ray actor that holds codecs and runs every job on shards of blocks.

Blocks travel as numpy uint8 arrays (zero-copy out of the object store); frames come
back the same way. For archives and stores on shared storage a worker reads its input
shard and writes its output itself, so only metadata passes through the driver. Every
method takes plain data and returns a small dataclass (or a list of them).

Its processes are titled ``ray::QuantWorker``. It uses the GPU when Ray gave it one and
torch sees CUDA, else the CPU kernels, and says which in its results. A block that
fails raises fp8ray's own exception class, its message starting with the block's key.
"""

from __future__ import annotations

import os
import posixpath
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from pyarrow.fs import LocalFileSystem

from ..codec import CodecOptions, Fp8Codec, checksum, decode_raw, frame
from ..codec.blocks import (
    Block,
    BlockSpec,
    decode_into,
    decode_rows_into,
    encode_data_into,
    encode_into,
    frame_sizes,
    frames_buffer,
    read_headers,
)
from ..codec.devices import choose_device, host_buffer, is_tensor
from ..codec.formats import tensor_nbytes
from ..codec.fp8codec import is_array, source_tensor
from ..codec.runs import RUN_BYTES
from ..errors import BadInputError, BlockError, CorruptArchiveError, MismatchError, block_error
from ..io import archive, part_checks
from ..io.blocks import BlockReader, BlockRef, read_blocks
from ..io.paths import resolve, uri_for
from ..io.restore import RestoreTask
from ..io.safetensors import RangeWriter


@dataclass(frozen=True)
class WorkerInfo:
    pid: int
    node_id: str | None
    device: str  # "cpu" | "cuda"


@dataclass(frozen=True)
class BlockMeta:
    """What a worker reports of one encoded or decoded block."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    raw_bytes: int
    frame_bytes: int


@dataclass(frozen=True)
class PartResult:
    """A part a worker wrote: its manifest entry, and where it was made."""

    info: archive.Part
    device: str
    node_id: str | None


@dataclass
class VerifyResult:
    """One part's verification: problems are reported here, not raised, so that one run
    names them all."""

    part: str
    blocks: int = 0
    keys: list[str] = field(default_factory=list)
    idents: list[tuple[str, str]] = field(default_factory=list)  # (file, key) of each block
    errors: list[str] = field(default_factory=list)
    metrics: dict[str, dict] = field(default_factory=dict)  # block label -> error metrics, with --against
    stored: list[str] = field(default_factory=list)  # labels of stored blocks found identical to the source
    stored_frames: int = 0  # blocks in stored frames, with or without --against


@dataclass
class RestoreResult:
    """What one restore task wrote, and where it ran."""

    files: int = 0
    blocks: int = 0
    raw_bytes: int = 0
    node_id: str | None = None


class QuantWorker:
    """Encode and decode shards of KV blocks. Create it through :class:`fp8ray.QuantPool`
    (or ``ray.remote(QuantWorker)``); every method takes and returns plain data."""

    def __init__(self, threads: int = 1, reuse_buffers: bool = True, device: str | None = None):
        """``threads``: the CPU kernels' threads in each call (an actor's CPUs).
        ``device``: ``None`` for the GPU Ray gave this actor, if any, else the CPU;
        ``"cpu"`` or ``"cuda"`` to choose (workers run inline, where Ray assigns none)."""
        ray = _connected_ray()
        self.device = choose_device(device, gpus_given=bool(ray and ray.get_gpu_ids()))
        self.threads = max(1, int(threads))
        # Kernels are compiled (or loaded from numba's cache) on first use, only those a
        # job needs: loading all of them up front cost every worker about a second. But
        # numba's first call of any compiled function in a process loads its registries
        # (0.11 s, whichever function): paid here, as the worker starts, not in the time
        # of its first block (nor in the seconds a job reports as its work).
        checksum.combine(0, 0, 0)
        self._codecs: dict[CodecOptions, Fp8Codec] = {}
        self._reader = BlockReader(lambda nbytes: host_buffer(nbytes, self.device))  # pinned on a GPU
        self._frames = np.empty(0, np.uint8)
        self._results = np.empty(0, np.uint8)
        # A restore's decoded batches, kept from task to task (up to a batch's usual
        # RUN_BYTES: a larger block's buffer goes with its task): a part's decode into
        # fresh pages took 9 ms a 32 MiB batch against 5-6 ms into pages used before.
        self._decoded = np.empty(0, np.uint8)
        # Results may live in a buffer reused from call to call only where Ray copies them
        # out as a call ends (an actor); run inline, they are the caller's to keep.
        self._reuse_results = reuse_buffers

    def _decode_buffer(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` for a restore's batch: the one kept, or a new one
        (kept in turn where it is no larger than :data:`~fp8ray.codec.runs.RUN_BYTES`)."""
        buffer = _at_least(self._decoded, nbytes)
        if buffer.size <= RUN_BYTES:
            self._decoded = buffer
        return buffer

    def info(self) -> WorkerInfo:
        return WorkerInfo(os.getpid(), _node_id(), self.device)

    def _codec(self, options: CodecOptions) -> Fp8Codec:
        if not isinstance(options, CodecOptions):
            raise TypeError(f"options must be CodecOptions, got {type(options).__name__}")
        if options not in self._codecs:  # one codec (serializer) per configuration seen
            self._codecs[options] = Fp8Codec(options=options)
        return self._codecs[options]

    def _results_buffer(self, nbytes: int) -> np.ndarray:
        """Where a batch's results go. In a Ray actor, one buffer reused from call to call:
        Ray copies a task's return values into its object store as the task ends, and
        fresh pages for every batch cost more than encoding into them (on a GPU worker,
        pinned: see ``host_buffer``). Run inline (no Ray), the results are the caller's
        to keep: a new buffer."""
        if not self._reuse_results:
            return np.empty(nbytes, np.uint8)
        if self._results.size < nbytes:
            self._results = host_buffer(nbytes, self.device)
        return self._results[:nbytes]

    def encode_batch(self, blocks: list[Block], options: CodecOptions) -> list[tuple[np.ndarray, BlockMeta]]:
        """Encode ``blocks``; returns ``(frame, metadata)`` per block, in order."""
        codec = self._codec(options)
        sizes = frame_sizes(codec, blocks)
        buffer = frames_buffer(blocks, sizes, self._results_buffer)
        encode_into(codec, blocks, buffer, sizes, device=self.device, threads=self.threads)
        return [
            (f, BlockMeta(b.key, b.dtype, b.shape, self.device, b.nbytes, size))
            for b, f, size in zip(blocks, _split(buffer, sizes), sizes)
        ]

    def decode_batch(self, frames: list[tuple[str, np.ndarray]]) -> list[tuple[np.ndarray, BlockMeta]]:
        """``frames``: ``(key, frame)`` pairs. Returns ``(raw little-endian bytes, metadata)`` per block."""
        specs = [BlockSpec(key, h.dtype, h.shape) for (key, _), h in zip(frames, read_headers(frames))]
        sizes = [spec.nbytes for spec in specs]
        buffer = self._results_buffer(sum(sizes))
        decode_into(frames, buffer, specs, device=self.device, threads=self.threads)
        return [
            (raw, BlockMeta(spec.key, spec.dtype, spec.shape, self.device, spec.nbytes, len(f)))
            for spec, raw, (_, f) in zip(specs, _split(buffer, sizes), frames)
        ]

    def encode_blocks(self, options: CodecOptions, keys: list[str], *blocks):
        """The frames of ``blocks`` (a tensor is a block named by its key in ``keys``), one
        result each, as a call with ``num_returns=len(blocks)`` returns them: for inputs
        that arrive by reference from the object store (:meth:`QuantPool.encode_refs`),
        so that each frame becomes an object of its own. A Block's bytes are read where
        they lie (a view of the object store); a tensor is what Ray deserialised."""
        named = []
        for key, block in zip(keys, blocks, strict=True):
            if is_tensor(block) or is_array(block):
                try:  # what Fp8Codec.encode refuses (a meta tensor, a big-endian array), refused alike
                    block = Block.of(key, source_tensor(block))
                except BadInputError as exc:
                    raise block_error(key, exc) from None
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"block {key!r}: {exc}") from None
            elif not isinstance(block, Block):
                raise BlockError(
                    f"block {key!r}: expected a Block, a torch.Tensor or a numpy array, got {type(block).__name__}",
                    field=key,
                )
            named.append(block)
        return _one_result_each([f for f, _ in self.encode_batch(named, options)])

    def decode_frames(self, keys: list[str], *frames: np.ndarray):
        """The :class:`Block` of each frame (named by ``keys``), one result each, as
        :meth:`encode_blocks` returns them (:meth:`QuantPool.decode_refs`)."""
        decoded = self.decode_batch(list(zip(keys, frames, strict=True)))
        return _one_result_each([Block(meta.key, meta.dtype, meta.shape, raw) for raw, meta in decoded])

    def compress_part(
        self, refs: list[BlockRef], options: CodecOptions, directory: str, index: int, lossless: str = "none"
    ) -> PartResult:
        """Read ``refs`` from their source, encode them, write part ``index`` of the archive
        in ``directory`` (local path or URI); return the part's manifest entry."""
        codec = self._codec(options)
        # The frames are encoded end to end into one buffer that becomes the Arrow column
        # as it is: no copy between the codec and the Parquet writer.
        sizes = frame_sizes(codec, refs)
        if self._frames.size < sum(sizes):
            self._frames = host_buffer(sum(sizes), self.device)
        frames = self._frames[: sum(sizes)]  # reused, as the reader's buffer is: the part is written before the next
        # Each block's bytes are checked against its ref's size as they are read: no Block needed.
        data = self._reader.read(refs)
        joined, where = self._reader.joined, lambda i: refs[i].of_file
        encode_data_into(codec, refs, data, frames, sizes, device=self.device, threads=self.threads, joined=joined, where=where)
        rows = archive.part_rows(refs, options, sizes, archive.frame_column(frames, sizes))
        fs, path = resolve(directory)
        return PartResult(archive.write_part(fs, path, index, rows, lossless), self.device, _node_id())

    def restore_files(self, archive_uri: str, parts: dict[int, archive.Part], task: RestoreTask, directory: str) -> RestoreResult:
        """Write the files of ``task`` into ``directory`` (local path or URI), and its
        ranges of shared files (which the driver created there) in place, decoding their
        blocks from ``parts`` (manifest entries by index; each checked against its
        CRC-32C once, and dropped after its last block here). A damaged part or frame
        raises, naming the block."""
        fs, path = resolve(archive_uri)
        out_fs, out_dir = resolve(directory)
        # A local file takes each block before the next is decoded into the same buffer;
        # an object store's stream may still be uploading it in the background.
        keep = (lambda data: data) if isinstance(out_fs, LocalFileSystem) else (lambda data: data.copy())
        pieces = (*task.ranges, *task.files)
        left = Counter(p for piece in pieces for p, *_ in piece.blocks)  # blocks still to decode, by part
        frames: dict[int, list] = {}
        result = RestoreResult(node_id=_node_id())

        def decoded(batch: list[tuple], file: str | None) -> np.ndarray:
            """Decode a batch of blocks of one part, end to end (together, so that small
            blocks of one shape go in runs), into the start of the reused buffer; the
            decoded bytes (a view of it). ``file``: the source file they are of, named
            in errors (a key may be in several files); None where that is not known."""
            part, first_row, _, dtype, shape = batch[0]
            if part not in frames:
                frames[part] = archive.PartFrames(archive.read_part(fs, path, parts[part], columns=["frame"], uri=archive_uri))
            where = f"{f' of {file}' if file else ''} in {parts[part].name}"
            # Small blocks of one dtype and shape in consecutive rows (the usual batch) lie
            # end to end in the part: decoded as one array, no Python object per block.
            uniform = all(row == first_row + i and (d, s) == (dtype, shape) for i, (_, row, _, d, s) in enumerate(batch))
            pieces = frames[part].row_arrays(first_row, len(batch)) if uniform else None
            if pieces is not None:
                nbytes = tensor_nbytes(dtype, shape)
                keys = [key for _, _, key, *_ in batch]
                for rows in pieces:
                    _check_holds(keys[0], dtype, shape, nbytes, rows.shape[1], where)
                size = len(batch) * nbytes
                buffer = self._decode_buffer(size)
                done = 0
                for rows in pieces:  # one a row group
                    stop = done + len(rows)
                    out = buffer[done * nbytes :]
                    with _row_and_frame_agree():
                        decode_rows_into(keys[done:stop], rows, out, dtype, shape, threads=self.threads, where=where)
                    done = stop
            else:
                specs = [BlockSpec(key, dtype, shape) for _, _, key, dtype, shape in batch]
                pairs = [(key, frames[part][row]) for _, row, key, *_ in batch]
                for spec, (_, f) in zip(specs, pairs):
                    _check_holds(spec.key, spec.dtype, spec.shape, spec.nbytes, len(f), where)
                size = sum(spec.nbytes for spec in specs)
                buffer = self._decode_buffer(size)
                with _row_and_frame_agree():
                    decode_into(pairs, buffer, specs, threads=self.threads, where=where)
            left[part] -= len(batch)
            if not left[part]:
                del frames[part]  # its last block here: a part is held only while a block still needs it
            result.blocks += len(batch)
            result.raw_bytes += size
            return buffer[:size]

        for r in task.ranges:
            with RangeWriter(f"{out_dir}/{r.name}") as writer:
                offset = r.offset
                for batch in _batches(r.blocks):
                    data = decoded(batch, r.source)
                    writer.write_at(offset, data)  # a batch's blocks lie end to end in the file too
                    offset += data.size
        for f in task.files:
            if "/" in f.name and isinstance(out_fs, LocalFileSystem):  # a file in a subfolder of the source
                out_fs.create_dir(posixpath.dirname(f"{out_dir}/{f.name}"), recursive=True)
            with f.writer(uri_for(directory, f"{out_dir}/{f.name}")) as writer:
                for batch in _batches(f.blocks):
                    data = decoded(batch, f.source)
                    writer.write_blocks([(key, dtype, shape) for _, _, key, dtype, shape in batch], keep(data))
            result.files += 1
        return result

    def verify_part(
        self,
        directory: str,
        part: archive.Part,
        against: dict | None = None,
        bound: dict | None = None,
        name_files: bool = False,
        codec: CodecOptions | None = None,
    ) -> VerifyResult:
        """Check a part and each of its frames (written in ``codec``, the manifest's
        options, where given); with ``against`` (the source's blocks by ``(file, key)``),
        compare each block with its source and hold it to the codec's error ``bound``
        (:mod:`fp8ray.codec.bound`). Blocks are named by key, and by file too with
        ``name_files``. Reports problems instead of raising, so one run names them all."""
        fs, path = resolve(directory)
        result = VerifyResult(part.name)
        try:
            archive.check_part(fs, path, part, directory)
            part_error = None
        except CorruptArchiveError as exc:
            part_error = str(exc)
        try:  # read even a damaged part, to name the blocks the damage lies in
            table = archive.read_part(fs, path, part, check=False, uri=directory)
        except CorruptArchiveError as exc:
            result.errors.append(str(exc))
            return result
        names = table.schema.names
        lacking = [name for name in ("key", "dtype", "shape", "raw_bytes", "frame_bytes", "frame") if name not in names]
        if lacking:  # a damaged footer can drop a column: the part is damaged, its blocks not named
            shown = archive.redact(directory)
            result.errors.append(part_error or f"part {part.name} of {shown} is damaged: it has no {lacking[0]!r} column")
            return result
        columns = {name: table.column(name).to_pylist() for name in archive.METADATA_COLUMNS if name in names}
        if part_error is None:  # each frame may check and still sit in another block's row
            try:
                part_checks.check_frames(table, part, archive.redact(directory))
                part_checks.check_key_range(columns["key"], part, archive.redact(directory))  # as a reader of one block does
            except CorruptArchiveError as exc:
                result.errors.append(str(exc))
        files = columns.get("file") or [""] * table.num_rows  # version 1 parts have no file column
        result.keys = columns["key"]
        result.idents = list(zip(files, columns["key"]))
        originals = {}
        problems: list[tuple[int, str]] = []  # (row, what is wrong with its block): said in row order

        def failed(row: int, label: str, exc: Exception) -> None:
            problems.append((row, f"block {label!r} in {part.name}: {exc}"))

        if against is not None:  # one read of the source for the whole part
            from ..codec.bound import check_identical
            from .comparison import SourceBlock, SourceComparison  # the error metrics and the bound are taken on tensors

            comparison = SourceComparison(bound, result.metrics, failed, self.threads)
            present = [against[i] for i in result.idents if i in against]
            originals = {
                (f, r.key): (r, data)
                for f, r, data in zip((i[0] for i in result.idents if i in against), present, read_blocks(present))
            }
        raw_total = frame_total = 0
        with _torch_threads(self.threads if against is not None else None):
            for row, f in enumerate(archive.iter_frames(table)):
                ident = result.idents[row]
                label = _label(ident, name_files)
                result.blocks += 1
                try:
                    buf = frame.as_byte_array(f)
                    header = frame.parse(buf)
                    result.stored_frames += header.stored
                    raw_bytes = header.tensor_nbytes
                    raw_total, frame_total = raw_total + raw_bytes, frame_total + buf.size
                    if not header.stored and frame.suspect_scales(buf, header):
                        decode_raw(buf, header.dtype, header.shape)  # refuses a scale not valid, or too large for its codes
                    shape, dtype, said_raw, said_frame = (
                        columns[name][row] for name in ("shape", "dtype", "raw_bytes", "frame_bytes")
                    )
                    if [shape, dtype, said_raw, said_frame] != [list(header.shape), header.dtype, raw_bytes, buf.size]:
                        raise MismatchError(
                            f"columns say {shape} {dtype} of {said_raw} bytes in a frame of {said_frame}, "
                            f"the frame holds {list(header.shape)} {header.dtype} of {raw_bytes} bytes in {buf.size}"
                        )
                    if codec is not None and header != frame.header_for(codec, header.dtype, header.shape):
                        written, recorded = frame.layout_label(header), frame.layout_label(codec)
                        raise MismatchError(f"the frame is in {written}, the manifest records {recorded}")
                    if against is None:
                        continue
                    if ident not in originals:
                        raise MismatchError("not in the source it is verified against")
                    ref, data = originals[ident]
                    if (ref.dtype, tuple(ref.shape)) != (header.dtype, tuple(header.shape)):
                        raise MismatchError(
                            f"the source holds {list(ref.shape)} {ref.dtype}, the archive {list(header.shape)} {header.dtype}"
                        )
                    if not header.stored:  # its metrics, and the bound: with the blocks of its layout around it
                        comparison.add(SourceBlock(row, label, data, buf, header))
                        continue
                    # A stored frame: no error to measure, identical or named.
                    stray = check_identical(data, frame.codes_of(buf, header), header.dtype, header.shape)
                    if stray is not None:
                        raise MismatchError(f"{stray}: not the data this block was compressed from")
                    result.stored.append(label)
                except (ValueError, TypeError, RuntimeError) as exc:
                    failed(row, label, exc)
            if against is not None:
                comparison.finish()
        block_errors = len(problems)
        result.errors += [problem for _, problem in sorted(problems)]
        totals = part_checks.totals_problem(raw_total, frame_total, part)
        if totals and not block_errors:  # each row checks, their sum not the entry's
            result.errors.append(f"part {part.name} of {archive.redact(directory)} is damaged: {totals}")
        if part_error and not block_errors:
            result.errors.append(f"{part_error}; every frame in it checks, so the damage lies outside them")
        elif part_error:
            result.errors.append(part_error)
        return result

    def convert_store_files(self, conversion, chunks: list) -> list:
        """Convert LMCache chunk files (``ChunkFile`` s) as ``conversion`` (a
        ``StoreConversion``) says: the job of :mod:`fp8ray.engine.stores`, done by
        :func:`fp8ray.lmcache.store_files.convert_files` (a ``ConvertedFile`` each)."""
        from ..lmcache.store_files import convert_files  # the LMCache modules load torch

        return convert_files(conversion, chunks)

    def compress_store_part(
        self, refs: list[BlockRef], options: CodecOptions, directory: str, index: int, lossless: str = "none"
    ) -> PartResult:
        """:meth:`compress_part` for blocks that are the chunk files of an LMCache store
        (:mod:`fp8ray.io.store_source`), read in whatever form each is in
        (:func:`fp8ray.lmcache.store_files.encode_chunk_files`)."""
        from ..lmcache.store_files import encode_chunk_files

        codec = self._codec(options)
        sizes = frame_sizes(codec, refs)
        frames = frames_buffer(refs, sizes)
        encode_chunk_files(refs, codec, frames, sizes, self.threads)
        rows = archive.part_rows(refs, options, sizes, archive.frame_column(frames, sizes))
        fs, path = resolve(directory)
        return PartResult(archive.write_part(fs, path, index, rows, lossless), self.device, _node_id())

    def restore_store_files(
        self, archive_uri: str, parts: dict[int, archive.Part], task: RestoreTask, directory: str, form: str
    ) -> RestoreResult:
        """:meth:`restore_files` for an archive of an LMCache store: its chunk files, in
        the store ``form`` asked for (:func:`fp8ray.lmcache.store_files.restore_chunk_files`)."""
        from ..lmcache.store_files import restore_chunk_files

        done = restore_chunk_files(archive_uri, parts, task, directory, form, self.threads)
        return RestoreResult(files=done.files, blocks=done.files, raw_bytes=done.raw_bytes, node_id=_node_id())


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads at ``threads`` in the calling thread for the block (None:
    left as they are). Inline workers are threads of one process, where torch gives every
    op as many threads as the machine has cores: two workers ran four OpenMP threads on two
    cores, spinning on each other over small tensors (verify --against of 4000 small blocks
    took 2x the time under load). A Ray actor's are one per CPU already (Ray sets
    OMP_NUM_THREADS where it is not set), and are held to its CPUs here too. torch's
    setting is also its default for threads that first use torch meanwhile: another
    worker's thread starting then keeps one per CPU, as it should; the caller's own
    thread is not changed."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    if threads == before:
        yield
        return
    torch.set_num_threads(threads)  # this thread's OpenMP threads, and the default of threads started meanwhile
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _batches(blocks) -> Iterator[list[tuple]]:
    """``(part, row, key, dtype, shape)`` s a batch at a time: consecutive blocks of one
    part, up to :data:`~fp8ray.codec.runs.RUN_BYTES` of raw bytes (or one larger block)."""
    batch: list[tuple] = []
    size = 0
    for block in blocks:
        nbytes = tensor_nbytes(block[3], block[4])
        if batch and (block[0] != batch[0][0] or size + nbytes > RUN_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(block)
        size += nbytes
    if batch:
        yield batch


def _check_holds(key: str, dtype: str, shape: tuple, nbytes: int, frame_bytes: int, where: str) -> None:
    """Refuse, before its bytes are allocated, a block whose row asks for more than its
    frame can hold (``frame.RAW_BYTES_PER_FRAME_BYTE``: a row edited, its part's CRCs made
    again; the frame's header would say so, but only once decoded)."""
    if nbytes > frame.RAW_BYTES_PER_FRAME_BYTE * frame_bytes:
        raise CorruptArchiveError(
            f"block {key!r}{where}: its row says {list(shape)} {dtype} ({nbytes} bytes), more than its frame of "
            f"{frame_bytes} bytes holds: the part is damaged"
        )


@contextmanager
def _row_and_frame_agree():
    """An intact frame holding another dtype or shape than its row says (the decoder's
    MismatchError) is an archive at fault, as verify and ``open_archive`` report it."""
    try:
        yield
    except MismatchError as exc:
        raise CorruptArchiveError(f"{exc}: its row and its frame disagree, the part is damaged") from None


def _at_least(buffer: np.ndarray, size: int) -> np.ndarray:
    """``buffer``, or a larger one where it holds fewer than ``size`` bytes."""
    return buffer if buffer.size >= size else np.empty(size, np.uint8)


def _one_result_each(results: list):
    """``results`` as a call with ``num_returns=len(results)`` returns them: Ray makes one
    object of each item of a returned sequence, but of the value itself when it is one."""
    return results[0] if len(results) == 1 else results


def _split(buffer: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """``buffer`` cut into consecutive pieces of ``sizes`` bytes (views)."""
    ends = np.cumsum(sizes, dtype=np.int64)
    return [buffer[end - size : end] for size, end in zip(sizes, ends.tolist())]


def _label(ident: tuple[str, str], name_files: bool) -> str:
    """A block's name in reports: its key, after its file where a source has several."""
    file, key = ident
    return f"{file}:{key}" if name_files else key


def _node_id() -> str | None:
    ray = _connected_ray()
    return ray.get_runtime_context().get_node_id() if ray else None


def _connected_ray():
    """The ray module when this process is connected to Ray (an actor, or a driver that
    joined), else None. A worker run inline never imports Ray (0.3 s of a one-shot command):
    if nothing imported it, nothing connected."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None
