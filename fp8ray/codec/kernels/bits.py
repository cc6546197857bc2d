"""Bit-level conversions, written as LLVM IR or numba scalars: bfloat16, float16 and fp8
to and from fp32, the fp8 rounding, and each format's constants as compile-time values.

Every kernel in this package is built from these; none has a per-element branch.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic, overload

from ..formats import E4M3FN, E5M2, SMALLEST_NORMAL_SCALE, Fp8Format, max_code

_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF
_SIGN_BIT = 0x80000000


@intrinsic
def _bits_to_f32(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of an int64."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(types.int64), codegen


@intrinsic
def _f32_to_bits(typingctx, value):
    """The bit pattern of a float32, zero-extended to int64."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _x86_features() -> list[str]:
    """The x86 CPU features numba compiles for (``+f16c``, ...); none elsewhere. Numba's
    own setting where one is made (``NUMBA_CPU_FEATURES``, or none at all under
    ``NUMBA_CPU_NAME``, as for ``generic``), else the host's."""
    if not llvm_binding.get_process_triple().startswith("x86_64"):
        return []
    if numba_config.CPU_FEATURES is not None:
        return numba_config.CPU_FEATURES.split(",")
    return llvm_binding.get_host_cpu_features().flatten().split(",")


_FEATURES = _x86_features()  # asked once: each of the three flags below reads them


def _native_half_conversions() -> bool:
    """Whether LLVM lowers fp32 <-> fp16 to one instruction here (x86 F16C, any aarch64).

    Elsewhere it would call a compiler-rt helper the JIT may not have, so the bit-level
    conversions below are used instead; both round to nearest even, so the bits agree.
    """
    return llvm_binding.get_process_triple().startswith(("aarch64", "arm64")) or "+f16c" in _FEATURES


_NATIVE_HALF = _native_half_conversions()
# x86's AVX-512 BF16 narrows 16 fp32 values to bfloat16 in one instruction, rounding to
# nearest even, but reads and writes fp32 subnormals as zeros: it is used only where no
# value can be one (:func:`bf16_narrowing_floor`).
NATIVE_BF16 = "+avx512bf16" in _FEATURES
# SSE 4.2's crc32 instruction computes CRC-32C: the decode kernels then take the checksum
# of the codes in their own loops, on the scalar ports the vector work leaves idle.
CRC_IN_KERNELS = "+sse4.2" in _FEATURES
CRC_START = 0xFFFFFFFF  # CRC-32C's running value before any byte (and its final inversion)


def emit_crc32c(builder, running, data):
    """IR: the running (uninverted) CRC-32C ``running`` (i64) after the bytes of ``data``
    (an i64 word, little-endian, or an i8), by x86's crc32 (:data:`CRC_IN_KERNELS`)."""
    i64 = ir.IntType(64)
    if data.type == i64:
        crc32 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64, i64]), "llvm.x86.sse42.crc32.64.64")
        return builder.call(crc32, [running, data])
    by_byte = ir.FunctionType(_I32, [_I32, ir.IntType(8)])
    crc32 = cgutils.get_or_insert_function(builder.module, by_byte, "llvm.x86.sse42.crc32.32.8")
    return builder.zext(builder.call(crc32, [builder.trunc(running, _I32), data]), i64)


PREFETCH_AHEAD = 4096  # bytes: how far ahead of their reads the loops ask for data


def emit_prefetch(builder, address):
    """IR: a hint to bring the memory at ``address`` (any pointer) into the cache, to be
    read. The encode's and the decode's loops ask for what they will read
    :data:`PREFETCH_AHEAD` bytes on: arrays past the cache ran 5-10% faster on one thread
    (BENCHMARKS.md); a hint past an array's end is dropped, not a fault."""
    i8p = ir.IntType(8).as_pointer()
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]), "llvm.prefetch.p0"
    )
    builder.call(prefetch, [builder.bitcast(address, i8p), _i32(0), _i32(3), _i32(1)])  # a read, kept close, data


@intrinsic
def _crc32c_byte(typingctx, running, byte):
    """The running CRC-32C (int64, uninverted) after one more byte (:func:`emit_crc32c`)."""
    if running != types.int64 or byte != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        return emit_crc32c(builder, *args) if CRC_IN_KERNELS else args[0]

    return types.int64(running, byte), codegen


def _i32(value: int) -> ir.Constant:
    return ir.Constant(_I32, value & 0xFFFFFFFF)


def splat(builder, value, vector_type):
    """A vector of ``vector_type`` holding ``value`` in every lane."""
    undef = ir.Constant(vector_type, ir.Undefined)
    one = builder.insert_element(undef, value, _i32(0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count))


def _like(value_type, element_type):
    """``element_type``, or a vector of it as wide as ``value_type`` if that is a vector."""
    return ir.VectorType(element_type, value_type.count) if isinstance(value_type, ir.VectorType) else element_type


def _int_like(value_type):
    return _like(value_type, _I32)


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    """bfloat16 bits (uint16) to float32: the bits are fp32's top half, so this is exact."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], _I32), _i32(16)), _F32)

    return types.float32(types.uint16), codegen


def emit_f32_to_bf16(builder, value, nans_canonical=False):
    """IR: fp32 (scalar or vector) to bfloat16 bits (i16), round to nearest even; NaN
    becomes 0x7FC0 (as c10 does). ``nans_canonical``: the only NaN ``value`` can hold is
    :data:`CANONICAL_NAN`, which the rounding itself takes to 0x7FC0, so the test for
    NaNs is left out (other NaNs could round to an infinity or carry into the sign)."""
    c = _i32_constants(value.type)
    b = builder.bitcast(value, _int_like(value.type))
    odd = builder.and_(builder.lshr(b, c(16)), c(1))
    rounded = builder.lshr(builder.add(builder.add(b, c(0x7FFF)), odd), c(16))
    if not nans_canonical:
        is_nan = builder.icmp_unsigned(">", builder.and_(b, c(_ABS_MASK)), c(_INF_BITS))
        rounded = builder.select(is_nan, c(0x7FC0), rounded)
    return builder.trunc(rounded, _like(value.type, ir.IntType(16)))


class _BFloat16(ir.Type):
    """LLVM's ``bfloat``, which llvmlite's IR builder does not name."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat16)

    def __hash__(self):
        return hash("bfloat")


def emit_f32_to_bf16_native(builder, value):
    """IR: an fp32 vector to bfloat16 bits by :data:`NATIVE_BF16`'s instruction, which
    equals :func:`emit_f32_to_bf16` except on fp32 subnormals (it makes them zeros) and
    NaN payloads."""
    narrow = builder.fptrunc(value, ir.VectorType(_BFloat16(), value.type.count))
    return builder.bitcast(narrow, ir.VectorType(ir.IntType(16), value.type.count))


def bf16_narrowing_floor(fmt: Fp8Format) -> float:
    """The smallest scale whose products with ``fmt``'s nonzero codes are all fp32
    normals (its smallest subnormal is ``2**fmt.min_subnormal_exp``): a decode by scales
    at least this may narrow to bf16 by :func:`emit_f32_to_bf16_native`."""
    return 2.0 ** (-126 - fmt.min_subnormal_exp)


@intrinsic
def _f32_to_bf16(typingctx, value):
    """float32 to bfloat16 bits (:func:`emit_f32_to_bf16`).

    Written in 32-bit LLVM IR: numba would widen the integer arithmetic to int64, which
    halves the vector lanes and costs shuffles between float and integer lanes.
    """
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return emit_f32_to_bf16(builder, args[0])

    return types.uint16(types.float32), codegen


def _i32_constants(value_type):
    """A maker of i32 constants shaped like values of ``value_type``: scalars, or vectors of its width."""
    if isinstance(value_type, ir.VectorType):
        return lambda c: ir.Constant(ir.VectorType(_I32, value_type.count), [c & 0xFFFFFFFF] * value_type.count)
    return _i32


def _f32_constants(value_type):
    """:func:`_i32_constants` for fp32 constants."""
    float_type = _like(value_type, _F32)
    if isinstance(float_type, ir.VectorType):
        return lambda c: ir.Constant(float_type, [c] * float_type.count)
    return lambda c: ir.Constant(_F32, c)


def emit_fp8_code(builder, q, v, fields):
    """IR for the fp8 code of the clamped quotient ``q`` (round to nearest even, c10's
    algorithm), replaced by the NaN/inf code when the input ``v`` is not finite; ``q`` and
    ``v`` are fp32 scalars or vectors, ``fields`` the i32 values (of their shape) of
    :func:`format_params` 1 to 7. Returns i32 codes of their shape."""
    c = _i32_constants(q.type)
    int_type = ir.VectorType(_I32, q.type.count) if isinstance(q.type, ir.VectorType) else _I32
    float_type = q.type
    shift, norm_add, min_normal, denorm_bits, nan_code, posinf_code, neginf_code = fields
    b = builder.bitcast(q, int_type)
    sign = builder.and_(b, c(_SIGN_BIT))
    a = builder.xor(b, sign)
    magic = builder.bitcast(denorm_bits, float_type)
    subnormal = builder.sub(builder.bitcast(builder.fadd(builder.bitcast(a, float_type), magic), int_type), denorm_bits)
    odd = builder.and_(builder.lshr(a, shift), c(1))
    normal = builder.lshr(builder.add(builder.add(a, norm_add), odd), shift)
    code = builder.select(builder.icmp_unsigned("<", a, min_normal), subnormal, normal)
    code = builder.or_(code, builder.lshr(sign, c(24)))
    vb = builder.bitcast(v, int_type)
    key = builder.and_(vb, c(_ABS_MASK))
    inf = builder.select(builder.icmp_signed("<", vb, c(0)), neginf_code, posinf_code)
    special = builder.select(builder.icmp_unsigned(">", key, c(_INF_BITS)), nan_code, inf)
    nonfinite = builder.icmp_unsigned(">=", key, c(_INF_BITS))
    return builder.select(nonfinite, special, code)


def code_fields(builder, params):
    """The i32 fields of :func:`format_params` that :func:`emit_fp8_code` takes."""
    return [builder.trunc(builder.extract_value(params, k), _I32) for k in range(1, 8)]


@intrinsic
def _fp8_code_bits(typingctx, q, v, p):
    """The fp8 code of the clamped quotient ``q`` (see :func:`emit_fp8_code`). 32-bit LLVM
    IR, for the reason given in :func:`_f32_to_bf16`."""
    if q != types.float32 or v != types.float32:
        return None

    def codegen(context, builder, signature, args):
        q, v, params = args
        return emit_fp8_code(builder, q, v, code_fields(builder, params))

    return types.int32(q, v, p), codegen


CANONICAL_NAN = 0x7FC00000  # fp32's positive quiet NaN


def emit_fp8_to_f32(builder, code, fields):
    """IR: the fp32 value of fp8 codes (i8, scalar or vector), ``fields`` the values (of
    their shape) of :func:`decode_fields`. Normals by rebiasing the bits, subnormals by an
    exact int-to-float product (no fp32 denormals, which are slow), inf by its exponent,
    every NaN code as :data:`CANONICAL_NAN`, as :func:`emit_fp8_to_f32_by_half` gives it:
    a frame's NaNs decode to the same bits whichever of the two converts them (a block's
    last codes, decoded alone here, fall in a vector where blocks are decoded as a run)."""
    shift, rebias, exponent_mask, special_mask, mantissa_mask, subnormal_unit = fields
    c = _i32_constants(code.type)
    int_type, float_type = _int_like(code.type), _like(code.type, _F32)
    v = builder.zext(code, int_type)
    sign = builder.shl(builder.and_(v, c(0x80)), c(24))
    mag = builder.and_(v, c(0x7F))
    shifted = builder.shl(mag, shift)
    normal = builder.bitcast(builder.or_(builder.add(shifted, rebias), sign), float_type)
    special = builder.bitcast(builder.or_(builder.or_(shifted, c(_INF_BITS)), sign), float_type)
    sub = builder.fmul(builder.uitofp(builder.and_(mag, mantissa_mask), float_type), subnormal_unit)
    sub = builder.bitcast(builder.or_(builder.bitcast(sub, int_type), sign), float_type)
    is_special = builder.icmp_unsigned("==", builder.and_(mag, special_mask), special_mask)
    is_sub = builder.icmp_unsigned("==", builder.and_(mag, exponent_mask), c(0))
    is_nan = builder.and_(is_special, builder.icmp_unsigned("!=", builder.and_(mag, mantissa_mask), c(0)))
    special = builder.select(is_nan, builder.bitcast(c(CANONICAL_NAN), float_type), special)
    return builder.select(is_sub, sub, builder.select(is_special, special, normal))


def emit_fp8_to_f32_by_half(builder, codes, fmt: Fp8Format):
    """IR: the fp32 values of fp8 codes (a vector of i8) of ``fmt``, by the CPU's fp16
    conversion (x86 F16C, aarch64; only where :data:`_NATIVE_HALF`). An fp8 code is an IEEE half
    with shorter fields: its sign, exponent and mantissa bits placed at a half's widen to
    fp32 in one instruction, subnormals included (fp16 subnormals are fp32 normals, so
    none of fp32's slow denormals arises), and a product by 2**(15 - bias) (exact) rebias
    it. Every NaN code becomes :data:`CANONICAL_NAN` (NaN payloads are no contract), which
    stays itself in a product with a finite scale, so the bf16 rounding after can leave
    out its NaN test (:func:`emit_f32_to_bf16`). About 7 vector operations a chunk, where
    :func:`emit_fp8_to_f32`'s bit-level conversion takes 20."""
    count = codes.type.count
    i16 = ir.VectorType(ir.IntType(16), count)
    float_type = ir.VectorType(_F32, count)
    offset = 10 - fmt.mantissa_bits  # from the fp8 mantissa's lowest bit to a half's
    wide = builder.shl(builder.sext(codes, i16), ir.Constant(i16, [offset] * count))  # the sign extended to bit 15
    half_bits = builder.and_(wide, ir.Constant(i16, [0x8000 | (0x7F << offset)] * count))
    values = builder.fpext(builder.bitcast(half_bits, ir.VectorType(ir.HalfType(), count)), float_type)
    if fmt.exponent_bias != 15:
        values = builder.fmul(values, ir.Constant(float_type, [2.0 ** (15 - fmt.exponent_bias)] * count))
    largest = fmt.posinf_code if fmt.posinf_code != fmt.nan_code else max_code(fmt)  # above it: NaN codes
    magnitude = builder.and_(codes, ir.Constant(codes.type, [0x7F] * count))
    is_nan = builder.icmp_unsigned(">", magnitude, ir.Constant(codes.type, [largest] * count))
    nan = builder.bitcast(ir.Constant(ir.VectorType(_I32, count), [CANONICAL_NAN] * count), float_type)
    return builder.select(is_nan, nan, values)


def decode_fields(builder, params):
    """The i32 fields and fp32 unit of :func:`decode_params`, as :func:`emit_fp8_to_f32` takes them."""
    return [builder.trunc(builder.extract_value(params, k), _I32) for k in range(5)] + [builder.extract_value(params, 5)]


@intrinsic
def _fp8_to_f32(typingctx, code, dp):
    """fp32 value of an fp8 code (:func:`emit_fp8_to_f32`)."""
    if code != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        return emit_fp8_to_f32(builder, args[0], decode_fields(builder, args[1]))

    return types.float32(code, dp), codegen


def emit_f16_bits_to_f32(builder, bits):
    """IR: IEEE half bits (i16, scalar or vector) to fp32, exactly, without touching fp32
    denormals: normals by rebiasing the bits, subnormals by an exact int-to-float product."""
    vector = isinstance(bits.type, ir.VectorType)
    int_type = ir.VectorType(_I32, bits.type.count) if vector else _I32
    float_type = ir.VectorType(_F32, bits.type.count) if vector else _F32
    if _NATIVE_HALF:
        half = ir.VectorType(ir.HalfType(), bits.type.count) if vector else ir.HalfType()
        return builder.fpext(builder.bitcast(bits, half), float_type)
    c = _i32_constants(bits.type)
    h = builder.zext(bits, int_type)
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    exp_mant = builder.and_(h, c(0x7FFF))
    exponent = builder.and_(h, c(0x7C00))
    shifted = builder.shl(exp_mant, c(13))
    normal = builder.or_(builder.add(shifted, c(112 << 23)), sign)
    special = builder.or_(builder.or_(shifted, c(_INF_BITS)), sign)
    unit = ir.Constant(float_type, [2.0**-24] * bits.type.count) if vector else ir.Constant(_F32, 2.0**-24)
    sub = builder.fmul(builder.uitofp(exp_mant, float_type), unit)
    sub = builder.or_(builder.bitcast(sub, int_type), sign)
    is_special = builder.icmp_unsigned("==", exponent, c(0x7C00))
    is_sub = builder.icmp_unsigned("==", exponent, c(0))
    result = builder.select(is_sub, sub, builder.select(is_special, special, normal))
    return builder.bitcast(result, float_type)


@intrinsic
def _f16_bits_to_f32(typingctx, bits):
    """IEEE half (bits in an int16) to float32, exactly (see :func:`emit_f16_bits_to_f32`)."""
    if bits != types.int16:
        return None

    def codegen(context, builder, signature, args):
        return emit_f16_bits_to_f32(builder, args[0])

    return types.float32(types.int16), codegen


def emit_f32_to_f16(builder, f):
    """IR: fp32 (scalar or vector) to IEEE half bits (i16), round to nearest even (after
    Maratyszcza's FP16 library: the rounding is done by two fp32 products and one fp32 sum)."""
    if _NATIVE_HALF:
        return builder.bitcast(builder.fptrunc(f, _like(f.type, ir.HalfType())), _like(f.type, ir.IntType(16)))
    c, cf = _i32_constants(f.type), _f32_constants(f.type)
    float_type = f.type
    w = builder.bitcast(f, _int_like(f.type))
    magnitude = builder.bitcast(builder.and_(w, c(_ABS_MASK)), float_type)
    base = builder.fmul(builder.fmul(magnitude, cf(2.0**112)), cf(2.0**-110))
    shl1_w = builder.add(w, w)
    sign = builder.and_(w, c(_SIGN_BIT))
    bias = builder.and_(shl1_w, c(0xFF000000))
    bias = builder.select(builder.icmp_unsigned("<", bias, c(0x71000000)), c(0x71000000), bias)
    offset = builder.bitcast(builder.add(builder.lshr(bias, c(1)), c(0x07800000)), float_type)
    bits = builder.bitcast(builder.fadd(offset, base), w.type)
    nonsign = builder.add(builder.and_(builder.lshr(bits, c(13)), c(0x7C00)), builder.and_(bits, c(0x0FFF)))
    nan = builder.icmp_unsigned(">", shl1_w, c(0xFF000000))
    result = builder.or_(builder.lshr(sign, c(16)), builder.select(nan, c(0x7E00), nonsign))
    return builder.trunc(result, _like(f.type, ir.IntType(16)))


@intrinsic
def _f32_to_f16(typingctx, value):
    """float32 to IEEE half bits (:func:`emit_f32_to_f16`)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return emit_f32_to_f16(builder, args[0])

    return types.int16(types.float32), codegen


def _load(x, i):
    """Element ``i`` of a source array as float32 (typed by :func:`_load_impl`)."""


@overload(_load)
def _load_impl(x, i):
    if x.dtype == types.float32:
        return lambda x, i: x[i]
    if x.dtype == types.uint16:  # bfloat16 bits
        return lambda x, i: _bf16_bits_to_f32(x[i])
    if x.dtype == types.int16:  # float16 bits
        return lambda x, i: _f16_bits_to_f32(x[i])
    return None


def _store(out, i, v):
    """Write the float32 ``v`` into element ``i`` of an output array, rounding to its dtype."""


@overload(_store)
def _store_impl(out, i, v):
    if out.dtype == types.float32:

        def store_f32(out, i, v):
            out[i] = v

        return store_f32
    if out.dtype == types.uint16:

        def store_bf16(out, i, v):
            out[i] = _f32_to_bf16(v)

        return store_bf16
    if out.dtype == types.int16:

        def store_f16(out, i, v):
            out[i] = _f32_to_f16(v)

        return store_f16
    return None


def format_params(fmt: Fp8Format) -> tuple:
    """The constants of the fp32 -> fp8 rounding (c10's algorithm, generalised over
    formats), and the scale factor of the half route (:mod:`.halfcast`)."""
    shift = 23 - fmt.mantissa_bits
    return (
        np.float32(fmt.max),
        shift,
        ((fmt.exponent_bias - 127) << 23) + (1 << (shift - 1)) - 1,  # rebias + round-half-down
        (127 - fmt.exponent_bias + 1) << 23,  # bits of the smallest normal
        (127 - fmt.exponent_bias + shift + 1) << 23,  # magic that rounds subnormals in fp add
        fmt.nan_code,
        fmt.posinf_code,
        fmt.neginf_code,
        # The largest code a finite input can get: +-max after the clamp. Every code above
        # it (sign aside) is a NaN/inf code, which only non-finite inputs get.
        max_code(fmt),
        # The scale's factor under which the quotient's fp16 bits are the code's
        # (:mod:`fp8ray.codec.kernels.halfcast`).
        np.float32(2.0 ** (15 - fmt.exponent_bias)),
    )


@njit(cache=True, error_model="numpy")
def _fp8_code(v, scale, p):
    """The fp8 code of ``v / scale`` clamped to +-max; the NaN/inf code if ``v`` is not finite.

    Rounding is round-to-nearest-even, the same bits as torch's cast.
    """
    fmax = p[0]
    q = v / scale
    q = fmax if q > fmax else q
    q = -fmax if q < -fmax else q
    return np.uint8(_fp8_code_bits(q, v, p))


@njit(cache=True, error_model="numpy")
def _finite_key(v):
    """|v|'s bits as an int, 0 for non-finite: ordered like |v|, so max() is exact."""
    key = _f32_to_bits(v) & _ABS_MASK
    return key if key < _INF_BITS else 0


@njit(cache=True, error_model="numpy")
def scale_from_amax(amax, divisor, mask):
    """``amax / divisor`` in fp32, at least 2**-126, and 1 for amax 0, then truncated to
    the scale dtype by keeping the bits in ``mask`` (see fp8ray.codec.formats)."""
    scale = amax / divisor
    scale = np.float32(SMALLEST_NORMAL_SCALE) if scale < np.float32(SMALLEST_NORMAL_SCALE) else scale
    scale = np.float32(1.0) if amax == 0 else scale
    return _bits_to_f32(_f32_to_bits(scale) & mask)


def decode_params(fmt: Fp8Format) -> tuple:
    """The constants of the exact fp8 -> fp32 conversion done on the bits."""
    shift = 23 - fmt.mantissa_bits
    exponent_mask = (0x7F >> fmt.mantissa_bits) << fmt.mantissa_bits
    # e4m3fn spends only the all-ones code on NaN; e5m2 the whole top exponent on inf/NaN.
    special_mask = 0x7F if fmt.posinf_code == fmt.nan_code else exponent_mask
    return (
        shift,
        (127 - fmt.exponent_bias) << 23,
        exponent_mask,
        special_mask,
        (1 << fmt.mantissa_bits) - 1,
        np.float32(2.0 ** (1 - fmt.exponent_bias - fmt.mantissa_bits)),
    )


# A format reaches the kernels as a *tag*: an empty array whose dtype names the format.
# Numba compiles (and caches) one specialisation per argument type, so each format gets
# its own machine code with its constants folded in as immediates; passed as runtime
# values they cost register spills and variable shifts (encode runs ~1.6x slower).
FORMAT_TAGS = {"e4m3fn": np.empty(0, np.uint8), "e5m2": np.empty(0, np.int8)}


def _format_of_tag(tag) -> Fp8Format:
    return {types.uint8: E4M3FN, types.int8: E5M2}[tag.dtype]


def _encode_params(tag):
    """The :func:`format_params` of the format ``tag`` names, as compile-time constants."""


@overload(_encode_params)
def _encode_params_impl(tag):
    params = format_params(_format_of_tag(tag))
    return lambda tag: params


def _decode_params(tag):
    """The :func:`decode_params` of the format ``tag`` names, as compile-time constants."""


@overload(_decode_params)
def _decode_params_impl(tag):
    params = decode_params(_format_of_tag(tag))
    return lambda tag: params
