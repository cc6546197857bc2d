"""Decode kernels: fp8 codes times their scales, rounded into the output dtype."""

from __future__ import annotations

import numpy as np
from numba import njit

from .bits import _decode_params, _fp8_to_f32, _store
from .vectors import LANES, decode_chunks, decode_groups


@njit(inline="always", error_model="numpy")
def _dequantize_span(codes, tag, dp, scale, out):
    whole = codes.size - codes.size % LANES  # in vectors (:mod:`.vectors`), then the rest here
    decode_chunks(codes[:whole], scale, out[:whole], tag, scale)
    rest, rest_out = codes[whole:], out[whole:]
    for i in range(rest.size):
        _store(rest_out, i, _fp8_to_f32(rest[i], dp) * scale)


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize_uniform(codes, tag, scale, out, start, stop):
    _dequantize_span(codes[start:stop], tag, _decode_params(tag), scale, out[start:stop])


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize_groups(codes, tag, scales, group, out, group_start, group_stop):
    dp = _decode_params(tag)
    n = codes.size
    whole = max(group_start, min(group_stop, n // group)) if group % LANES == 0 else group_start  # in vectors
    if whole > group_start:
        span = slice(group_start * group, whole * group)
        decode_groups(codes[span], scales[group_start:whole], out[span], tag)
    for g in range(whole, group_stop):
        start = g * group
        stop = min(start + group, n)
        _dequantize_span(codes[start:stop], tag, dp, scales[g], out[start:stop])


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize_columns(codes, tag, scales, columns, out, row_start, row_stop):
    dp = _decode_params(tag)
    whole = columns - columns % LANES
    smallest = scales[:whole].min() if whole else np.float32(1.0)
    for r in range(row_start, row_stop):
        row = codes[r * columns : (r + 1) * columns]
        row_out = out[r * columns : (r + 1) * columns]
        decode_chunks(row[:whole], scales[:whole], row_out[:whole], tag, smallest)  # a scale per lane
        rest, rest_out, rest_scales = row[whole:], row_out[whole:], scales[whole:columns]
        for c in range(rest.size):
            _store(rest_out, c, _fp8_to_f32(rest[c], dp) * rest_scales[c])
