"""Encode kernels: amax, scales and fp8 codes over a range of elements, groups or rows."""

from __future__ import annotations

import numpy as np
from numba import njit

from .bits import _bits_to_f32, _encode_params, _finite_key, _fp8_code, _load, scale_from_amax
from .vectors import (
    LANES,
    column_key_max,
    encode_chunks,
    encode_chunks_per_element,
    encode_group_amax,
    encode_quad_amax,
    finite_amax_chunks,
)


@njit(inline="always", error_model="numpy")
def _count_nonfinite(codes, p):
    """Non-finite inputs, counted from their codes afterwards: counting inside the cast
    loop keeps LLVM from vectorising it, and this pass reads bytes still in cache."""
    max_finite_code = p[8]
    bad = 0
    for i in range(codes.size):
        bad += (codes[i] & 0x7F) > max_finite_code
    return bad


# The span helpers are inlined by numba (inline="always") so that the format constants
# reach their loops: LLVM does not inline a function that holds a loop.
# Every loop below runs over ``range(view.size)`` of a slice taken inside the kernel: with
# a loop index that is provably non-negative, numba drops its wraparound check and LLVM
# vectorises the loop (an index from ``range(start, stop)`` runs about 6x slower).


@njit(inline="always", error_model="numpy")
def _span_key(x):
    key = 0
    for i in range(x.size):
        key = max(key, _finite_key(_load(x, i)))
    return key


@njit(inline="always", error_model="numpy")
def _quantize_span(x, codes, scale, p):
    for i in range(x.size):
        codes[i] = _fp8_code(_load(x, i), scale, p)
    return _count_nonfinite(codes, p)


@njit(nogil=True, cache=True, error_model="numpy")
def amax_span(x, start, stop):
    """Largest finite |x[i]| for i in [start, stop), as float32 (0 if none): the whole
    chunks in vectors (numba's own loop took 0.9 ns an element of bf16), the rest here."""
    xs = x[start:stop]
    whole = xs.size - xs.size % LANES
    return max(finite_amax_chunks(xs[:whole]), _bits_to_f32(np.int64(_span_key(xs[whole:]))))


@njit(nogil=True, cache=True, error_model="numpy")
def amax_columns(x, columns, row_start, row_stop, amax):
    """Fold rows [row_start, row_stop) of x viewed as [rows, columns] into per-column
    float32 maxima of the finite |x|: the whole 16-column chunks on the source's bits
    (:func:`.vectors.column_key_max`), the rest on fp32 values (NaN fails the comparison
    and inf the bound, so neither enters)."""
    inf = np.float32(np.inf)
    whole = columns - columns % LANES
    keys = np.zeros(whole, x.dtype)  # the bits of the largest finite |x| so far, per column
    for r in range(row_start, row_stop):
        row = x[r * columns : (r + 1) * columns]
        column_key_max(row[:whole], keys)
        rest, rest_amax = row[whole:], amax[whole:columns]
        for c in range(rest.size):
            a = abs(_load(rest, c))
            rest_amax[c] = a if (a > rest_amax[c]) & (a < inf) else rest_amax[c]
    for c in range(whole):
        amax[c] = max(amax[c], _load(keys, c))


@njit(nogil=True, cache=True, error_model="numpy")
def amax_to_scales(amax, fmax, mask, scales):
    for c in range(amax.size):
        scales[c] = scale_from_amax(amax[c], fmax, mask)


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_uniform(x, codes, start, stop, scale, tag):
    """Codes of x[start:stop] under one scale; returns the count of non-finite inputs."""
    p = _encode_params(tag)
    xs = x[start:stop]
    whole = xs.size - xs.size % LANES  # in vectors, the count in the same loop (:mod:`.vectors`)
    bad = encode_chunks(xs[:whole], codes[start : start + whole], scale, p)
    return bad + _quantize_span(xs[whole:], codes[start + whole : stop], scale, p)


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_groups(x, codes, scales, group, group_start, group_stop, tag, mask):
    """Per-group amax, scale and codes for contiguous groups of ``group`` elements.

    One read of each group from memory: the second pass over a group hits the cache. A
    group of a multiple of 16 elements is encoded in vectors whole (:mod:`.vectors`), four
    such groups at a time where they follow each other (their dependent steps overlap).
    """
    p = _encode_params(tag)
    n = x.size
    fmax = p[0]
    bad = 0
    g = group_start
    while g < group_stop:
        start = g * group
        stop = min(start + group, n)
        xs = x[start:stop]
        if xs.size % LANES == 0 and g + 3 < group_stop and stop + 3 * group <= n:  # four whole groups
            a, b, c = stop + group, stop + 2 * group, stop + 3 * group
            quad = encode_quad_amax(
                xs, codes[start:stop], x[stop:a], codes[stop:a], x[a:b], codes[a:b], x[b:c], codes[b:c], mask, p
            )
            scales[g], scales[g + 1], scales[g + 2], scales[g + 3], count = quad
            bad += count
            g += 4
            continue
        if xs.size % LANES == 0:
            scale, count = encode_group_amax(xs, codes[start:stop], mask, p)
            scales[g] = scale
            bad += count
            g += 1
            continue
        scale = scale_from_amax(_bits_to_f32(np.int64(_span_key(xs))), fmax, mask)
        scales[g] = scale
        bad += _quantize_span(xs, codes[start:stop], scale, p)
        g += 1
    return bad


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_columns(x, codes, scales, columns, row_start, row_stop, tag):
    """Codes of rows [row_start, row_stop) of x viewed as [rows, columns], scale per column."""
    p = _encode_params(tag)
    whole = columns - columns % LANES
    reciprocals = np.empty(whole, np.float32)
    for c in range(whole):
        # The half route's y = RN(1 / s'), s' = scale * 2**(15 - bias), as uniform_pair_scales makes it.
        reciprocals[c] = np.float32(1) / (scales[c] * p[9])
    bad = 0
    for r in range(row_start, row_stop):
        row = x[r * columns : (r + 1) * columns]
        row_codes = codes[r * columns : (r + 1) * columns]
        bad += encode_chunks_per_element(row[:whole], row_codes[:whole], scales[:whole], reciprocals, p)
        rest, rest_codes, rest_scales = row[whole:], row_codes[whole:], scales[whole:columns]
        for c in range(rest.size):
            rest_codes[c] = _fp8_code(_load(rest, c), rest_scales[c], p)
        bad += _count_nonfinite(rest_codes, p)
    return bad
