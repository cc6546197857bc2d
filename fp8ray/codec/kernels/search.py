"""The scale search of ``scale_choice="mse"``: per group, the candidate scale with the
least squared error (as :func:`fp8ray.codec.reference.choose_scales` defines it), then
the group's codes under it.

The search is one LLVM intrinsic over explicit 16-lane vectors: numba's loops over the
candidates and the lanes did not vectorise (a loop over an array of sums is a chain of
loads and stores, and the definition's order of additions may not be changed by the
compiler). Per 16 elements and candidate it costs nine vector operations: a product by
the candidate's reciprocal, the rounding to the fp8 grid by adding and subtracting a
power of two (three integer operations find it), the difference, its square and the
lane's sum. On CPUs with 8-lane vectors LLVM splits each in two.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..formats import SMALLEST_NORMAL_SCALE
from .bits import _F32, _I32, _bits_to_f32, _encode_params, _i32, _load, code_fields, emit_f16_bits_to_f32, emit_fp8_code
from .encode import _quantize_span, _span_key

SEARCH_WIDTH = 8  # candidates per search: e4m3fn's 8; fewer are padded (see pad_candidates)
LANES = 16  # partial sums per candidate (the reference's lane count)
_VF = ir.VectorType(_F32, LANES)
_VI = ir.VectorType(_I32, LANES)
_WF = ir.VectorType(_F32, SEARCH_WIDTH)
_WI = ir.VectorType(_I32, SEARCH_WIDTH)
_WD = ir.VectorType(ir.DoubleType(), SEARCH_WIDTH)
_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000


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
        raise ValueError(f"the scale search takes 1 to {SEARCH_WIDTH} divisors in (0, {fmax}], got {divisors}")
    return np.array(divisors + divisors[-1:] * (SEARCH_WIDTH - len(divisors)), dtype=np.float32)


def _splat(builder, value, vector_type):
    undef = ir.Constant(vector_type, ir.Undefined)
    one = builder.insert_element(undef, value, _i32(0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count))


def _halve_to_first(builder, v, count):
    """v[0] after ``v[j] += v[j + w]`` for w = count/2, ..., 1: the reference's tree."""
    undef = ir.Constant(v.type, ir.Undefined)
    w = count // 2
    while w:
        v = builder.fadd(v, builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, count), [(j + w) % count for j in range(count)])))
        w //= 2
    return builder.extract_element(v, _i32(0))


def _vi(value):
    return ir.Constant(_VI, [value & 0xFFFFFFFF] * LANES)


def _emit_best_scale(builder, chunks, load_magnitudes, amax, divisors_ptr, mask, params):
    """IR: the first of the scales ``amax / divisors[k]`` with the least search error over
    the group whose 16-element chunk ``i`` has the magnitudes ``load_magnitudes(i)``
    (|x|, non-finite as 0; zero past the group's end)."""
    # The candidate scales, as scale_from_amax computes each, and their reciprocals.
    amaxes = _splat(builder, amax, _WF)
    scales = builder.fdiv(amaxes, builder.load(builder.bitcast(divisors_ptr, _WF.as_pointer()), align=4))
    smallest = ir.Constant(_WF, [SMALLEST_NORMAL_SCALE] * SEARCH_WIDTH)
    scales = builder.select(builder.fcmp_ordered("<", scales, smallest), smallest, scales)
    zero_group = builder.fcmp_ordered("==", amaxes, ir.Constant(_WF, [0.0] * SEARCH_WIDTH))
    scales = builder.select(zero_group, ir.Constant(_WF, [1.0] * SEARCH_WIDTH), scales)
    scales = builder.bitcast(builder.and_(builder.bitcast(scales, _WI), _splat(builder, builder.trunc(mask, _I32), _WI)), _WF)
    reciprocals = builder.fdiv(ir.Constant(_WF, [1.0] * SEARCH_WIDTH), scales)

    exponent_to_magic = _splat(builder, builder.shl(builder.trunc(builder.extract_value(params, 1), _I32), _i32(23)), _VI)
    subnormal_magic = _splat(builder, builder.trunc(builder.extract_value(params, 4), _I32), _VI)
    r = [_splat(builder, builder.extract_element(reciprocals, _i32(k)), _VF) for k in range(SEARCH_WIDTH)]
    # Sums start at -0.0, which LLVM may drop from the first addition (+0.0 it may not,
    # as -0.0 + +0.0 is +0.0); the terms are squares, so the sums are the same.
    sums = [cgutils.alloca_once_value(builder, ir.Constant(_VF, [-0.0] * LANES)) for _ in range(SEARCH_WIDTH)]
    with cgutils.for_range(builder, chunks) as loop:
        x = load_magnitudes(loop.index)
        for k in range(SEARCH_WIDTH):
            q = builder.fmul(x, r[k])  # no clamp needed: see pad_candidates
            # q rounded to the fp8 grid: q + m - m, m the power of two whose fp32 ulp is
            # the grid's spacing at q (2**shift times q's binade; the subnormal magic below it).
            m = builder.add(builder.and_(builder.bitcast(q, _VI), _vi(_INF_BITS)), exponent_to_magic)
            m = builder.bitcast(builder.select(builder.icmp_signed(">", m, subnormal_magic), m, subnormal_magic), _VF)
            d = builder.fsub(builder.fsub(builder.fadd(q, m), m), q)
            builder.store(builder.fadd(builder.load(sums[k]), builder.fmul(d, d)), sums[k])
    totals = ir.Constant(_WF, ir.Undefined)
    for k in range(SEARCH_WIDTH):
        totals = builder.insert_element(totals, _halve_to_first(builder, builder.load(sums[k]), LANES), _i32(k))
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
        data = builder.bitcast(mag_array.data, _VF.as_pointer())
        chunks = builder.udiv(builder.extract_value(mag_array.shape, 0), ir.Constant(ir.IntType(64), LANES))
        load = lambda i: builder.load(builder.gep(data, [i]), align=4)  # noqa: E731
        return _emit_best_scale(builder, chunks, load, amax, div_array.data, mask, params)

    return types.float32(magnitudes, amax, divisors, mask, p), codegen


def _chunk_loader(context, builder, array_type, array):
    """``load(i)``: chunk ``i`` (16 elements) of a bf16, fp16 or fp32 source as fp32 values."""
    data = context.make_array(array_type)(context, builder, array).data
    if array_type.dtype == types.float32:
        ptr = builder.bitcast(data, _VF.as_pointer())
        return lambda i: builder.load(builder.gep(ptr, [i]), align=4)
    ptr = builder.bitcast(data, ir.VectorType(ir.IntType(16), LANES).as_pointer())
    if array_type.dtype == types.uint16:  # bfloat16: fp32's top half
        return lambda i: builder.bitcast(builder.shl(builder.zext(builder.load(builder.gep(ptr, [i]), align=2), _VI), _vi(16)), _VF)
    return lambda i: emit_f16_bits_to_f32(builder, builder.load(builder.gep(ptr, [i]), align=2))


_SOURCE_DTYPES = (types.float32, types.uint16, types.int16)


@intrinsic
def _encode_full_group(typingctx, xs, codes, divisors, mask, p):
    """A whole group of a multiple of 16 elements in vectors: its amax, the searched scale
    and its codes (``x / scale``, as :func:`fp8ray.codec.kernels.bits._fp8_code`).
    Returns (scale, count of non-finite inputs)."""
    if not (isinstance(xs, types.Array) and xs.dtype in _SOURCE_DTYPES and isinstance(codes, types.Array)):
        return None
    result = types.Tuple((types.float32, types.int64))

    def codegen(context, builder, signature, args):
        xsv, codesv, divs, mask, params = args
        load = _chunk_loader(context, builder, signature.args[0], xsv)
        codes_array = context.make_array(signature.args[1])(context, builder, codesv)
        codes_ptr = builder.bitcast(codes_array.data, ir.VectorType(ir.IntType(8), LANES).as_pointer())
        div_array = context.make_array(signature.args[2])(context, builder, divs)
        n = builder.extract_value(context.make_array(signature.args[0])(context, builder, xsv).shape, 0)
        chunks = builder.udiv(n, ir.Constant(ir.IntType(64), LANES))

        def finite_keys(i):  # |x|'s bits, 0 where x is not finite
            keys = builder.and_(builder.bitcast(load(i), _VI), _vi(_ABS_MASK))
            return builder.select(builder.icmp_signed("<", keys, _vi(_INF_BITS)), keys, _vi(0))

        largest = cgutils.alloca_once_value(builder, _vi(0))
        with cgutils.for_range(builder, chunks) as loop:
            keys, most = finite_keys(loop.index), builder.load(largest)
            builder.store(builder.select(builder.icmp_signed(">", keys, most), keys, most), largest)
        most = builder.load(largest)
        undef = ir.Constant(_VI, ir.Undefined)
        w = LANES // 2
        while w:
            other = builder.shuffle_vector(most, undef, ir.Constant(_VI, [(j + w) % LANES for j in range(LANES)]))
            most = builder.select(builder.icmp_signed(">", other, most), other, most)
            w //= 2
        amax = builder.bitcast(builder.extract_element(most, _i32(0)), _F32)

        scale = _emit_best_scale(builder, chunks, lambda i: builder.bitcast(finite_keys(i), _VF), amax, div_array.data, mask, params)

        scales = _splat(builder, scale, _VF)
        fmax = _splat(builder, builder.extract_value(params, 0), _VF)
        neg_fmax = builder.fneg(fmax)
        fields = [_splat(builder, f, _VI) for f in code_fields(builder, params)]
        nonfinite = cgutils.alloca_once_value(builder, _vi(0))
        with cgutils.for_range(builder, chunks) as loop:
            x = load(loop.index)
            q = builder.fdiv(x, scales)
            q = builder.select(builder.fcmp_ordered(">", q, fmax), fmax, q)
            q = builder.select(builder.fcmp_ordered("<", q, neg_fmax), neg_fmax, q)
            code = emit_fp8_code(builder, q, x, fields)
            builder.store(builder.trunc(code, ir.VectorType(ir.IntType(8), LANES)), builder.gep(codes_ptr, [loop.index]), align=1)
            bad = builder.icmp_unsigned(">=", builder.and_(builder.bitcast(x, _VI), _vi(_ABS_MASK)), _vi(_INF_BITS))
            builder.store(builder.add(builder.load(nonfinite), builder.zext(bad, _VI)), nonfinite)
        count = builder.load(nonfinite)
        w = LANES // 2
        while w:
            count = builder.add(count, builder.shuffle_vector(count, undef, ir.Constant(_VI, [(j + w) % LANES for j in range(LANES)])))
            w //= 2
        total = builder.zext(builder.extract_element(count, _i32(0)), ir.IntType(64))
        return context.make_tuple(builder, result, [scale, total])

    return result(xs, codes, divisors, mask, p), codegen


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_groups_search(x, codes, scales, group, group_start, group_stop, tag, mask, divisors):
    """:func:`quantize_groups` with each group's scale chosen by :func:`_best_scale`
    among the SEARCH_WIDTH ``divisors`` (see :func:`pad_candidates`)."""
    p = _encode_params(tag)
    n = x.size
    inf = np.float32(np.inf)
    magnitudes = np.zeros(-(-group // LANES) * LANES, dtype=np.float32)
    bad = 0
    for g in range(group_start, group_stop):
        start = g * group
        stop = min(start + group, n)
        xs = x[start:stop]
        if xs.size % LANES == 0:
            scale, count = _encode_full_group(xs, codes[start:stop], divisors, mask, p)
            scales[g] = scale
            bad += count
            continue
        for i in range(xs.size):
            v = abs(_load(xs, i))
            magnitudes[i] = v if v < inf else np.float32(0.0)
        if xs.size < group:  # the last, short group: zeros add nothing to a sum
            magnitudes[xs.size :] = 0
        scale = _best_scale(magnitudes, _bits_to_f32(np.int64(_span_key(xs))), divisors, mask, p)
        scales[g] = scale
        bad += _quantize_span(xs, codes[start:stop], scale, p)
    return bad
