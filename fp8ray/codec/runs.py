"""Runs: many small blocks of one dtype and shape, encoded (or decoded) in one kernel call.

A 16 KiB block's kernel work takes a few microseconds; the Python around a frame (its
header, views, checks) takes tens. The blocks of a run share one header, and their
scale groups line up with the blocks: a token scale covers a row of one block, a block
scale ``block_size`` elements when that divides the block, and the tensor scale of each
block is a token scale over the block's elements taken as one row. So one kernel call
over the run's elements, laid end to end, gives each block the codes and scales of
encoding it alone, bit for bit (``tests/codec/test_runs.py``). numpy then copies those
codes and scales into the N frames at once; decoding checks a run's sizes, headers and
scales with one numpy call each. Only the CRC-32C is still taken per frame, one C call
each (the format stores one per frame).
"""

from __future__ import annotations

import math

import numpy as np

from . import cpu, frame
from .formats import DTYPE_ITEMSIZES, KERNEL_TYPES, tensor_nbytes
from .fp8codec import Fp8Codec

# Blocks up to this size go in runs: for larger ones the per-frame Python is lost in the
# kernel's own time.
RUN_BLOCK_BYTES = 1 << 20
# A run's temporaries (the blocks' elements end to end, their codes) stay this small.
RUN_BYTES = 32 << 20


def runs_of(specs, fits) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of consecutive ``specs`` (anything with ``dtype`` and
    ``shape``) of one dtype and shape for which ``fits(spec)`` holds, 2 or more long and
    at most :data:`RUN_BYTES`; other specs are left out (encoded one at a time)."""
    runs = []
    start = 0
    while start < len(specs):
        first = specs[start]
        stop = start + 1
        if fits(first):
            each = tensor_nbytes(first.dtype, first.shape)
            limit = start + max(RUN_BYTES // max(each, 1), 1)
            while stop < min(len(specs), limit) and (specs[stop].dtype, specs[stop].shape) == (first.dtype, first.shape):
                stop += 1
            if stop - start >= 2:
                runs.append((start, stop))
        start = stop
    return runs


def _grouping(header: frame.FrameHeader, count: int) -> tuple[str, tuple[int, ...]]:
    """The scaling and shape whose groups, over ``count`` blocks end to end, are each
    block's own: a tensor scale becomes one token scale per block."""
    numel = header.numel
    if header.scaling == "tensor":
        return "token", (count, numel)
    if header.scaling == "token":
        last = header.shape[-1] if header.shape else 1
        return "token", (count * numel // last, last)
    return header.scaling, (count * numel,)


def fits_run(scaling: str, block_size: int, dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether blocks of ``dtype`` and ``shape`` may be coded in a run under ``scaling``:
    small, not empty, and with scale groups that do not cross from one block into the
    next (channel scales span a whole block's rows, and a ``block_size`` that does not
    divide the block leaves a short last group)."""
    if not small(dtype, shape) or scaling == "channel":
        return False
    return scaling != "block" or math.prod(shape) % block_size == 0


def small(dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether a block is small enough to gain from a run (and not empty), and encoded in
    fp8 (a stored frame's bytes are copied, one frame at a time)."""
    numel = math.prod(shape)
    return dtype in KERNEL_TYPES and 0 < numel * DTYPE_ITEMSIZES[dtype] <= RUN_BLOCK_BYTES


def encode_run(codec: Fp8Codec, dtype: str, shape: tuple[int, ...], source: np.ndarray, frames: np.ndarray, threads=None) -> bool:
    """Encode ``source`` (the raw bytes of ``len(frames)`` blocks of ``dtype`` and ``shape``,
    end to end in one uint8 array) into the rows of ``frames`` (a writable
    ``[blocks, frame_size]`` uint8 array); returns whether it did: ``False`` where the codec
    refuses a non-finite input (the frames are left unwritten; the caller encodes those
    blocks alone to name the first)."""
    count = len(frames)
    header = codec._header(shape, dtype)
    scaling, grouped = _grouping(header, count)
    x = source.view(KERNEL_TYPES[dtype]).reshape(grouped)
    num_scales = header.num_scales
    codes = np.empty(count * header.numel, np.uint8)
    scales = np.empty(count * num_scales, np.float32)
    # The tensor scale is amax's alone (scale_choice applies to token and block scaling).
    choice = "amax" if codec.scaling == "tensor" else codec.scale_choice
    bad = cpu.quantize(x, codec.fmt, scaling, codec.block_size, codes, scales, codec.scale_dtype, choice, threads)
    if bad and codec.nonfinite == "error":
        return False
    frame.write_header(frames[0], header)
    frames[1:, : header.scales_offset] = frames[0, : header.scales_offset]
    if num_scales:
        stored = scales.view(np.uint32) >> 16 if header.scale_dtype == "bfloat16" else scales.view(np.uint32)
        narrow = stored.astype("<u2") if header.scale_dtype == "bfloat16" else stored.astype("<u4")
        frames[:, header.scales_offset : header.codes_offset] = narrow.view(np.uint8).reshape(count, -1)
    frames[:, header.codes_offset : header.codes_offset + header.numel] = codes.reshape(count, -1)
    frame.seal_rows(frames)
    return True


def decode_run(run: np.ndarray, header: frame.FrameHeader, out: np.ndarray, threads=None) -> bool:
    """Decode the frames held one a row of ``run`` (a ``[frames, frame_size]`` uint8 array)
    whose headers are all ``header`` into ``out`` (their raw bytes end to end); ``False``,
    with ``out`` untouched, where any frame's header bytes, size or checksum differ from
    what ``header`` says, or a scale could make a finite code overflow (the caller decodes
    them one at a time, to name the damaged one)."""
    count = len(run)
    if run.shape[1] != header.frame_size:
        return False
    start, codes_at, numel = header.scales_offset, header.codes_offset, header.numel
    expected = np.empty(start, np.uint8)
    frame.write_header(expected, header)
    if not (run[:, :start] == expected).all() or not frame.checksums_hold(run):  # each check one numpy call
        return False
    scales = frame.widen_scales(run[:, start:codes_at].reshape(-1), header.scale_dtype)
    if (scales.size and not frame.scales_valid(scales)) or frame.may_overflow(header, scales):
        return False  # one at a time, each frame's overflow is checked and a refused one named
    codes = run[:, codes_at : codes_at + numel].reshape(-1)
    scaling, grouped = _grouping(header, count)
    target = out[: count * numel * DTYPE_ITEMSIZES[header.dtype]].view(KERNEL_TYPES[header.dtype]).reshape(grouped)
    cpu.dequantize(codes, scales, header.fmt, scaling, grouped, header.block_size, target, threads)
    return True
