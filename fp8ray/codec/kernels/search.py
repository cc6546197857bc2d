"""The scale search of ``scale_choice="mse"``: per group, the candidate scale with the
least squared error, then the group's codes under it."""

from __future__ import annotations

import numpy as np
from numba import njit

from .bits import _bits_to_f32, _decode_params, _encode_params, _fp8_code, _fp8_to_f32, _load, scale_from_amax
from .encode import _quantize_span, _span_key

# Scale search (scale_choice="mse"). Per candidate, the squared errors of up to
# _SEARCH_CHUNK elements are made in one vectorised loop; then each candidate's fp64 sum
# takes them strictly in element order, as the reference adds them. LLVM may not reorder
# such a sum, so each is a chain of dependent adds: SEARCH_WIDTH of them side by side in
# registers overlap in the pipeline (a loop over an array of sums ran 1.4x slower).
_SEARCH_CHUNK = 64
SEARCH_WIDTH = 8  # candidates per search: e4m3fn's 8; fewer are padded (see pad_candidates)


def pad_candidates(divisors: tuple[float, ...]) -> np.ndarray:
    """The search's SEARCH_WIDTH divisors: ``divisors`` then repeats of its last one. A
    repeat has its original's error and comes after it, so it never wins the strict
    comparison: the choice is that of ``divisors`` alone."""
    if not 0 < len(divisors) <= SEARCH_WIDTH:
        raise ValueError(f"the scale search takes 1 to {SEARCH_WIDTH} candidates, got {len(divisors)}")
    return np.array(divisors + divisors[-1:] * (SEARCH_WIDTH - len(divisors)), dtype=np.float32)


@njit(inline="always", error_model="numpy")
def _squared_errors(x, scale, p, dp, sq):
    """sq[i] = (fp32(fp8(x_i / scale) * scale) - x_i)**2 in fp64; 0 for a non-finite x_i
    (replaced by 0 before the arithmetic: a select, where masking the result would be a
    branch that stops the loop from vectorising)."""
    inf = np.float32(np.inf)
    for i in range(x.size):
        v = _load(x, i)
        v = v if abs(v) < inf else np.float32(0.0)
        e = np.float64(_fp8_to_f32(_fp8_code(v, scale, p), dp) * scale) - np.float64(v)
        sq[i] = e * e


@njit(inline="always", error_model="numpy")
def _search_scale(xs, amax, divisors, mask, p, dp, sq, candidates):
    """The first of the candidate scales ``amax / divisors[k]`` with the least squared error."""
    for k in range(SEARCH_WIDTH):
        candidates[k] = scale_from_amax(amax, divisors[k], mask)
    e0 = e1 = e2 = e3 = e4 = e5 = e6 = e7 = 0.0
    for c0 in range(0, xs.size, _SEARCH_CHUNK):
        chunk = xs[c0 : min(c0 + _SEARCH_CHUNK, xs.size)]
        for k in range(SEARCH_WIDTH):
            _squared_errors(chunk, candidates[k], p, dp, sq[k])
        for i in range(chunk.size):
            e0 += sq[0, i]
            e1 += sq[1, i]
            e2 += sq[2, i]
            e3 += sq[3, i]
            e4 += sq[4, i]
            e5 += sq[5, i]
            e6 += sq[6, i]
            e7 += sq[7, i]
    errors = (e0, e1, e2, e3, e4, e5, e6, e7)
    best = 0
    for k in range(1, SEARCH_WIDTH):
        best = k if errors[k] < errors[best] else best
    return candidates[best]


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_groups_search(x, codes, scales, group, group_start, group_stop, tag, mask, divisors):
    """:func:`quantize_groups` with each group's scale chosen by :func:`_search_scale`
    among the SEARCH_WIDTH ``divisors`` (see :func:`pad_candidates`)."""
    p = _encode_params(tag)
    dp = _decode_params(tag)
    n = x.size
    sq = np.empty((SEARCH_WIDTH, _SEARCH_CHUNK), dtype=np.float64)
    candidates = np.empty(SEARCH_WIDTH, dtype=np.float32)
    bad = 0
    for g in range(group_start, group_stop):
        start = g * group
        stop = min(start + group, n)
        xs = x[start:stop]
        scale = _search_scale(xs, _bits_to_f32(np.int64(_span_key(xs))), divisors, mask, p, dp, sq, candidates)
        scales[g] = scale
        bad += _quantize_span(xs, codes[start:stop], scale, p)
    return bad
