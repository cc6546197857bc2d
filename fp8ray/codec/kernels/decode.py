"""Decode kernels: fp8 codes times their scales, rounded into the output dtype. Each
returns the CRC-32C of the codes it read, taken in its own loops where
:data:`~.bits.CRC_IN_KERNELS` (0 elsewhere: the caller takes it)."""

from __future__ import annotations

import numpy as np
from numba import njit

from .bits import CRC_IN_KERNELS, CRC_START, _crc32c_byte, _decode_params, _fp8_to_f32, _store
from .vectors import LANES, decode_chunks, decode_groups


@njit(inline="always", error_model="numpy")
def _dequantize_span(codes, tag, dp, scale, out, running):
    whole = codes.size - codes.size % LANES  # in vectors (:mod:`.vectors`), then the rest here
    running = decode_chunks(codes[:whole], scale, out[:whole], tag, scale, running)
    rest, rest_out = codes[whole:], out[whole:]
    for i in range(rest.size):
        _store(rest_out, i, _fp8_to_f32(rest[i], dp) * scale)
        running = _crc32c_byte(running, rest[i])
    return running


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize_uniform(codes, tag, scale, out, start, stop):
    running = _dequantize_span(codes[start:stop], tag, _decode_params(tag), scale, out[start:stop], np.int64(CRC_START))
    return _crc_of(running)


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize_groups(codes, tag, scales, group, out, group_start, group_stop):
    dp = _decode_params(tag)
    n = codes.size
    running = np.int64(CRC_START)
    whole = max(group_start, min(group_stop, n // group)) if group % LANES == 0 else group_start  # in vectors
    if whole > group_start:
        span = slice(group_start * group, whole * group)
        running = decode_groups(codes[span], scales[group_start:whole], out[span], tag, running)
    for g in range(whole, group_stop):
        start = g * group
        stop = min(start + group, n)
        running = _dequantize_span(codes[start:stop], tag, dp, scales[g], out[start:stop], running)
    return _crc_of(running)


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize_columns(codes, tag, scales, columns, out, row_start, row_stop):
    dp = _decode_params(tag)
    whole = columns - columns % LANES
    smallest = scales[:whole].min() if whole else np.float32(1.0)
    running = np.int64(CRC_START)
    for r in range(row_start, row_stop):
        row = codes[r * columns : (r + 1) * columns]
        row_out = out[r * columns : (r + 1) * columns]
        running = decode_chunks(row[:whole], scales[:whole], row_out[:whole], tag, smallest, running)  # a scale per lane
        rest, rest_out, rest_scales = row[whole:], row_out[whole:], scales[whole:columns]
        for c in range(rest.size):
            _store(rest_out, c, _fp8_to_f32(rest[c], dp) * rest_scales[c])
            running = _crc32c_byte(running, rest[c])
    return _crc_of(running)


@njit(inline="always")
def _crc_of(running):
    """The CRC-32C from its running value (0 where the kernels take none)."""
    return running ^ CRC_START if CRC_IN_KERNELS else 0
