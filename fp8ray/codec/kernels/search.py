"""The scale search of ``scale_choice="mse"``: per group, the candidate scale with the
least squared error (as :func:`fp8ray.codec.reference.choose_scales` defines it), then
the group's codes under it.

The search is LLVM IR over explicit 16-lane vectors (:mod:`.vectors`): numba's loops over
the candidates and the lanes did not vectorise (a loop over an array of sums is a chain of
loads and stores, and the definition's order of additions may not be changed by the
compiler). Per 16 elements and candidate it costs nine vector operations: a product by
the candidate's reciprocal, the rounding to the fp8 grid by adding and subtracting a
power of two (three integer operations find it), the difference, its square and the
lane's sum.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...errors import InvalidOptionError
from .bits import _F32, _I32, _bits_to_f32, _encode_params, _i32, _load
from .encode import _quantize_span, _span_key
from .vectors import (
    ENCODED,
    ENCODED_PAIR,
    INF_BITS,
    LANES,
    VF,
    VI,
    candidate_scales,
    emit_encode_group,
    emit_encode_pair,
    halve,
    is_source,
    splat,
)

SEARCH_WIDTH = 8  # candidates per search: e4m3fn's 8; fewer are padded (see pad_candidates)
_WF = ir.VectorType(_F32, SEARCH_WIDTH)
_WD = ir.VectorType(ir.DoubleType(), SEARCH_WIDTH)


def pad_candidates(divisors: tuple[float, ...], fmax: float) -> np.ndarray:
    """The search's SEARCH_WIDTH divisors: ``divisors`` then repeats of its last one. A
    repeat has its original's error and comes after it, so it never wins the strict
    comparison: the choice is that of ``divisors`` alone.

    Every divisor must be at most ``fmax``: then no quotient needs the clamp. ``|x| /
    scale`` exceeds the divisor by less than 2**-6 relative (the bfloat16 truncation of
    the scale, under 2**-7, and three fp32 roundings), and the grid rounds anything that
    close above finfo.max back to it (the next fp8 binade's spacing is 2**-3 of it or more).
    """
    if not 0 < len(divisors) <= SEARCH_WIDTH or not all(0 < d <= fmax for d in divisors):
        raise InvalidOptionError(
            f"the scale search takes 1 to {SEARCH_WIDTH} divisors in (0, {fmax}], got {divisors}", field="scale_choice"
        )
    return np.array(divisors + divisors[-1:] * (SEARCH_WIDTH - len(divisors)), dtype=np.float32)


def _emit_best_scales(builder, chunks, magnitude_loaders, amaxes, divisors_ptr, mask, params):
    """IR: for each group, the first of the scales ``amax / divisors[k]`` with the least
    search error over the group whose 16-element chunk ``i`` has the magnitudes
    ``magnitude_loaders[group](i)`` (|x|, non-finite as 0; zero past the group's end).
    The groups (of as many chunks each) share one loop, so their chains overlap."""
    divisors = builder.load(builder.bitcast(divisors_ptr, _WF.as_pointer()), align=4)
    exponent_to_magic = splat(builder, builder.shl(builder.trunc(builder.extract_value(params, 1), _I32), _i32(23)), VI)
    subnormal_magic = splat(builder, builder.trunc(builder.extract_value(params, 4), _I32), VI)
    scales, r, sums = [], [], []
    for amax in amaxes:
        scales.append(candidate_scales(builder, amax, divisors, mask))
        reciprocals = builder.fdiv(ir.Constant(_WF, [1.0] * SEARCH_WIDTH), scales[-1])
        r.append([splat(builder, builder.extract_element(reciprocals, _i32(k)), VF) for k in range(SEARCH_WIDTH)])
        # Sums start at -0.0, which LLVM may drop from the first addition (+0.0 it may not,
        # as -0.0 + +0.0 is +0.0); the terms are squares, so the sums are the same.
        sums.append([cgutils.alloca_once_value(builder, ir.Constant(VF, [-0.0] * LANES)) for _ in range(SEARCH_WIDTH)])
    with cgutils.for_range(builder, chunks) as loop:
        for load_magnitudes, group_r, group_sums in zip(magnitude_loaders, r, sums):
            x = load_magnitudes(loop.index)
            for k in range(SEARCH_WIDTH):
                q = builder.fmul(x, group_r[k])  # no clamp needed: see pad_candidates
                # q rounded to the fp8 grid: q + m - m, m the power of two whose fp32 ulp is
                # the grid's spacing at q (2**shift times q's binade; the subnormal magic below it).
                m = builder.add(builder.and_(builder.bitcast(q, VI), ir.Constant(VI, [INF_BITS] * LANES)), exponent_to_magic)
                m = builder.bitcast(builder.select(builder.icmp_signed(">", m, subnormal_magic), m, subnormal_magic), VF)
                d = builder.fsub(builder.fsub(builder.fadd(q, m), m), q)
                builder.store(builder.fadd(builder.load(group_sums[k]), builder.fmul(d, d)), group_sums[k])
    return [_least_error(builder, group_scales, group_sums) for group_scales, group_sums in zip(scales, sums)]


def _least_error(builder, scales, sums):
    """IR: the first of ``scales`` whose lane sums ``sums`` (halved to one) give the least error."""
    totals = ir.Constant(_WF, ir.Undefined)
    for k in range(SEARCH_WIDTH):
        totals = builder.insert_element(totals, halve(builder, builder.load(sums[k]), builder.fadd), _i32(k))
    # Errors in x's units: the sum of squares (in units of the scale) times scale**2, in fp64.
    wide = builder.fpext(scales, _WD)
    errors = builder.fmul(builder.fpext(totals, _WD), builder.fmul(wide, wide))
    best_error = builder.extract_element(errors, _i32(0))
    best = builder.extract_element(scales, _i32(0))
    for k in range(1, SEARCH_WIDTH):
        error = builder.extract_element(errors, _i32(k))
        better = builder.fcmp_ordered("<", error, best_error)
        best_error = builder.select(better, error, best_error)
        best = builder.select(better, builder.extract_element(scales, _i32(k)), best)
    return best


@intrinsic
def _best_scale(typingctx, magnitudes, amax, divisors, mask, p):
    """The first of the scales ``amax / divisors[k]`` with the least error over
    ``magnitudes`` (|x| of the group, non-finite as 0, zero-padded to a multiple of LANES)."""
    if not (isinstance(magnitudes, types.Array) and magnitudes.dtype == types.float32 and amax == types.float32):
        return None

    def codegen(context, builder, signature, args):
        mags, amax, divs, mask, params = args
        mag_array = context.make_array(signature.args[0])(context, builder, mags)
        div_array = context.make_array(signature.args[2])(context, builder, divs)
        data = builder.bitcast(mag_array.data, VF.as_pointer())
        chunks = builder.udiv(builder.extract_value(mag_array.shape, 0), ir.Constant(ir.IntType(64), LANES))
        load = lambda i: builder.load(builder.gep(data, [i]), align=4)  # noqa: E731
        return _emit_best_scales(builder, chunks, [load], [amax], div_array.data, mask, params)[0]

    return types.float32(magnitudes, amax, divisors, mask, p), codegen


@intrinsic
def _encode_full_group(typingctx, xs, codes, divisors, mask, p):
    """A group of a multiple of 16 elements under the searched scale, in vectors
    (:func:`.vectors.emit_encode_group`): (scale, non-finite inputs)."""
    if not (is_source(xs) and isinstance(codes, types.Array)):
        return None

    def codegen(context, builder, signature, args):
        divisors = context.make_array(signature.args[2])(context, builder, args[2]).data
        mask, params = args[3], args[4]

        def choose(amaxes, chunks, magnitude_loaders):
            return _emit_best_scales(builder, chunks, magnitude_loaders, amaxes, divisors, mask, params)

        return emit_encode_group(context, builder, signature, args, choose)

    return ENCODED(xs, codes, divisors, mask, p), codegen


@intrinsic
def _encode_full_pair(typingctx, xs, codes, xs2, codes2, divisors, mask, p):
    """Two groups of the same multiple of 16 elements, each under its searched scale, in
    the same loops (:func:`.vectors.emit_encode_pair`): (first scale, second, non-finite inputs)."""
    if not (is_source(xs) and xs2 == xs and isinstance(codes, types.Array) and codes2 == codes):
        return None

    def codegen(context, builder, signature, args):
        divisors = context.make_array(signature.args[4])(context, builder, args[4]).data
        mask, params = args[5], args[6]

        def choose(amaxes, chunks, magnitude_loaders):
            return _emit_best_scales(builder, chunks, magnitude_loaders, amaxes, divisors, mask, params)

        return emit_encode_pair(context, builder, signature, args, choose)

    return ENCODED_PAIR(xs, codes, xs2, codes2, divisors, mask, p), codegen


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_groups_search(x, codes, scales, group, group_start, group_stop, tag, mask, divisors):
    """:func:`quantize_groups` with each group's scale chosen by :func:`_best_scale`
    among the SEARCH_WIDTH ``divisors`` (see :func:`pad_candidates`)."""
    p = _encode_params(tag)
    n = x.size
    inf = np.float32(np.inf)
    magnitudes = np.zeros(-(-group // LANES) * LANES, dtype=np.float32)
    bad = 0
    g = group_start
    while g < group_stop:
        start = g * group
        stop = min(start + group, n)
        xs = x[start:stop]
        if xs.size % LANES == 0 and g + 1 < group_stop and stop + group <= n:  # two whole groups
            pair = _encode_full_pair(xs, codes[start:stop], x[stop : stop + group], codes[stop : stop + group], divisors, mask, p)
            scales[g] = pair[0]
            scales[g + 1] = pair[1]
            bad += pair[2]
            g += 2
            continue
        if xs.size % LANES == 0:
            scale, count = _encode_full_group(xs, codes[start:stop], divisors, mask, p)
            scales[g] = scale
            bad += count
            g += 1
            continue
        for i in range(xs.size):
            v = abs(_load(xs, i))
            magnitudes[i] = v if v < inf else np.float32(0.0)
        if xs.size < group:  # the last, short group: zeros add nothing to a sum
            magnitudes[xs.size :] = 0
        scale = _best_scale(magnitudes, _bits_to_f32(np.int64(_span_key(xs))), divisors, mask, p)
        scales[g] = scale
        bad += _quantize_span(xs, codes[start:stop], scale, p)
        g += 1
    return bad
