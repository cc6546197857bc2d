"""Blocks, and the one batch path: many blocks encoded into one buffer, many frames decoded
into one buffer.

A block is a tensor as it travels between processes: a key, a dtype name, a shape and
its raw little-endian bytes (a uint8 array, zero-copy out of Ray's object store or a
file). :func:`encode_into` lays the frames of a batch end to end in a caller's buffer
and :func:`decode_into` the raw bytes of a batch of frames: the worker, the Ray Data
UDFs and the LMCache serde all call these, so a block that fails is named the same way
everywhere (its key first in the message, fp8ray's own exception class).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import BadInputError, BlockError, CorruptFrameError, MismatchError, block_error
from . import formats, frame
from .cpu import tensor_to_bytes
from .formats import DTYPE_ITEMSIZES, tensor_nbytes
from .fp8codec import Fp8Codec, copy_into, decode, decode_raw
from .runs import decode_run, encode_run, fits_run, runs_of, small


@dataclass(frozen=True)
class BlockSpec:
    """What a block is, without its bytes: enough to size its frame."""

    key: str
    dtype: str  # "bfloat16" | "float16" | "float32", or a stored frame's ("int64", "bool", ...)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        # Asked for several times per block on the way through a part: kept after the first
        # time, in the instance's dict as cached_property would, without its lock (Python
        # 3.11's took 2 us a block).
        known = self.__dict__.get("_nbytes")
        if known is None:
            known = self.__dict__["_nbytes"] = tensor_nbytes(self.dtype, self.shape)
        return known


@dataclass(frozen=True)
class Block(BlockSpec):
    """A block with its raw little-endian bytes (``data``: a 1-D uint8 array of ``nbytes``).
    Checked as it is made, so a bad block fails where it is built, naming its key."""

    data: np.ndarray

    def __post_init__(self):
        if self.dtype not in DTYPE_ITEMSIZES:
            raise BlockError(
                f"block {self.key!r}: unsupported dtype {self.dtype!r}; expected one of {sorted(DTYPE_ITEMSIZES)}", field=self.key
            )
        if not isinstance(self.data, np.ndarray) or self.data.dtype != np.uint8 or self.data.ndim != 1:
            raise BlockError(
                f"block {self.key!r}: data must be a 1-D uint8 array, got {type(self.data).__name__}", field=self.key
            )
        if self.data.size != self.nbytes:
            raise BlockError(
                f"block {self.key!r}: {self.data.size} bytes of data, "
                f"its shape {list(self.shape)} {self.dtype} needs {self.nbytes}",
                field=self.key,
            )

    @classmethod
    def of(cls, key: str, tensor) -> Block:
        """The block of a tensor (its bytes copied to the CPU if needed)."""
        if tensor.dtype not in formats.DTYPE_NAMES:  # refused by its key, as __post_init__ refuses a dtype name
            raise BlockError(
                f"block {key!r}: unsupported dtype {tensor.dtype}; expected one of {sorted(DTYPE_ITEMSIZES)}", field=key
            )
        return cls(key, dtype_name(tensor), tuple(tensor.shape), tensor_to_bytes(tensor.cpu()))

    def tensor(self):
        """A zero-copy CPU tensor view of the block's bytes."""
        return bytes_to_tensor(self.data, self.dtype, self.shape)


def bytes_to_tensor(data: np.ndarray, dtype: str, shape):
    """A zero-copy tensor view of raw little-endian bytes (read-only buffers included:
    the codec never writes to its input). Loads torch."""
    import torch

    from .devices import host_tensor

    if data.size == 0:  # torch cannot view an empty array of another itemsize
        return torch.empty(tuple(shape), dtype=formats.torch_dtype(dtype))
    return host_tensor(data.view(np.uint8)).view(formats.torch_dtype(dtype)).reshape(tuple(shape))


def dtype_name(t) -> str:
    """fp8ray's name of a tensor's dtype (``"bfloat16"``, ``"int64"``: torch's)."""
    return formats.DTYPE_NAMES[t.dtype]


def frames_buffer(blocks: Sequence[BlockSpec], sizes: list[int], make: Callable[[int], np.ndarray] | None = None) -> np.ndarray:
    """A buffer for the frames of ``blocks`` end to end (``sizes``: :func:`frame_sizes`),
    made by ``make(nbytes)`` (a new array by default; a worker's reused one). One larger
    than this process can allocate (an empty tensor's frame still holds a scale per row:
    ``[2**40, 0]`` under token scaling, 2 TiB) is refused naming the largest block, as
    :meth:`Fp8Codec.encode` refuses it, not with numpy's MemoryError."""
    try:
        return (make or _new_bytes)(sum(sizes))
    except MemoryError:
        largest = max(range(len(sizes)), key=sizes.__getitem__)
        key = blocks[largest].key
        raise BadInputError(
            f"block {key!r}: its frame needs {sizes[largest]} bytes, more than this process can allocate", field=key
        ) from None


def _new_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


def frame_sizes(codec: Fp8Codec, blocks: Sequence[BlockSpec]) -> list[int]:
    """The exact frame size of each block (anything with ``key``, ``dtype`` and ``shape``)."""
    sizes = []
    known: dict[tuple, int] = {}  # many blocks share a dtype and shape
    for b in blocks:
        try:
            kind = (b.dtype, tuple(b.shape))
            size = known.get(kind)
            if size is None:
                size = known[kind] = codec.encoded_size(b.shape, b.dtype)  # an unknown dtype: a TypeError naming it
        except (ValueError, TypeError) as exc:
            raise block_error(b.key, exc) from exc
        sizes.append(size)
    return sizes


def encode_tensors_into(
    codec: Fp8Codec,
    named: Iterable[tuple[str, object]],
    out: np.ndarray,
    sizes: Sequence[int],
    *,
    threads: int | None = None,
) -> None:
    """The batch loop of encoding: each ``(name, tensor)``'s frame, end to end from the start
    of ``out`` (a writable 1-D uint8 array), ``sizes`` being the frames' exact sizes. A
    tensor may be on any device (CUDA through the reference path: the same bytes).
    ``threads``: the CPU kernels' threads. A tensor that fails raises naming it."""
    if sum(sizes) > out.size:
        raise BadInputError(f"out holds {out.size} bytes, the frames of {len(sizes)} tensors need {sum(sizes)}")
    start = 0
    for (name, tensor), size in zip(named, sizes, strict=True):
        try:
            codec.encode(tensor, out=out[start : start + size], threads=threads)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise block_error(name, exc) from exc
        start += size


def encode_into(
    codec: Fp8Codec,
    blocks: Sequence[Block],
    out: np.ndarray,
    sizes: Sequence[int] | None = None,
    *,
    device: str = "cpu",
    threads: int | None = None,
) -> list[int]:
    """Encode each block's frame, end to end from the start of ``out`` (a writable 1-D uint8
    array); returns the frame sizes (``sizes``, when the caller already has them from
    :func:`frame_sizes`). ``device``: where to encode (``"cuda"``: each block goes to the
    GPU first; the frame is the same bytes). ``threads``: the CPU kernels' threads.
    A block that fails raises naming its key."""
    return encode_data_into(codec, blocks, [b.data for b in blocks], out, sizes, device=device, threads=threads)


def encode_data_into(
    codec: Fp8Codec,
    specs: Sequence[BlockSpec],
    data: Sequence[np.ndarray],
    out: np.ndarray,
    sizes: Sequence[int] | None = None,
    *,
    device: str = "cpu",
    threads: int | None = None,
    joined: np.ndarray | None = None,
    where: Callable[[int], str] | None = None,
) -> list[int]:
    """:func:`encode_into` of blocks given as their specs and, apart, their raw bytes
    (``data[i]``: a 1-D uint8 array of ``specs[i].nbytes``, which the caller has checked,
    as a :class:`Block` checks its own): a part's thousands of small blocks need no
    object each. ``joined``: the same bytes, every block's end to end in one array, where
    the caller has them so (a :class:`~fp8ray.io.blocks.BlockReader` does): runs of small
    blocks are encoded from it, not from a copy of their bytes put end to end.
    ``where(i)``: where block ``i`` comes from, for the error that names it (``" of
    req2.safetensors"``: keys repeat from file to file), asked only when one fails."""
    sizes = list(sizes) if sizes is not None else frame_sizes(codec, specs)
    if device != "cpu":
        tensors = ((spec.key, bytes_to_tensor(d, spec.dtype, spec.shape).to(device)) for spec, d in zip(specs, data))
        encode_tensors_into(codec, tensors, out, sizes, threads=threads)
        return sizes
    if sum(sizes) > out.size:
        raise BadInputError(f"out holds {out.size} bytes, the frames of {len(sizes)} blocks need {sum(sizes)}")
    ends = np.cumsum([0, *sizes]).tolist()
    done = 0  # blocks before this one are encoded

    def one_at_a_time(start: int, stop: int) -> None:  # from the bytes: no torch on the CPU
        for i in range(start, stop):
            try:
                codec.encode_raw(data[i], specs[i].dtype, specs[i].shape, out=out[ends[i] : ends[i + 1]], threads=threads)
            except (ValueError, TypeError, RuntimeError) as exc:
                raise block_error(specs[i].key, exc, where(i) if where else "") from exc

    runs = runs_of(specs, lambda b: fits_run(codec.scaling, codec.block_size, b.dtype, b.shape))
    raw_ends = np.cumsum([0, *(spec.nbytes for spec in specs)]).tolist() if runs and joined is not None else None
    for start, stop in runs:
        one_at_a_time(done, start)
        first = specs[start]
        frames = out[ends[start] : ends[stop]].reshape(stop - start, sizes[start])
        source = joined[raw_ends[start] : raw_ends[stop]] if raw_ends else np.concatenate(data[start:stop])
        if not encode_run(codec, first.dtype, first.shape, source, frames, threads):
            one_at_a_time(start, stop)  # a refused non-finite value: named by its block
        done = stop
    one_at_a_time(done, len(specs))
    return sizes


def read_headers(frames: Sequence[tuple[str, object]]) -> list[frame.FrameHeader]:
    """Each ``(key, frame)``'s parsed and checked header; a damaged frame raises naming its key."""
    headers = []
    for key, f in frames:
        try:
            headers.append(frame.parse(frame.as_byte_array(f)))
        except (ValueError, TypeError) as exc:
            raise block_error(key, exc) from exc
    return headers


def decode_frames_into(
    frames: Iterable[tuple[str, object]],
    targets: Iterable,
    *,
    device: str | None = None,
    threads: int | None = None,
    where: str = "",
) -> None:
    """The batch loop of decoding: each ``(name, frame)`` into its target tensor (of the
    frame's dtype and shape, on any device). ``device``: where to decode when it is not
    the target's (``"cuda"`` into a CPU target: on the GPU, then copied). A frame that
    fails (damaged, or holding another dtype or shape) raises naming it (and ``where``
    the frames are, after its name: ``" in part-00003.parquet"``)."""
    import torch  # loaded already: the targets are tensors

    for (name, f), target in zip(frames, targets, strict=True):
        try:
            if device is None or torch.device(device) == target.device:
                decode(f, out=target, threads=threads)
            else:
                result = decode(f, device=device)
                if (result.dtype, tuple(result.shape)) != (target.dtype, tuple(target.shape)):  # copy_ would convert or broadcast
                    raise MismatchError(
                        f"the frame holds {list(result.shape)} {result.dtype}, not {list(target.shape)} {target.dtype}"
                    )
                copy_into(target, result)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise block_error(name, exc, where) from exc


def decode_into(
    frames: Sequence[tuple[str, object]],
    out: np.ndarray,
    specs: Sequence[BlockSpec] | None = None,
    *,
    device: str = "cpu",
    threads: int | None = None,
    where: str = "",
) -> list[BlockSpec]:
    """Decode each ``(key, frame)`` to its raw little-endian bytes, end to end from the start
    of ``out`` (a writable 1-D uint8 array); returns each block's spec. ``specs``: what the
    caller expects each frame to hold (a frame that holds another dtype or shape fails);
    without them each frame's header is read first (one more pass of its checksum).
    ``device``: where to decode (``"cuda"``: on the GPU, then copied back). A frame that
    fails raises naming its key (and ``where``, as :func:`decode_frames_into`)."""
    if specs is None:
        specs = [BlockSpec(key, h.dtype, h.shape) for (key, _), h in zip(frames, read_headers(frames))]
    ends = np.cumsum([spec.nbytes for spec in specs], dtype=np.int64).tolist()
    if ends and ends[-1] > out.size:
        raise BadInputError(f"out holds {out.size} bytes, the blocks of {len(frames)} frames need {ends[-1]}")
    starts = [end - spec.nbytes for spec, end in zip(specs, ends)]

    def one_at_a_time(start: int, stop: int) -> None:
        if start == stop:
            return
        if device != "cpu":
            targets = (bytes_to_tensor(out[starts[i] : ends[i]], specs[i].dtype, specs[i].shape) for i in range(start, stop))
            decode_frames_into(frames[start:stop], targets, device=device, threads=threads, where=where)
        else:
            _decode_each(frames[start:stop], out[starts[start] :], specs[start:stop], threads, where)

    done = 0
    if device == "cpu":
        for start, stop in runs_of(specs, lambda spec: small(spec.dtype, spec.shape)):
            one_at_a_time(done, start)
            run = [frame.as_byte_array(f) for _, f in frames[start:stop]]
            if all(f.size == run[0].size for f in run):
                keys = [key for key, _ in frames[start:stop]]
                rows = np.concatenate(run).reshape(stop - start, -1)
                first = specs[start]
                decode_rows_into(keys, rows, out[starts[start] :], first.dtype, first.shape, threads=threads, where=where)
            else:
                one_at_a_time(start, stop)
            done = stop
        one_at_a_time(done, len(frames))
    else:
        one_at_a_time(0, len(frames))
    return list(specs)


def _decode_each(frames: Sequence[tuple[str, object]], out: np.ndarray, specs: Sequence[BlockSpec], threads, where: str) -> None:
    """Decode each ``(key, frame)`` on the CPU, without torch, into its bytes end to end in
    ``out``; a frame that fails raises naming its key."""
    start = 0
    for (key, f), spec in zip(frames, specs, strict=True):
        try:
            decode_raw(f, spec.dtype, spec.shape, out=out[start : start + spec.nbytes], threads=threads)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise block_error(key, exc, where) from exc
        start += spec.nbytes


def decode_rows_into(
    keys: Sequence[str], rows: np.ndarray, out: np.ndarray, dtype: str, shape: tuple[int, ...], *, threads=None, where=""
) -> None:
    """:func:`decode_into` for frames that all hold blocks of ``dtype`` and ``shape``, one a
    row of ``rows`` (a ``[len(keys), frame_size]`` uint8 array: a part's frames of one size
    lie end to end in its file), on the CPU: small blocks are checked and decoded as one
    run, without a Python object per frame. A frame that fails raises naming its key, as
    there."""
    if not (isinstance(rows, np.ndarray) and rows.dtype == np.uint8 and rows.ndim == 2):
        raise BadInputError(f"rows must be a 2-d uint8 array of frames, one a row, got {type(rows).__name__}")
    if not len(keys) or len(rows) != len(keys):
        raise BadInputError(f"{len(keys)} keys for {len(rows)} frames: give one key a frame, and at least one")
    specs = [BlockSpec(keys[0], dtype, tuple(shape))]
    size = len(keys) * specs[0].nbytes
    if size > out.size:
        raise BadInputError(f"out holds {out.size} bytes, the blocks of {len(keys)} frames need {size}")
    try:
        header = frame.parse_header(rows[0])
    except CorruptFrameError:
        header = None  # named below
    if (
        len(keys) > 1
        and header is not None
        and (header.dtype, header.shape) == (dtype, specs[0].shape)
        and fits_run(header.scaling, header.block_size, dtype, header.shape)
        and decode_run(rows, header, out[:size], threads)
    ):
        return
    specs += [BlockSpec(key, dtype, specs[0].shape) for key in keys[1:]]  # one at a time: a damaged frame is named
    _decode_each(list(zip(keys, rows)), out, specs, threads, where)
