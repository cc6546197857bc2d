"""The scale search of ``scale_choice="mse"``: per group, the candidate scale with the
least squared error (as :func:`fp8ray.codec.reference.choose_scales` defines it), then
the group's codes under it.

The search is LLVM IR over explicit 16-lane vectors (:mod:`.vectors`): numba's loops over
the candidates and the lanes did not vectorise (a loop over an array of sums is a chain of
loads and stores, and the definition's order of additions may not be changed by the
compiler). Per 16 elements and candidate it costs five vector operations: a product by
the candidate's reciprocal, the rounding to the fp8 mantissa (an integer add and an and
on the bits), the difference, and a fused multiply-add of its square into the lane's
sum. Before the definition of 2026-12-03 18:00 (exact fp8 rounding, squares then sums)
it took nine; with the sums halved side by side and the least error found as a tree, the
kernel alone went from 69 to 51 ns per group of 32 and from 265 to 181 per row of 192
(BENCHMARKS.md, an AVX-512 machine). On an AVX2 machine (Zen 2) the least error found by
halves, then its first lane, in place of the tree, took it from 87 to 69 ns per group.
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
    ENCODED_QUAD,
    LANES,
    VF,
    VI,
    candidate_scales,
    emit_encode_group,
    emit_encode_quad,
    is_source,
    splat,
)

SEARCH_WIDTH = 8  # candidates per search: e4m3fn's 8; fewer are padded (see pad_candidates)
# The sums' halving side by side and the least error's halves pair candidates off.
assert SEARCH_WIDTH & (SEARCH_WIDTH - 1) == 0 and SEARCH_WIDTH <= LANES
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
    The groups (of as many chunks each) share one loop, so their chains overlap. Groups
    of two chunks (blocks of 32, the default) go without a loop, a candidate at a time:
    in the loop every candidate's lane sums stay live across iterations (4 groups x 8
    candidates x 16 lanes: on AVX2 64 registers' worth, of 16), so each product was
    added to a sum loaded from and stored back to the stack (96 against 87 ns a group
    on one thread, AVX2, scripts/search_kernel.py); the sums are the same, added in the
    same order."""
    divisors = builder.load(builder.bitcast(divisors_ptr, _WF.as_pointer()), align=4)
    # The grid's rounding on q's bits (reference.nearest_with_mantissa): add half the
    # dropped bits' range, then clear them.
    shift = builder.trunc(builder.extract_value(params, 1), _I32)
    half = splat(builder, builder.shl(_i32(1), builder.sub(shift, _i32(1))), VI)
    keep = splat(builder, builder.shl(_i32(-1), shift), VI)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VF, [VF, VF, VF]), f"llvm.fma.v{LANES}f32")
    scales, r, sums = [], [], []
    for amax in amaxes:
        scales.append(candidate_scales(builder, amax, divisors, mask))
        reciprocals = builder.fdiv(ir.Constant(_WF, [1.0] * SEARCH_WIDTH), scales[-1])
        r.append([splat(builder, builder.extract_element(reciprocals, _i32(k)), VF) for k in range(SEARCH_WIDTH)])
        sums.append([cgutils.alloca_once_value(builder, ir.Constant(VF, [0.0] * LANES)) for _ in range(SEARCH_WIDTH)])

    def add_square(x, reciprocal, total):
        q = builder.fmul(x, reciprocal)  # no clamp needed: see pad_candidates
        nearest = builder.bitcast(builder.and_(builder.add(builder.bitcast(q, VI), half), keep), VF)
        d = builder.fsub(nearest, q)
        return builder.call(fma, [d, d, total])

    two = builder.icmp_unsigned("==", chunks, chunks.type(2))
    with builder.if_else(two, likely=True) as (pair_of_chunks, any_count):
        with pair_of_chunks:
            loaded = [[load_magnitudes(chunks.type(i)) for i in (0, 1)] for load_magnitudes in magnitude_loaders]
            for k in range(SEARCH_WIDTH):
                for (x0, x1), group_r, group_sums in zip(loaded, r, sums):
                    first = add_square(x0, group_r[k], ir.Constant(VF, [0.0] * LANES))
                    builder.store(add_square(x1, group_r[k], first), group_sums[k])
        with any_count:
            with cgutils.for_range(builder, chunks) as loop:
                for load_magnitudes, group_r, group_sums in zip(magnitude_loaders, r, sums):
                    x = load_magnitudes(loop.index)
                    for k in range(SEARCH_WIDTH):
                        builder.store(add_square(x, group_r[k], builder.load(group_sums[k])), group_sums[k])
    return [_least_error(builder, group_scales, group_sums) for group_scales, group_sums in zip(scales, sums)]


def _least_error(builder, scales, sums):
    """IR: the first of ``scales`` whose lane sums ``sums`` (halved to one) give the least error."""
    totals = _halved_side_by_side(builder, [builder.load(lanes) for lanes in sums])
    # Errors in x's units: the sum of squares (in units of the scale) times scale**2, in fp64.
    wide = builder.fpext(scales, _WD)
    errors = builder.fmul(builder.fpext(totals, _WD), builder.fmul(wide, wide))
    # The first least error: the least by halves, then the first lane that holds it (a
    # tree choosing errors and scales together: 87 against 69 ns a group of 32, AVX2).
    # The same choice as a scan as long as no error is NaN: magnitudes are finite,
    # quotients at most finfo.max (1 + 2**-6), scales positive.
    least = errors
    while least.type.count > 1:
        half = least.type.count // 2
        low, high = _lanes(builder, least, range(half)), _lanes(builder, least, range(half, 2 * half))
        least = builder.select(builder.fcmp_ordered("<", high, low), high, low)
    holds_it = builder.fcmp_ordered("==", errors, splat(builder, builder.extract_element(least, _i32(0)), _WD))
    mask = builder.bitcast(holds_it, ir.IntType(SEARCH_WIDTH))
    first_set = cgutils.get_or_insert_function(  # its trailing zeros; the mask is never 0
        builder.module, ir.FunctionType(mask.type, [mask.type, ir.IntType(1)]), f"llvm.cttz.i{SEARCH_WIDTH}"
    )
    return builder.extract_element(scales, builder.call(first_set, [mask, ir.Constant(ir.IntType(1), 1)]))


def _lanes(builder, first, lanes, second=None):
    """IR: the vector of lanes ``lanes`` of ``first`` and ``second`` side by side (the
    second's numbered from ``first``'s lane count on)."""
    second = ir.Constant(first.type, ir.Undefined) if second is None else second
    return builder.shuffle_vector(first, second, ir.Constant(ir.VectorType(_I32, len(lanes)), list(lanes)))


def _halved_side_by_side(builder, vectors):
    """IR: the vector whose lane ``k`` is :func:`.vectors.halve` of ``vectors[k]`` (lane
    ``j`` += lane ``j + w`` for w = LANES/2, ..., 1), by the very same additions, done for
    all of them at once: at each step a pair of vectors, each holding its candidates'
    partial lanes side by side, is packed into one with half as many lanes per candidate."""
    width = LANES  # partial lanes per candidate
    while width > 1:
        w = width // 2
        pairs = list(zip(vectors[0::2], vectors[1::2])) or [(vectors[0], None)]
        packed = []
        for first, second in pairs:
            sources = 1 if second is None else 2
            low = [v * LANES + s + j for v in range(sources) for s in range(0, LANES, width) for j in range(w)]
            high = [lane + w for lane in low]
            packed.append(builder.fadd(_lanes(builder, first, low, second), _lanes(builder, first, high, second)))
        vectors, width = packed, w
    return vectors[0]


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
def _encode_full_quad(typingctx, xs, codes, xs2, codes2, xs3, codes3, xs4, codes4, divisors, mask, p):
    """Four groups of the same multiple of 16 elements, each under its searched scale, in
    the same loops (:func:`.vectors.emit_encode_quad`): (their scales, non-finite inputs)."""
    same_sources = xs2 == xs and xs3 == xs and xs4 == xs
    same_targets = codes2 == codes and codes3 == codes and codes4 == codes
    if not (is_source(xs) and isinstance(codes, types.Array) and same_sources and same_targets):
        return None

    def codegen(context, builder, signature, args):
        divisors = context.make_array(signature.args[8])(context, builder, args[8]).data
        mask, params = args[9], args[10]

        def choose(amaxes, chunks, magnitude_loaders):
            return _emit_best_scales(builder, chunks, magnitude_loaders, amaxes, divisors, mask, params)

        return emit_encode_quad(context, builder, signature, args, choose)

    return ENCODED_QUAD(xs, codes, xs2, codes2, xs3, codes3, xs4, codes4, divisors, mask, p), codegen


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_groups_search(x, codes, scales, group, group_start, group_stop, tag, mask, divisors):
    """:func:`quantize_groups` with each group's scale chosen by :func:`_best_scale`
    among the SEARCH_WIDTH ``divisors`` (see :func:`pad_candidates`)."""
    p = _encode_params(tag)
    n = x.size
    inf = np.float32(np.inf)
    # As long as the longest group present (a block size may pass the tensor's size).
    magnitudes = np.zeros(-(-min(group, n) // LANES) * LANES, dtype=np.float32)
    bad = 0
    g = group_start
    while g < group_stop:
        start = g * group
        stop = min(start + group, n)
        xs = x[start:stop]
        if xs.size % LANES == 0 and g + 3 < group_stop and stop + 3 * group <= n:  # four whole groups
            a, b, c = stop + group, stop + 2 * group, stop + 3 * group
            quad = _encode_full_quad(
                xs, codes[start:stop], x[stop:a], codes[stop:a], x[a:b], codes[a:b], x[b:c], codes[b:c], divisors, mask, p
            )
            scales[g], scales[g + 1], scales[g + 2], scales[g + 3], count = quad
            bad += count
            g += 4
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
        if xs.size < magnitudes.size:  # a short group: zeros add nothing to a sum
            magnitudes[xs.size :] = 0
        scale = _best_scale(magnitudes, _bits_to_f32(np.int64(_span_key(xs))), divisors, mask, p)
        scales[g] = scale
        bad += _quantize_span(xs, codes[start:stop], scale, p)
        g += 1
    return bad
