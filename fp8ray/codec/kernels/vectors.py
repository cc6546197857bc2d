"""Whole groups in explicit 16-lane vectors: numba's own loops run a group of 32
elements in their scalar remainder (LLVM unrolls its 16-lane loops 4 times), so block
scaling's groups are encoded here in LLVM IR, one chunk of 16 elements at a time: the
finite amax, the scale (amax's, or the search's, :mod:`.search`), and the codes
(``x / scale``, as :func:`fp8ray.codec.kernels.bits._fp8_code`). On CPUs with 8-lane
vectors LLVM splits each vector in two. Channel scaling's rows (a scale per column) and
the decode of groups and rows go through the same 16-lane chunks: LLVM gave numba's
loops over them 8 lanes or their scalar remainder (channel: encode 4.8 to 3.3 ms, decode
3.6 to 2.6 ms for 11.8M bf16 elements on one thread, BENCHMARKS.md).

Consecutive groups go four at a time through the same loops: a group of 32 is mostly one
chain of dependent steps (amax, its reduction, the scale, the quotients, the rounding),
and the CPU overlaps independent chains. Measured on one thread, plain block 32 went
from 29 to 17 ns per group two at a time, and to 15 four at a time; the search, whose
chain is longer (two divisions, the sums' reduction, the choice), from 86 to 71 two at a
time and 51 to 46-48 four at a time (BENCHMARKS.md), the same bits (four groups' sums
still fit the registers).
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..formats import SMALLEST_NORMAL_SCALE
from .bits import (
    _F32,
    _I32,
    _NATIVE_HALF,
    CRC_IN_KERNELS,
    NATIVE_BF16,
    PREFETCH_AHEAD,
    _format_of_tag,
    _i32,
    bf16_narrowing_floor,
    code_fields,
    decode_params,
    emit_crc32c,
    emit_f16_bits_to_f32,
    emit_f32_to_bf16,
    emit_f32_to_bf16_native,
    emit_f32_to_f16,
    emit_fp8_code,
    emit_fp8_to_f32,
    emit_fp8_to_f32_by_half,
    emit_prefetch,
    splat,
)
from .halfcast import HALF_CAST, PAIR, WIDE, emit_pair_codes, pair_loader, pair_scales, uniform_pair_scales

LANES = 16  # elements per vector
VF = ir.VectorType(_F32, LANES)
VI = ir.VectorType(_I32, LANES)
_ABS_MASK = 0x7FFFFFFF
INF_BITS = 0x7F800000
SOURCE_DTYPES = (types.float32, types.uint16, types.int16)  # fp32, bfloat16 bits, float16 bits


def vi(value):
    """An i32 constant in every lane."""
    return ir.Constant(VI, [value & 0xFFFFFFFF] * LANES)


def halve(builder, v, combine):
    """Lane 0 after ``v[j] = combine(v[j], v[j + w])`` for w = count/2, ..., 1."""
    count = v.type.count
    undef = ir.Constant(v.type, ir.Undefined)
    w = count // 2
    while w:
        v = combine(
            v, builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, count), [(j + w) % count for j in range(count)]))
        )
        w //= 2
    return builder.extract_element(v, _i32(0))


def candidate_scales(builder, amax, divisors, mask):
    """The scales ``amax / divisors`` (a vector) as scale_from_amax computes each: at least
    2**-126, 1 for amax 0, truncated by ``mask`` (i64) to the scale dtype."""
    width = divisors.type.count
    amaxes = splat(builder, amax, divisors.type)
    scales = builder.fdiv(amaxes, divisors)
    smallest = ir.Constant(divisors.type, [SMALLEST_NORMAL_SCALE] * width)
    scales = builder.select(builder.fcmp_ordered("<", scales, smallest), smallest, scales)
    zero_group = builder.fcmp_ordered("==", amaxes, ir.Constant(divisors.type, [0.0] * width))
    scales = builder.select(zero_group, ir.Constant(divisors.type, [1.0] * width), scales)
    int_type = ir.VectorType(_I32, width)
    return builder.bitcast(
        builder.and_(builder.bitcast(scales, int_type), splat(builder, builder.trunc(mask, _I32), int_type)), divisors.type
    )


def _chunk_loader(context, builder, array_type, array):
    """``load(i)``: chunk ``i`` (16 elements) of a bf16, fp16 or fp32 source as fp32 values."""
    data = context.make_array(array_type)(context, builder, array).data
    if array_type.dtype == types.float32:
        ptr = builder.bitcast(data, VF.as_pointer())
        return lambda i: builder.load(builder.gep(ptr, [i]), align=4)
    ptr = builder.bitcast(data, ir.VectorType(ir.IntType(16), LANES).as_pointer())
    if array_type.dtype == types.uint16:  # bfloat16: fp32's top half
        return lambda i: builder.bitcast(builder.shl(builder.zext(builder.load(builder.gep(ptr, [i]), align=2), VI), vi(16)), VF)
    return lambda i: emit_f16_bits_to_f32(builder, builder.load(builder.gep(ptr, [i]), align=2))


class _Source:
    """A bf16, fp16 or fp32 source array as the cast reads it: ``chunk(i)``, 16 elements
    as fp32 (:func:`_chunk_loader`); for the half route, ``pair(p)``
    (:func:`.halfcast.pair_loader`) and ``prefetch_ahead(e)``, which asks for the data
    :data:`~.bits.PREFETCH_AHEAD` bytes past element ``e`` (:func:`~.bits.emit_prefetch`)."""

    def __init__(self, context, builder, array_type, array):
        self.builder = builder
        self.chunk = _chunk_loader(context, builder, array_type, array)
        self.pair = pair_loader(context, builder, array_type, array)
        self.bytes = builder.bitcast(context.make_array(array_type)(context, builder, array).data, ir.IntType(8).as_pointer())
        self.itemsize = context.get_abi_sizeof(context.get_data_type(array_type.dtype))

    def prefetch_ahead(self, element):
        offset = self.builder.add(self.builder.mul(element, element.type(self.itemsize)), element.type(PREFETCH_AHEAD))
        emit_prefetch(self.builder, self.builder.gep(self.bytes, [offset]))


def _key_loader(context, builder, array_type, array):
    """``(keys, inf, value)``: ``keys(i)``, the bits of |x| of chunk ``i`` in the source's
    own width (ordered like |x|, at least ``inf`` where x is not finite), and ``value(k)``,
    the fp32 |x| of a key. A bf16 or fp16 source's keys skip the widening to fp32."""
    if array_type.dtype == types.float32:
        load = _chunk_loader(context, builder, array_type, array)
        return (
            (lambda i: builder.and_(builder.bitcast(load(i), VI), vi(_ABS_MASK))),
            _i32(INF_BITS),
            (lambda k: builder.bitcast(k, _F32)),
        )
    i16 = ir.IntType(16)
    data = context.make_array(array_type)(context, builder, array).data
    ptr = builder.bitcast(data, ir.VectorType(i16, LANES).as_pointer())

    def keys(i):
        return builder.and_(
            builder.load(builder.gep(ptr, [i]), align=2), ir.Constant(ir.VectorType(i16, LANES), [0x7FFF] * LANES)
        )

    if array_type.dtype == types.uint16:  # bfloat16: fp32's top half
        return keys, ir.Constant(i16, 0x7F80), lambda k: builder.bitcast(builder.shl(builder.zext(k, _I32), _i32(16)), _F32)
    return keys, ir.Constant(i16, 0x7C00), lambda k: emit_f16_bits_to_f32(builder, k)


def _chunk_storer(context, builder, array_type, array, nans_canonical=False):
    """``store(i, v, native)``: fp32 values ``v`` into chunk ``i`` (16 elements) of a bf16,
    fp16 or fp32 output, rounded to its dtype (``nans_canonical``: as
    :func:`emit_f32_to_bf16`; ``native``: a bf16 output narrowed by
    :func:`emit_f32_to_bf16_native`, for values none of which is an fp32 subnormal)."""
    data = context.make_array(array_type)(context, builder, array).data
    if array_type.dtype == types.float32:
        ptr = builder.bitcast(data, VF.as_pointer())
        return lambda i, v, native=False: builder.store(v, builder.gep(ptr, [i]), align=4)
    ptr = builder.bitcast(data, ir.VectorType(ir.IntType(16), LANES).as_pointer())
    if array_type.dtype == types.uint16:

        def store_bf16(i, v, native=False):
            bits = emit_f32_to_bf16_native(builder, v) if native else emit_f32_to_bf16(builder, v, nans_canonical)
            builder.store(bits, builder.gep(ptr, [i]), align=2)

        return store_bf16
    return lambda i, v, native=False: builder.store(emit_f32_to_f16(builder, v), builder.gep(ptr, [i]), align=2)


class _EveryChunk:
    """``scales(i)`` of one fp32 ``scale`` (scalar IR) for every chunk, in every lane."""

    def __init__(self, builder, scale):
        self.scale, self.lanes = scale, splat(builder, scale, VF)

    def __call__(self, i):
        return self.lanes


def _scale_loader(context, builder, scale_type, scale):
    """``scales(i)``: the scales of chunk ``i``: one fp32 ``scale`` in every lane, or chunk
    ``i`` of an fp32 array of them (a scale per element: per column, for a row)."""
    if scale_type == types.float32:
        return _EveryChunk(builder, scale)
    ptr = builder.bitcast(context.make_array(scale_type)(context, builder, scale).data, VF.as_pointer())
    return lambda i: builder.load(builder.gep(ptr, [i]), align=4)


class _PerElement:
    """``scales(i)``: chunk ``i`` of an fp32 array of scales, one per element (per column,
    for a row); ``reciprocals(i)``: that of an array of their reciprocals (the half
    route's, :func:`.halfcast.pair_scales`). Both by :func:`_scale_loader`."""

    def __init__(self, context, builder, signature, args):
        self.scales, self.reciprocals = (_scale_loader(context, builder, t, a) for t, a in zip(signature, args))

    def __call__(self, i):
        return self.scales(i)


def _codes_pointer(context, builder, array_type, array):
    """The data of a uint8 codes array as a pointer to 16-code chunks."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(data, ir.VectorType(ir.IntType(8), LANES).as_pointer())


def _chunk_count(context, builder, array_type, array):
    """How many whole 16-element chunks the array holds (i64)."""
    n = builder.extract_value(context.make_array(array_type)(context, builder, array).shape, 0)
    return builder.udiv(n, ir.Constant(ir.IntType(64), LANES))


ENCODED = types.Tuple((types.float32, types.int64))  # (the group's scale, its non-finite inputs)
# Four groups side by side: (their four scales, their non-finite inputs).
ENCODED_QUAD = types.Tuple((types.float32,) * 4 + (types.int64,))


def emit_encode_group(context, builder, signature, args, choose_scales):
    """IR encoding the group ``args[0]`` (a multiple of 16 elements) into the codes
    ``args[1]``: ``choose_scales(amaxes, chunks, magnitude_loaders)`` gives the scale (fp32
    scalar IR) of each group, whose 16-element chunk ``i`` has the magnitudes
    ``magnitude_loaders[k](i)``; ``args[-1]`` is the format's
    :func:`~fp8ray.codec.kernels.bits.format_params`. Returns :data:`ENCODED`."""
    (scale,), count = emit_encode_groups(context, builder, signature, args, 1, choose_scales)
    return context.make_tuple(builder, ENCODED, [scale, count])


def emit_encode_quad(context, builder, signature, args, choose_scales):
    """:func:`emit_encode_group` for four groups of the same size (``args[2k]`` into
    ``args[2k + 1]``), in the same loops (why: the module's docstring). Returns
    :data:`ENCODED_QUAD`."""
    scales, count = emit_encode_groups(context, builder, signature, args, 4, choose_scales)
    return context.make_tuple(builder, ENCODED_QUAD, [*scales, count])


def _larger(builder, a, b):
    return builder.select(builder.icmp_signed(">", a, b), a, b)


def emit_finite_amaxes(builder, key_loaders, chunks):
    """IR: the largest finite |x| (fp32 scalar IR, 0 if none) of each source's first
    ``chunks`` chunks, ``key_loaders[k]`` its :func:`_key_loader` (the same source type
    for every one).

    The largest key of all, non-finite or not, in the source's width (bf16, fp16: no
    widening); only where one is not finite, again without those (the filter cost two
    vector operations a chunk: 2-4% of the encode; the 16-bit keys 4-8% more)."""
    _, inf, value = key_loaders[0]
    zeros = ir.Constant(ir.VectorType(inf.type, LANES), [0] * LANES)
    largest = [cgutils.alloca_once_value(builder, zeros) for _ in key_loaders]
    with cgutils.for_range(builder, chunks) as loop:
        for (keys, _, _), slot in zip(key_loaders, largest):
            builder.store(_larger(builder, keys(loop.index), builder.load(slot)), slot)
    larger = functools.partial(_larger, builder)
    top = [cgutils.alloca_once_value(builder, halve(builder, builder.load(slot), larger)) for slot in largest]
    any_nonfinite = functools.reduce(builder.or_, [builder.icmp_signed(">=", builder.load(t), inf) for t in top])
    with cgutils.if_unlikely(builder, any_nonfinite):
        for slot in largest:
            builder.store(zeros, slot)
        with cgutils.for_range(builder, chunks) as loop:
            for (keys, _, _), slot in zip(key_loaders, largest):
                k = keys(loop.index)
                k = builder.select(builder.icmp_signed("<", k, splat(builder, inf, k.type)), k, zeros)
                builder.store(larger(k, builder.load(slot)), slot)
        for slot, t in zip(largest, top):
            builder.store(halve(builder, builder.load(slot), larger), t)
    return [value(builder.load(t)) for t in top]


@intrinsic
def finite_amax_chunks(typingctx, xs):
    """The largest finite |x| (fp32, 0 if none) of the whole 16-element chunks of ``xs``
    (:func:`emit_finite_amaxes`); the elements past the last whole chunk are the caller's."""
    if not is_source(xs):
        return None

    def codegen(context, builder, signature, args):
        chunks = _chunk_count(context, builder, signature.args[0], args[0])
        (amax,) = emit_finite_amaxes(builder, [_key_loader(context, builder, signature.args[0], args[0])], chunks)
        return amax

    return types.float32(xs), codegen


@intrinsic
def column_key_max(typingctx, row, keys):
    """Into ``keys`` (an array of the row's dtype, holding the bits of |x|), the larger of
    each and the finite |x| of the row's element in that column, over the row's whole
    16-element chunks: channel scaling's amax, a row at a time, on the source's own bits
    (16-bit lanes for bf16 and fp16: numba's loop on fp32 values took twice the time)."""
    if not (is_source(row) and isinstance(keys, types.Array) and keys.dtype == row.dtype):
        return None

    def codegen(context, builder, signature, args):
        chunks = _chunk_count(context, builder, signature.args[0], args[0])
        row_keys, inf, _ = _key_loader(context, builder, signature.args[0], args[0])
        key_type = ir.VectorType(inf.type, LANES)
        slots = builder.bitcast(context.make_array(signature.args[1])(context, builder, args[1]).data, key_type.as_pointer())
        zeros = ir.Constant(key_type, [0] * LANES)
        with cgutils.for_range(builder, chunks) as loop:
            k = row_keys(loop.index)
            finite = builder.select(builder.icmp_signed("<", k, splat(builder, inf, key_type)), k, zeros)
            slot = builder.gep(slots, [loop.index])
            builder.store(_larger(builder, builder.load(slot, align=2), finite), slot, align=2)
        return context.get_dummy_value()

    return types.none(row, keys), codegen


def emit_encode_groups(context, builder, signature, args, count, choose_scales):
    """IR encoding ``count`` groups of the same size (a multiple of 16 elements), group
    ``k`` from ``args[2k]`` into the codes ``args[2k + 1]``, under the scales
    ``choose_scales`` gives them. Returns (their scales, their non-finite inputs: i64)."""
    params = args[-1]
    sources = [_Source(context, builder, signature.args[2 * k], args[2 * k]) for k in range(count)]
    codes_ptrs = [_codes_pointer(context, builder, signature.args[2 * k + 1], args[2 * k + 1]) for k in range(count)]
    chunks = _chunk_count(context, builder, signature.args[0], args[0])

    def finite_keys(load, i):  # |x|'s bits, 0 where x is not finite: ordered like |x|
        keys = builder.and_(builder.bitcast(load(i), VI), vi(_ABS_MASK))
        return builder.select(builder.icmp_signed("<", keys, vi(INF_BITS)), keys, vi(0))

    if HALF_CAST:
        for source in sources:
            source.prefetch_ahead(ir.Constant(ir.IntType(64), 0))
    key_loaders = [_key_loader(context, builder, signature.args[2 * k], args[2 * k]) for k in range(count)]
    amaxes = emit_finite_amaxes(builder, key_loaders, chunks)
    magnitudes = [lambda i, source=source: builder.bitcast(finite_keys(source.chunk, i), VF) for source in sources]
    scales = choose_scales(amaxes, chunks, magnitudes)
    divisors = [_EveryChunk(builder, scale) for scale in scales]
    return scales, emit_cast(builder, chunks, sources, codes_ptrs, divisors, params)


def emit_cast(builder, chunks, sources, codes_ptrs, divisors, params):
    """IR: the codes of ``x / scale`` (clamped) for each of the :class:`_Source`
    ``sources`` under the scales ``divisors[k](i)`` of its chunk ``i`` (an
    :class:`_EveryChunk`, or a :class:`_PerElement` with their reciprocals) into
    ``codes_ptrs[k]`` (16 codes a chunk), ``chunks`` chunks each. Returns the non-finite
    inputs (i64), counted as the codes are made.

    Where the CPU has it (:data:`.halfcast.HALF_CAST`; on AVX2 only under one scale a
    chunk, see there), two chunks at a time go the way of :mod:`.halfcast` where their
    scales allow it, the others (and the last chunk of an odd count) by the division."""
    fmax = splat(builder, builder.extract_value(params, 0), VF)
    neg_fmax = builder.fneg(fmax)
    fields = [splat(builder, f, VI) for f in code_fields(builder, params)]
    nonfinite = cgutils.alloca_once_value(builder, vi(0))

    def cast_chunk(load, codes_ptr, divisor, i):
        x = load(i)
        q = builder.fdiv(x, divisor(i))
        q = builder.select(builder.fcmp_ordered(">", q, fmax), fmax, q)
        q = builder.select(builder.fcmp_ordered("<", q, neg_fmax), neg_fmax, q)
        code = emit_fp8_code(builder, q, x, fields)
        builder.store(builder.trunc(code, ir.VectorType(ir.IntType(8), LANES)), builder.gep(codes_ptr, [i]), align=1)
        bad = builder.icmp_unsigned(">=", builder.and_(builder.bitcast(x, VI), vi(_ABS_MASK)), vi(INF_BITS))
        builder.store(builder.add(builder.load(nonfinite), builder.zext(bad, VI)), nonfinite)

    def cast_pairs(first, count):
        """``count`` pairs of chunks from pair ``first`` of each source, their codes in one store."""
        for source, codes_ptr, divisor in zip(sources, codes_ptrs, divisors):
            pairs = [source.pair(builder.add(first, first.type(k))) for k in range(count)]
            chunk_indices = [builder.add(builder.mul(first, first.type(2)), first.type(k)) for k in range(2 * count)]
            if isinstance(divisor, _EveryChunk):
                scaled = [uniform_pair_scales(builder, divisor.scale, params)] * count
            else:
                chunk_scales = [(divisor(i), divisor.reciprocals(i)) for i in chunk_indices]
                scaled = [pair_scales(builder, chunk_scales[2 * k : 2 * k + 2], p.orders, params) for k, p in enumerate(pairs)]
            with builder.if_else(functools.reduce(builder.and_, [scales.inside for scales in scaled]), likely=True) as (
                by_half,
                by_division,
            ):
                with by_half:
                    done = [emit_pair_codes(builder, pair, scales, params) for pair, scales in zip(pairs, scaled)]
                    codes = functools.reduce(concatenated, [codes for codes, _ in done])
                    target = builder.gep(
                        builder.bitcast(codes_ptr, ir.IntType(8).as_pointer()), [builder.mul(first, first.type(PAIR))]
                    )
                    builder.store(codes, builder.bitcast(target, codes.type.as_pointer()), align=1)
                    builder.store(functools.reduce(builder.add, [builder.load(counted)] + [n for _, n in done]), counted)
                with by_division:
                    for i in chunk_indices:
                        cast_chunk(source.chunk, codes_ptr, divisor, i)

    def concatenated(a, b):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 2 * a.type.count), list(range(2 * a.type.count))))

    counted = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(64), 0))
    first_single = ir.Constant(chunks.type, 0)
    half_route = HALF_CAST and (WIDE or all(isinstance(divisor, _EveryChunk) for divisor in divisors))
    if half_route:
        # Two pairs a step: one 64-byte store of their codes ran 1.3x faster on arrays
        # past the cache than two 32-byte narrowing stores (scripts/plain_kernels.py).
        steps = builder.udiv(chunks, chunks.type(4))
        with cgutils.for_range(builder, steps) as loop:
            first = builder.mul(loop.index, loop.index.type(2))
            for source in sources:
                source.prefetch_ahead(builder.mul(first, first.type(PAIR)))
            cast_pairs(first, 2)
        pairs = builder.udiv(chunks, chunks.type(2))
        with builder.if_then(builder.icmp_unsigned("!=", pairs, builder.mul(steps, steps.type(2)))):  # a pair left
            cast_pairs(builder.mul(steps, steps.type(2)), 1)
        first_single = builder.mul(pairs, pairs.type(2))
    with cgutils.for_range(builder, builder.sub(chunks, first_single)) as loop:  # all, or the last odd chunk
        for source, codes_ptr, divisor in zip(sources, codes_ptrs, divisors):
            cast_chunk(source.chunk, codes_ptr, divisor, builder.add(loop.index, first_single))
    return builder.add(builder.load(counted), builder.zext(halve(builder, builder.load(nonfinite), builder.add), ir.IntType(64)))


def is_source(array) -> bool:
    return isinstance(array, types.Array) and array.dtype in SOURCE_DTYPES


def _amax_chooser(builder, mask, params):
    """``choose_scales`` of amax scales (``amax / finfo.max``, as
    :func:`fp8ray.codec.kernels.bits.scale_from_amax`)."""

    def choose(amaxes, chunks, magnitude_loaders):
        fmax = builder.extract_value(params, 0)
        divisor = builder.insert_element(ir.Constant(ir.VectorType(_F32, 1), ir.Undefined), fmax, _i32(0))
        return [builder.extract_element(candidate_scales(builder, amax, divisor, mask), _i32(0)) for amax in amaxes]

    return choose


@intrinsic
def encode_group_amax(typingctx, xs, codes, mask, p):
    """A group of a multiple of 16 elements under its amax scale: (scale, non-finite inputs)."""
    if not (is_source(xs) and isinstance(codes, types.Array)):
        return None

    def codegen(context, builder, signature, args):
        return emit_encode_group(context, builder, signature, args, _amax_chooser(builder, args[2], args[3]))

    return ENCODED(xs, codes, mask, p), codegen


@intrinsic
def encode_quad_amax(typingctx, xs, codes, xs2, codes2, xs3, codes3, xs4, codes4, mask, p):
    """Four groups of the same multiple of 16 elements, each under its amax scale
    (:func:`emit_encode_quad`): (their scales, non-finite inputs)."""
    same_sources = xs2 == xs and xs3 == xs and xs4 == xs
    same_targets = codes2 == codes and codes3 == codes and codes4 == codes
    if not (is_source(xs) and isinstance(codes, types.Array) and same_sources and same_targets):
        return None

    def codegen(context, builder, signature, args):
        return emit_encode_quad(context, builder, signature, args, _amax_chooser(builder, args[8], args[9]))

    return ENCODED_QUAD(xs, codes, xs2, codes2, xs3, codes3, xs4, codes4, mask, p), codegen


def is_scale_array(scales) -> bool:
    return isinstance(scales, types.Array) and scales.dtype == types.float32


def is_scale(scale) -> bool:
    """One fp32 scale, or an fp32 array of them (one per element)."""
    return scale == types.float32 or is_scale_array(scale)


def _emit_chunks(context, builder, signature, args, divisor):
    chunks = _chunk_count(context, builder, signature.args[0], args[0])
    source = _Source(context, builder, signature.args[0], args[0])
    codes_ptr = _codes_pointer(context, builder, signature.args[1], args[1])
    return emit_cast(builder, chunks, [source], [codes_ptr], [divisor], args[-1])


@intrinsic
def encode_chunks(typingctx, xs, codes, scale, p):
    """The whole 16-element chunks of ``xs`` under one fp32 ``scale`` into ``codes``
    (:func:`emit_cast`): their non-finite inputs. The elements past the last whole chunk
    are the caller's."""
    if not (is_source(xs) and isinstance(codes, types.Array) and scale == types.float32):
        return None

    def codegen(context, builder, signature, args):
        return _emit_chunks(context, builder, signature, args, _EveryChunk(builder, args[2]))

    return types.int64(xs, codes, scale, p), codegen


@intrinsic
def encode_chunks_per_element(typingctx, xs, codes, scales, reciprocals, p):
    """:func:`encode_chunks` under an fp32 array of scales, one per element, with their
    reciprocals ``RN(1 / (scale * 2**(15 - bias)))`` (:func:`.halfcast.pair_scales`:
    computed once per array, not once per row)."""
    arrays = [scales, reciprocals]
    if not (is_source(xs) and isinstance(codes, types.Array) and all(is_scale_array(a) for a in arrays)):
        return None

    def codegen(context, builder, signature, args):
        divisor = _PerElement(context, builder, signature.args[2:4], args[2:4])
        return _emit_chunks(context, builder, signature, args, divisor)

    return types.int64(xs, codes, scales, reciprocals, p), codegen


def _chunk_decoder(context, builder, signature, args):
    """``(decode, running)``: ``decode(i, scales, native)``, IR rounding chunk ``i`` of
    the codes ``args[0]`` times the fp32 vector ``scales`` (finite and positive, as
    frames' are) into chunk ``i`` of ``args[2]`` (``native``: as :func:`_chunk_storer`),
    and (where :data:`~fp8ray.codec.kernels.bits.CRC_IN_KERNELS`) adding its codes to the
    running CRC-32C in the slot ``running``, which starts at ``args[-1]``; ``args[3]`` is
    the format's tag. By the CPU's fp16 conversion where it has one
    (:func:`~fp8ray.codec.kernels.bits.emit_fp8_to_f32_by_half`), else on the bits."""
    fmt = _format_of_tag(signature.args[3])
    codes_ptr = _codes_pointer(context, builder, signature.args[0], args[0])
    store = _chunk_storer(context, builder, signature.args[2], args[2], nans_canonical=_NATIVE_HALF)
    if _NATIVE_HALF:
        values = functools.partial(emit_fp8_to_f32_by_half, fmt=fmt)
    else:
        fields = [vi(f) for f in decode_params(fmt)[:-1]] + [ir.Constant(VF, [decode_params(fmt)[-1]] * LANES)]
        values = functools.partial(emit_fp8_to_f32, fields=fields)

    words = builder.bitcast(codes_ptr, ir.IntType(64).as_pointer())  # a chunk's codes as 2 words
    running = cgutils.alloca_once_value(builder, args[-1])

    def decode(i, scales, native):
        emit_prefetch(builder, builder.gep(codes_ptr, [builder.add(i, i.type(PREFETCH_AHEAD // LANES))]))
        codes = builder.load(builder.gep(codes_ptr, [i]), align=1)
        store(i, builder.fmul(values(builder, codes), scales), native)
        if CRC_IN_KERNELS:
            crc = builder.load(running)
            for k in (0, 1):
                word = builder.load(builder.gep(words, [builder.add(builder.add(i, i), ir.Constant(i.type, k))]), align=1)
                crc = emit_crc32c(builder, crc, word)
            builder.store(crc, running)

    return decode, running


def _with_narrowing(builder, signature, smallest_scale, body):
    """IR of ``body(native)``: ``native`` True (under a test) where the output is bf16,
    the CPU narrows to it in hardware (:data:`~fp8ray.codec.kernels.bits.NATIVE_BF16`) and
    ``smallest_scale`` (fp32) is at least :func:`~fp8ray.codec.kernels.bits.bf16_narrowing_floor`,
    so that no product is an fp32 subnormal; otherwise False."""
    if not (NATIVE_BF16 and signature.args[2].dtype == types.uint16):
        body(False)
        return
    floor = ir.Constant(_F32, bf16_narrowing_floor(_format_of_tag(signature.args[3])))
    with builder.if_else(builder.fcmp_ordered(">=", smallest_scale, floor)) as (native, exact):
        with native:
            body(True)
        with exact:
            body(False)


@intrinsic
def decode_chunks(typingctx, codes, scales, out, tag, smallest_scale, running):
    """The whole 16-code chunks of ``codes`` times ``scales`` (one fp32 scale, or an fp32
    array of one per element; ``smallest_scale`` the least of them), rounded into ``out`` (bf16, fp16 or fp32), in
    vectors, which LLVM would not make of numba's loop over a row with a scale per column
    (it took 8 lanes there): the running CRC-32C (``running``, uninverted) after their
    codes, where :data:`~fp8ray.codec.kernels.bits.CRC_IN_KERNELS` (else ``running``).
    The elements past the last whole chunk are the caller's."""
    if not (isinstance(codes, types.Array) and is_scale(scales) and is_source(out) and isinstance(tag, types.Array)):
        return None
    if smallest_scale != types.float32 or running != types.int64:
        return None

    def codegen(context, builder, signature, args):
        decode, crc = _chunk_decoder(context, builder, signature, args)
        scale = _scale_loader(context, builder, signature.args[1], args[1])
        chunks = _chunk_count(context, builder, signature.args[0], args[0])

        def loop(native):
            with cgutils.for_range(builder, chunks) as chunk:
                decode(chunk.index, scale(chunk.index), native)

        _with_narrowing(builder, signature, args[4], loop)
        return builder.load(crc)

    return types.int64(codes, scales, out, tag, smallest_scale, running), codegen


@intrinsic
def decode_groups(typingctx, codes, scales, out, tag, running):
    """:func:`decode_chunks` of whole groups of a multiple of 16 codes, one scale each
    (``codes.size / scales.size`` codes a group), in one loop over the groups and one over
    their chunks: numba's loop over groups of 32, a call for each, took 7.6 ns a group, this 6.5."""
    if not all(isinstance(a, types.Array) for a in (codes, scales, tag)) or not is_source(out) or running != types.int64:
        return None

    def codegen(context, builder, signature, args):
        decode, crc = _chunk_decoder(context, builder, signature, args)
        scale_array = context.make_array(signature.args[1])(context, builder, args[1])
        groups = builder.extract_value(scale_array.shape, 0)
        chunks = builder.udiv(_chunk_count(context, builder, signature.args[0], args[0]), groups)  # per group
        with cgutils.for_range(builder, groups) as group:
            scale = builder.load(builder.gep(scale_array.data, [group.index]))
            scales = splat(builder, scale, VF)

            def loop(native):
                with cgutils.for_range(builder, chunks) as chunk:
                    decode(builder.add(builder.mul(group.index, chunks), chunk.index), scales, native)

            _with_narrowing(builder, signature, scale, loop)
        return builder.load(crc)

    return types.int64(codes, scales, out, tag, running), codegen
