"""``QuantWorker``: the Ray actor that holds codecs and processes shards of blocks.

Blocks travel as numpy uint8 arrays (zero-copy out of the object store); frames come
back the same way. For archives on shared storage a worker reads its input shard and
writes its output part itself, so only metadata passes through the driver.

Its processes are titled ``ray::QuantWorker``. It uses the GPU when Ray gave it one and
torch sees CUDA, else the CPU kernels, and says which in every block's metadata.
"""

from __future__ import annotations

import os

import numpy as np
import ray
import torch

from . import archive, frame
from .codec import Fp8Codec, decode
from .errors import Fp8rayError
from .formats import CODEC_DEFAULTS, resolve_options
from .metrics import error_metrics
from .sources import TORCH_DTYPES, BlockRef, bytes_to_tensor, read_blocks, resolve, tensor_to_bytes


class BlockError(Fp8rayError, ValueError):
    """Processing one block failed on its data; the message starts with the block's key."""


def codec_key(options: dict) -> tuple:
    """The full codec configuration of ``options``; what they leave out follows
    :data:`fp8ray.formats.KV_DEFAULTS`."""
    unknown = set(options) - set(CODEC_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown codec option(s) {sorted(unknown)}")
    o = resolve_options(**options)
    return (o["fp8"], o["scaling"], o["block_size"], o["scale_dtype"], o["scale_choice"])


def _load_kernels() -> None:
    """Compile (or load from numba's cache) every CPU kernel once, at actor start, so
    that a job's first shards do not pay for it (about 1 s for all of them)."""
    from .formats import DTYPES, FORMATS, SCALINGS

    for dtype in DTYPES:
        for fmt in FORMATS:
            for scaling in SCALINGS:
                decode(Fp8Codec(fmt, scaling, 4).encode(torch.ones(2, 4, dtype=dtype)))
            for scaling in ("token", "block"):  # the scale search, with bfloat16 scales
                decode(Fp8Codec(fmt, scaling, 4, scale_dtype="bfloat16", scale_choice="mse").encode(torch.ones(2, 4, dtype=dtype)))


class QuantWorker:
    """Encode and decode shards of KV blocks. Create it through :class:`fp8ray.QuantPool`
    (or ``ray.remote(QuantWorker)``); every method takes and returns plain data."""

    def __init__(self, threads: int = 1):
        os.environ["FP8RAY_NUM_THREADS"] = str(max(1, int(threads)))
        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
        self.device = "cuda" if gpu_ids and torch.cuda.is_available() else "cpu"
        self._codecs: dict[tuple, Fp8Codec] = {}
        _load_kernels()

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "device": self.device}

    def _codec(self, options: dict) -> Fp8Codec:
        key = codec_key(options)
        if key not in self._codecs:  # one codec (serializer) per configuration seen
            fp8, scaling, block_size, scale_dtype, scale_choice = key
            self._codecs[key] = Fp8Codec(fp8, scaling, block_size, scale_dtype=scale_dtype, scale_choice=scale_choice)
        return self._codecs[key]

    def _encode(self, codec: Fp8Codec, key: str, dtype: str, shape, data: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
        try:
            tensor = bytes_to_tensor(data, dtype, shape)
            if self.device == "cuda":
                tensor = tensor.cuda()
            f = np.frombuffer(codec.encode(tensor, out=out), dtype=np.uint8)
        except (ValueError, TypeError) as exc:
            raise BlockError(f"block {key!r}: {exc}") from exc
        meta = {
            "key": key,
            "dtype": dtype,
            "shape": list(shape),
            "fp8": codec.fmt.name,
            "scaling": codec.scaling,
            "block_size": codec.block_size if codec.scaling == "block" else 0,
            "raw_bytes": int(data.size),
            "frame_bytes": int(f.size),
            "device": self.device,
        }
        return f, meta

    def encode_batch(self, blocks: list[tuple], options: dict) -> list[tuple[np.ndarray, dict]]:
        """``blocks``: ``(key, dtype, shape, uint8 array)`` tuples. Returns ``(frame, metadata)`` per block."""
        codec = self._codec(options)
        return [self._encode(codec, *block) for block in blocks]

    def decode_batch(self, frames: list[tuple[str, np.ndarray]]) -> list[tuple[np.ndarray, dict]]:
        """``frames``: ``(key, frame)`` pairs. Returns ``(raw little-endian bytes, metadata)`` per block."""
        out = []
        for key, f in frames:
            try:
                tensor = decode(f, device=self.device).cpu()
            except (ValueError, TypeError) as exc:
                raise BlockError(f"block {key!r}: {exc}") from exc
            meta = {"key": key, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape), "device": self.device}
            out.append((tensor_to_bytes(tensor), meta))
        return out

    def compress_part(self, refs: list[BlockRef], options: dict, directory: str, index: int) -> dict:
        """Read ``refs`` from their source, encode them, write part ``index`` of the archive
        in ``directory`` (local path or URI); return the part's manifest entry."""
        codec = self._codec(options)
        rows: dict[str, list] = {name: [] for name in archive.METADATA_COLUMNS}
        # The frames are encoded end to end into one buffer that becomes the Arrow column
        # as it is: no copy between the codec and the Parquet writer.
        sizes = [codec.encoded_size(ref.shape, TORCH_DTYPES[ref.dtype]) for ref in refs]
        frames = np.empty(sum(sizes), dtype=np.uint8)
        start = 0
        for ref, data, size in zip(refs, read_blocks(refs), sizes):
            _, meta = self._encode(codec, ref.key, ref.dtype, ref.shape, data, out=frames[start : start + size])
            start += size
            for name in archive.METADATA_COLUMNS:
                rows[name].append(meta[name])
        rows["frame"] = archive.frame_column(frames, sizes)
        fs, path = resolve(directory)
        info = archive.write_part(fs, path, index, rows)
        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {**info.__dict__, "device": self.device, "node_id": node_id}

    def decompress_part(self, directory: str, part: dict) -> list[tuple[str, np.ndarray]]:
        """Decode every block of a part (checked against the manifest's CRC first)."""
        fs, path = resolve(directory)
        table = archive.read_part(fs, path, part, columns=["key", "frame"])
        out = []
        for key, f in zip(table.column("key").to_pylist(), _frames(table)):
            try:
                tensor = decode(f)
            except (ValueError, TypeError) as exc:
                raise BlockError(f"block {key!r} in {part['name']}: {exc}") from exc
            out.append((key, tensor_to_bytes(tensor)))
        return out

    def verify_part(self, directory: str, part: dict, against: dict[str, BlockRef] | None = None) -> dict:
        """Check a part and each of its frames; with ``against``, compare each block with
        its source. Reports problems instead of raising, so one run names them all."""
        fs, path = resolve(directory)
        report: dict = {"part": part["name"], "blocks": 0, "keys": [], "errors": [], "metrics": {}}
        try:
            archive.check_part(fs, path, part)
            part_error = None
        except archive.CorruptArchiveError as exc:
            part_error = str(exc)
        try:  # read even a damaged part, to name the blocks the damage lies in
            table = archive.pq.read_table(f"{path}/{part['name']}", filesystem=fs)
        except (OSError, archive.pa.ArrowException) as exc:
            report["errors"].append(f"part {part['name']} is unreadable: {exc}")
            return report
        columns = {name: table.column(name).to_pylist() for name in archive.METADATA_COLUMNS}
        report["keys"] = columns["key"]
        originals = {}
        if against is not None:  # one read of the source for the whole part
            present = [against[k] for k in columns["key"] if k in against]
            originals = {r.key: (r, data) for r, data in zip(present, read_blocks(present))}
        block_errors = 0
        for row, f in enumerate(_frames(table)):
            key = columns["key"][row]
            report["blocks"] += 1
            try:
                buf = frame.as_byte_array(f)
                header = frame.parse(buf)
                if list(header.shape) != columns["shape"][row] or str(header.dtype).removeprefix("torch.") != columns["dtype"][row]:
                    raise ValueError(
                        f"columns say {columns['shape'][row]} {columns['dtype'][row]}, the frame says {list(header.shape)} {header.dtype}"
                    )
                if against is not None:
                    if key not in originals:
                        raise ValueError("not in the source it is verified against")
                    ref, data = originals[key]
                    original = bytes_to_tensor(data, ref.dtype, ref.shape)
                    report["metrics"][key] = error_metrics(original, decode(buf)).as_dict()
            except (ValueError, TypeError) as exc:
                block_errors += 1
                report["errors"].append(f"block {key!r} in {part['name']}: {exc}")
        if part_error and not block_errors:
            report["errors"].append(f"{part_error}; every frame in it checks, so the damage lies outside them")
        elif part_error:
            report["errors"].append(part_error)
        return report


def _frames(table):
    """The frame column as zero-copy memoryviews of Arrow's buffer."""
    column = table.column("frame")
    for chunk in column.chunks:
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int64)[chunk.offset : chunk.offset + len(chunk) + 1]
        data = memoryview(chunk.buffers()[2])
        for i in range(len(chunk)):
            yield data[offsets[i] : offsets[i + 1]]
