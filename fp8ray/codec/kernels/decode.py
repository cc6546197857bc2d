"""Decode kernels: fp8 codes times their scales, rounded into the output dtype."""

from __future__ import annotations

from numba import njit

from .bits import _decode_params, _fp8_to_f32, _store


@njit(inline="always", error_model="numpy")
def _dequantize_span(codes, dp, scale, out):
    for i in range(codes.size):
        _store(out, i, _fp8_to_f32(codes[i], dp) * scale)


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize_uniform(codes, tag, scale, out, start, stop):
    _dequantize_span(codes[start:stop], _decode_params(tag), scale, out[start:stop])


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize_groups(codes, tag, scales, group, out, group_start, group_stop):
    dp = _decode_params(tag)
    n = codes.size
    for g in range(group_start, group_stop):
        start = g * group
        stop = min(start + group, n)
        _dequantize_span(codes[start:stop], dp, scales[g], out[start:stop])


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize_columns(codes, tag, scales, columns, out, row_start, row_stop):
    dp = _decode_params(tag)
    for r in range(row_start, row_stop):
        row = codes[r * columns : (r + 1) * columns]
        row_out = out[r * columns : (r + 1) * columns]
        for c in range(row.size):
            _store(row_out, c, _fp8_to_f32(row[c], dp) * scales[c])
