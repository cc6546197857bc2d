"""The encode's cast by way of IEEE half, for x86 CPUs with F16C, FMA and AVX-512 (BW) or
AVX2: the same codes as :func:`fp8ray.codec.kernels.bits.emit_fp8_code`, in about half
the vector operations, 32 elements at a time.

An fp8 format is IEEE half with a shorter mantissa and, for e4m3fn, a smaller exponent
bias: under the scale ``s * 2**(15 - bias)`` the quotient's fp16 exponent field *is* the
fp8 code's, subnormals included, so the code is the quotient's fp16 bits rounded to the
fp8 mantissa by integer arithmetic on 16-bit lanes (32 to a vector, against 16 fp32).
Two roundings in a row (fp32 to fp16, then to fp8) could differ from the one the
reference makes; rounding to fp16 *to odd* (towards zero, the last bit set where that
was inexact) cannot, as fp16 keeps at least two more bits than any fp8 format at every
magnitude (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved
algorithms using rounding to odd", 2008). The quotient is taken of |x| (the sign comes
from x's bits), so towards zero is down; whether that was inexact comes from a second
conversion, rounded up (the two differ exactly where the value is not a half): one
instruction each.

The quotient is ``RN(|x| / s')`` by Markstein's correction, three vector operations
against a division that alone took 0.2 ns an element: ``q0 = |x| * y`` with ``y = RN(1 /
s')``, the remainder ``r = |x| - s' * q0`` by an FMA, then ``q0 + r * y`` by another.
``q0`` can be 1.25 ulp off and ``r`` then rounded, so Markstein's theorem does not cover
it, but only a quotient next to a rounding midpoint could come out wrong, and
``scripts/check_quotients.c`` finds none: every divisor significand against every
dividend whose quotient lies within 512 * 2**-24 ulp of a midpoint, 3e9 pairs. That
holds while nothing underflows or overflows: for scales ``s'`` in [2**-64, 2**64] and
every ``|x|`` whose quotient can round to a nonzero code (smaller ones give a quotient
far below the smallest subnormal, and code 0, either way; a quotient past fp32's range
becomes NaN, then max, as the division's inf would). Pairs of chunks whose scales lie
outside take the division (:func:`fp8ray.codec.kernels.vectors.emit_cast`).
``tests/codec/test_halfcast.py`` checks every bf16 and fp16 value under scales across
that range and just outside it, and every fp32 significand under a few.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils

from .bits import _F32, _FEATURES, _I32, _NATIVE_HALF, emit_f16_bits_to_f32, splat

WIDE = all(f"+{name}" in _FEATURES for name in ("avx512f", "avx512bw"))  # 32 16-bit lanes a register
# On AVX2 a vector here is two registers and each conversion two 256-bit ones. There the
# reordering of a pair's scales, where they differ per element (a scale per column), cost
# more than the division it saves (0.66 against 0.54 ns an element on one thread,
# scripts/plain_kernels.py), so only a pair under one scale takes this route (0.46
# against 0.54): see ``half_route`` in :func:`fp8ray.codec.kernels.vectors.emit_cast`.
HALF_CAST = _NATIVE_HALF and "+fma" in _FEATURES and (WIDE or "+avx2" in _FEATURES)
PAIR = 32  # elements a step: two chunks of 16 fp32 lanes, one vector of 32 16-bit lanes
SCALE_RANGE = (2.0**-64, 2.0**64)  # the scales s' under which the quotient is exact
_I16 = ir.IntType(16)
_W = ir.VectorType(_I16, PAIR)
_HALF_W = ir.VectorType(_I16, PAIR // 2)
_VF = ir.VectorType(_F32, PAIR // 2)
_VI = ir.VectorType(_I32, PAIR // 2)
_ROUND_DOWN, _ROUND_UP = 1, 2  # vcvtps2ph's rounding immediates


def _words(value: int, count: int = PAIR) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I16, count), [value & 0xFFFF] * count)


def _indices(order) -> ir.Constant:
    order = list(order)
    return ir.Constant(ir.VectorType(_I32, len(order)), order)


class PairLoad:
    """Elements 32p to 32p + 31 of a source, as the cast needs them: ``magnitudes``, two
    fp32 vectors of |x|, whose lanes hold the elements ``orders[0]`` and ``orders[1]``;
    ``signs``, 32 words whose top bit is element j's sign; ``nonfinite`` and ``nan()``,
    32-lane masks."""

    def __init__(self, magnitudes, orders, signs, nonfinite, nan):
        self.magnitudes, self.orders, self.signs, self.nonfinite, self.nan = magnitudes, orders, signs, nonfinite, nan


# A bf16 pair widens by interleaving its words with zeros (one instruction a vector), which
# takes the elements of each 128-bit lane's low and high halves: the fp16 words are put
# back in order by one permutation of 64-bit pieces.
_BF16_ORDERS = tuple(tuple(8 * lane + k + half for lane in range(4) for k in range(4)) for half in (0, 4))
_IN_ORDER = (tuple(range(16)), tuple(range(16, 32)))


def pair_loader(context, builder, array_type, array):
    """``load(p)``: the :class:`PairLoad` of pair ``p`` of a bf16, fp16 or fp32 source."""
    data = context.make_array(array_type)(context, builder, array).data
    if array_type.dtype == types.float32:
        ptr = builder.bitcast(data, _VI.as_pointer())
        abs_mask = ir.Constant(_VI, [0x7FFFFFFF] * 16)
        inf = ir.Constant(_VI, [0x7F800000] * 16)

        def load_f32(p):
            bits = [builder.load(builder.gep(ptr, [builder.add(builder.mul(p, p.type(2)), p.type(k))]), align=4) for k in (0, 1)]
            keys = [builder.and_(b, abs_mask) for b in bits]
            halves = [builder.bitcast(b, ir.VectorType(_I16, PAIR)) for b in bits]
            signs = builder.shuffle_vector(*halves, _indices(range(1, 2 * PAIR, 2)))  # each element's top half

            def both(compare):
                return builder.shuffle_vector(*[compare(k, inf) for k in keys], _indices(range(PAIR)))

            return PairLoad(
                [builder.bitcast(k, _VF) for k in keys],
                _IN_ORDER,
                signs,
                both(lambda k, inf: builder.icmp_unsigned(">=", k, inf)),
                lambda: both(lambda k, inf: builder.icmp_unsigned(">", k, inf)),
            )

        return load_f32
    ptr = builder.bitcast(data, _W.as_pointer())
    inf = _words(0x7F80 if array_type.dtype == types.uint16 else 0x7C00)  # bf16's or fp16's

    def load_16(p):
        raw = builder.load(builder.gep(ptr, [p]), align=2)
        keys = builder.and_(raw, _words(0x7FFF))
        if array_type.dtype == types.uint16:  # bfloat16: fp32's top half
            orders = _BF16_ORDERS
            zeros = ir.Constant(_W, None)
            interleaved = [builder.shuffle_vector(keys, zeros, _indices(j for e in o for j in (PAIR + e, e))) for o in orders]
            magnitudes = [builder.bitcast(v, _VF) for v in interleaved]
        else:
            orders = _IN_ORDER
            magnitudes = [emit_f16_bits_to_f32(builder, builder.shuffle_vector(keys, keys, _indices(o))) for o in orders]
        return PairLoad(
            magnitudes,
            orders,
            raw,
            builder.icmp_unsigned(">=", keys, inf),
            lambda: builder.icmp_unsigned(">", keys, inf),
        )

    return load_16


def _directed_half(builder, v, rounding):
    """fp32 lanes to fp16 bits rounded down or up (x86 vcvtps2ph with its immediate: one
    512-bit conversion, or two 256-bit ones on AVX2)."""
    if WIDE:
        signature = ir.FunctionType(_HALF_W, [_VF, _I32, _HALF_W, _I16])
        convert = cgutils.get_or_insert_function(builder.module, signature, "llvm.x86.avx512.mask.vcvtps2ph.512")
        return builder.call(convert, [v, _I32(rounding), ir.Constant(_HALF_W, None), _I16(0xFFFF)])
    quarter = PAIR // 4
    signature = ir.FunctionType(ir.VectorType(_I16, quarter), [ir.VectorType(_F32, quarter), _I32])
    convert = cgutils.get_or_insert_function(builder.module, signature, "llvm.x86.vcvtps2ph.256")
    halves = [
        builder.call(convert, [builder.shuffle_vector(v, v, _indices(range(k, k + quarter))), _I32(rounding)])
        for k in (0, quarter)
    ]
    return builder.shuffle_vector(*halves, _indices(range(PAIR // 2)))


def _fma(builder, a, b, c):
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
    return builder.call(fma, [a, b, c])


class PairScales:
    """A pair's scales ``s'`` (each lane's scale times 2**(15 - bias)) for each of its two
    halves, their reciprocals ``RN(1 / s')``, and whether every one lies in
    :data:`SCALE_RANGE` (``inside``, i1)."""

    def __init__(self, lanes, reciprocals, inside):
        self.lanes, self.reciprocals, self.inside = lanes, reciprocals, inside


def _inside(builder, s):
    """Whether the fp32 ``s`` (a scalar or a vector: then lane by lane) lies in :data:`SCALE_RANGE`."""
    low, high = (
        ir.Constant(s.type, bound) if not isinstance(s.type, ir.VectorType) else ir.Constant(s.type, [bound] * s.type.count)
        for bound in SCALE_RANGE
    )
    return builder.and_(builder.fcmp_ordered(">=", s, low), builder.fcmp_ordered("<=", s, high))


def pair_scales(builder, chunks, orders, params):
    """The :class:`PairScales` of a pair whose two chunks have the fp32 scales and
    reciprocals ``chunks`` (``[(scales, reciprocals)] * 2``, a scale per element, in
    element order; ``orders``: its :class:`PairLoad`'s). The reciprocals are the caller's,
    computed once for all the rows that share them: two divisions a pair cost more than
    the rest of the cast."""
    factor = splat(builder, builder.extract_value(params, 9), _VF)
    (s0, y0), (s1, y1) = chunks
    lanes = [builder.fmul(builder.shuffle_vector(s0, s1, _indices(o)), factor) for o in orders]
    reciprocals = [builder.shuffle_vector(y0, y1, _indices(o)) for o in orders]
    every = builder.bitcast(builder.and_(*[_inside(builder, s) for s in lanes]), ir.IntType(16))
    return PairScales(lanes, reciprocals, builder.icmp_unsigned("==", every, _I16(0xFFFF)))


def uniform_pair_scales(builder, scale, params):
    """The :class:`PairScales` of a pair under one fp32 ``scale``: one scalar division for
    the reciprocal (LLVM kept a splat's division 16 lanes wide)."""
    s = builder.fmul(scale, builder.extract_value(params, 9))
    y = builder.fdiv(ir.Constant(_F32, 1.0), s)
    return PairScales([splat(builder, s, _VF)] * 2, [splat(builder, y, _VF)] * 2, _inside(builder, s))


def emit_pair_codes(builder, load, scales, params):
    """IR: the 32 fp8 codes (i8) of the :class:`PairLoad` ``load`` under the
    :class:`PairScales` ``scales`` (all inside the range), and the count of its non-finite inputs
    (i64). ``params``: the format's :func:`~fp8ray.codec.kernels.bits.format_params`."""
    fmax = builder.fdiv(builder.extract_value(params, 0), builder.extract_value(params, 9))  # a power of 2 apart
    fmax = splat(builder, fmax, _VF)
    halves = []
    for a, s, y in zip(load.magnitudes, scales.lanes, scales.reciprocals):
        q0 = builder.fmul(a, y)
        q = _fma(builder, _fma(builder, builder.fneg(s), q0, a), y, q0)
        q = builder.select(builder.fcmp_ordered("<", q, fmax), q, fmax)  # NaN (inf / inf, or x's) to max
        down, up = _directed_half(builder, q, _ROUND_DOWN), _directed_half(builder, q, _ROUND_UP)
        halves.append(builder.or_(down, builder.and_(builder.xor(down, up), _words(1, 16))))  # to odd: inexact sets the last bit
    position = {e: j for j, e in enumerate(load.orders[0] + load.orders[1])}
    odd_rounded = builder.shuffle_vector(*halves, _indices(position[e] for e in range(PAIR)))
    shift = builder.sub(builder.trunc(builder.extract_value(params, 1), _I16), _I16(13))  # fp16's 10 bits, not fp32's 23
    shifts = splat(builder, shift, _W)
    half_down = splat(builder, builder.sub(builder.shl(_I16(1), builder.sub(shift, _I16(1))), _I16(1)), _W)
    odd = builder.and_(builder.lshr(odd_rounded, shifts), _words(1))
    code = builder.lshr(builder.add(builder.add(odd_rounded, half_down), odd), shifts)  # to nearest even
    code = builder.or_(code, builder.and_(builder.lshr(load.signs, _words(8)), _words(0x80)))
    count = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(64), 0))
    slot = cgutils.alloca_once_value(builder, code)
    mask = builder.bitcast(load.nonfinite, _I32)
    with builder.if_then(builder.icmp_unsigned("!=", mask, _I32(0)), likely=False):
        nan_code, posinf_code, neginf_code = (
            splat(builder, builder.trunc(builder.extract_value(params, k), _I16), _W) for k in (5, 6, 7)
        )
        negative = builder.icmp_signed("<", load.signs, _words(0))
        special = builder.select(load.nan(), nan_code, builder.select(negative, neginf_code, posinf_code))
        builder.store(builder.select(load.nonfinite, special, code), slot)
        popcount = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_I32]), "llvm.ctpop.i32")
        builder.store(builder.zext(builder.call(popcount, [mask]), ir.IntType(64)), count)
    return builder.trunc(builder.load(slot), ir.VectorType(ir.IntType(8), PAIR)), builder.load(count)
