"""Numba CPU kernels: one pass over memory, no per-element branches, vectorised loops.

Each kernel works on a range (of elements, groups or rows) so that the caller can split
a tensor across threads; all are ``nogil``. Inputs and outputs are flat numpy arrays:
``float32``; ``uint16`` holding bfloat16 bits; ``int16`` holding float16 bits. The
conversions between those and fp32 are done on the bits, in int64 arithmetic (numba
promotes mixed signed/unsigned integers to float, so unsigned types are avoided), and
every selection is written so that LLVM turns it into a vector blend.

Every kernel is compiled with ``error_model="numpy"``: under numba's default ("python")
each division checks for a zero divisor, and that per-element branch stops LLVM from
vectorising any loop whose divisor varies (channel scaling ran 3x slower). Scales are
never zero (see fp8ray.formats), so the check would never fire.

The results must equal :mod:`fp8ray.reference` bit for bit; ``tests/test_kernels.py``
checks that exhaustively where it can (every bf16 and fp16 value, every fp8 code) and
on random data elsewhere.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .formats import E4M3FN, E5M2, SMALLEST_NORMAL_SCALE, Fp8Format

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


def _native_half_conversions() -> bool:
    """Whether LLVM lowers fp32 <-> fp16 to one instruction here (x86 F16C, any aarch64).

    Elsewhere it would call a compiler-rt helper the JIT may not have, so the bit-level
    conversions below are used instead; both round to nearest even, so the bits agree.
    """
    triple = llvm_binding.get_process_triple()
    if triple.startswith(("aarch64", "arm64")):
        return True
    features = os.environ.get("NUMBA_CPU_FEATURES") or llvm_binding.get_host_cpu_features().flatten()
    return triple.startswith("x86_64") and "+f16c" in features.split(",")


_NATIVE_HALF = _native_half_conversions()


def _i32(value: int) -> ir.Constant:
    return ir.Constant(_I32, value & 0xFFFFFFFF)


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    """bfloat16 bits (uint16) to float32: the bits are fp32's top half, so this is exact."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], _I32), _i32(16)), _F32)

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_bf16(typingctx, value):
    """float32 to bfloat16 bits, round to nearest even; NaN becomes 0x7FC0 (as c10 does).

    Written in 32-bit LLVM IR: numba would widen the integer arithmetic to int64, which
    halves the vector lanes and costs shuffles between float and integer lanes.
    """
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        b = builder.bitcast(args[0], _I32)
        odd = builder.and_(builder.lshr(b, _i32(16)), _i32(1))
        rounded = builder.lshr(builder.add(builder.add(b, _i32(0x7FFF)), odd), _i32(16))
        is_nan = builder.icmp_unsigned(">", builder.and_(b, _i32(_ABS_MASK)), _i32(_INF_BITS))
        return builder.trunc(builder.select(is_nan, _i32(0x7FC0), rounded), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _fp8_code_bits(typingctx, q, v, p):
    """The fp8 code of the clamped quotient ``q`` (round to nearest even, c10's algorithm),
    replaced by the NaN/inf code when the input ``v`` is not finite. 32-bit LLVM IR, for
    the reason given in :func:`_f32_to_bf16`."""
    if q != types.float32 or v != types.float32:
        return None

    def codegen(context, builder, signature, args):
        q, v, params = args
        fields = [builder.extract_value(params, k) for k in range(1, 8)]
        shift, norm_add, min_normal, denorm_bits, nan_code, posinf_code, neginf_code = (
            builder.trunc(f, _I32) for f in fields
        )
        b = builder.bitcast(q, _I32)
        sign = builder.and_(b, _i32(_SIGN_BIT))
        a = builder.xor(b, sign)
        magic = builder.bitcast(denorm_bits, _F32)
        subnormal = builder.sub(builder.bitcast(builder.fadd(builder.bitcast(a, _F32), magic), _I32), denorm_bits)
        odd = builder.and_(builder.lshr(a, shift), _i32(1))
        normal = builder.lshr(builder.add(builder.add(a, norm_add), odd), shift)
        code = builder.select(builder.icmp_unsigned("<", a, min_normal), subnormal, normal)
        code = builder.or_(code, builder.lshr(sign, _i32(24)))
        vb = builder.bitcast(v, _I32)
        key = builder.and_(vb, _i32(_ABS_MASK))
        inf = builder.select(builder.icmp_signed("<", vb, _i32(0)), neginf_code, posinf_code)
        special = builder.select(builder.icmp_unsigned(">", key, _i32(_INF_BITS)), nan_code, inf)
        nonfinite = builder.icmp_unsigned(">=", key, _i32(_INF_BITS))
        return builder.select(nonfinite, special, code)

    return types.int32(q, v, p), codegen


@intrinsic
def _fp8_to_f32(typingctx, code, dp):
    """fp32 value of an fp8 code: normals by rebiasing the bits, subnormals by an exact
    int-to-float product (no fp32 denormals, which are slow), inf/NaN by their exponent."""
    if code != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        code, params = args
        shift, rebias, exponent_mask, special_mask, mantissa_mask = (
            builder.trunc(builder.extract_value(params, k), _I32) for k in range(5)
        )
        subnormal_unit = builder.extract_value(params, 5)
        c = builder.zext(code, _I32)
        sign = builder.shl(builder.and_(c, _i32(0x80)), _i32(24))
        mag = builder.and_(c, _i32(0x7F))
        shifted = builder.shl(mag, shift)
        normal = builder.bitcast(builder.or_(builder.add(shifted, rebias), sign), _F32)
        special = builder.bitcast(builder.or_(builder.or_(shifted, _i32(_INF_BITS)), sign), _F32)
        sub_bits = builder.bitcast(
            builder.fmul(builder.uitofp(builder.and_(mag, mantissa_mask), _F32), subnormal_unit), _I32
        )
        sub = builder.bitcast(builder.or_(sub_bits, sign), _F32)
        is_special = builder.icmp_unsigned("==", builder.and_(mag, special_mask), special_mask)
        is_sub = builder.icmp_unsigned("==", builder.and_(mag, exponent_mask), _i32(0))
        return builder.select(is_sub, sub, builder.select(is_special, special, normal))

    return types.float32(code, dp), codegen


@intrinsic
def _f16_bits_to_f32(typingctx, bits):
    """IEEE half (bits in an int16) to float32, exactly, without touching fp32 denormals:
    normals by rebiasing the bits, subnormals by an exact int-to-float product."""
    if bits != types.int16:
        return None

    def codegen(context, builder, signature, args):
        if _NATIVE_HALF:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)
        h = builder.zext(args[0], _I32)
        sign = builder.shl(builder.and_(h, _i32(0x8000)), _i32(16))
        exp_mant = builder.and_(h, _i32(0x7FFF))
        exponent = builder.and_(h, _i32(0x7C00))
        shifted = builder.shl(exp_mant, _i32(13))
        normal = builder.or_(builder.add(shifted, _i32(112 << 23)), sign)
        special = builder.or_(builder.or_(shifted, _i32(_INF_BITS)), sign)
        sub = builder.fmul(builder.uitofp(exp_mant, _F32), ir.Constant(_F32, 2.0**-24))
        sub = builder.or_(builder.bitcast(sub, _I32), sign)
        is_special = builder.icmp_unsigned("==", exponent, _i32(0x7C00))
        is_sub = builder.icmp_unsigned("==", exponent, _i32(0))
        result = builder.select(is_sub, sub, builder.select(is_special, special, normal))
        return builder.bitcast(result, _F32)

    return types.float32(types.int16), codegen


@intrinsic
def _f32_to_f16(typingctx, value):
    """float32 to IEEE half bits, round to nearest even (after Maratyszcza's FP16
    library: the rounding is done by two fp32 products and one fp32 sum)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        f = args[0]
        if _NATIVE_HALF:
            return builder.bitcast(builder.fptrunc(f, ir.HalfType()), ir.IntType(16))
        w = builder.bitcast(f, _I32)
        magnitude = builder.bitcast(builder.and_(w, _i32(_ABS_MASK)), _F32)
        base = builder.fmul(builder.fmul(magnitude, ir.Constant(_F32, 2.0**112)), ir.Constant(_F32, 2.0**-110))
        shl1_w = builder.add(w, w)
        sign = builder.and_(w, _i32(_SIGN_BIT))
        bias = builder.and_(shl1_w, _i32(0xFF000000))
        bias = builder.select(builder.icmp_unsigned("<", bias, _i32(0x71000000)), _i32(0x71000000), bias)
        offset = builder.bitcast(builder.add(builder.lshr(bias, _i32(1)), _i32(0x07800000)), _F32)
        bits = builder.bitcast(builder.fadd(offset, base), _I32)
        nonsign = builder.add(builder.and_(builder.lshr(bits, _i32(13)), _i32(0x7C00)), builder.and_(bits, _i32(0x0FFF)))
        nan = builder.icmp_unsigned(">", shl1_w, _i32(0xFF000000))
        result = builder.or_(builder.lshr(sign, _i32(16)), builder.select(nan, _i32(0x7E00), nonsign))
        return builder.trunc(result, ir.IntType(16))

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
    """The constants of the fp32 -> fp8 rounding (c10's algorithm, generalised over formats)."""
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
        int(torch.tensor(fmt.max).to(fmt.dtype).view(torch.uint8)),
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


@njit(inline="always", error_model="numpy")
def _count_nonfinite(codes, p):
    """Non-finite inputs, counted from their codes afterwards: counting inside the cast
    loop keeps LLVM from vectorising it, and this pass reads bytes still in cache."""
    max_finite_code = p[8]
    bad = 0
    for i in range(codes.size):
        bad += (codes[i] & 0x7F) > max_finite_code
    return bad


@njit(cache=True, error_model="numpy")
def _finite_key(v):
    """|v|'s bits as an int, 0 for non-finite: ordered like |v|, so max() is exact."""
    key = _f32_to_bits(v) & _ABS_MASK
    return key if key < _INF_BITS else 0


@njit(cache=True, error_model="numpy")
def scale_from_amax(amax, divisor, mask):
    """``amax / divisor`` in fp32, at least 2**-126, and 1 for amax 0, then truncated to
    the scale dtype by keeping the bits in ``mask`` (see fp8ray.formats)."""
    scale = amax / divisor
    scale = np.float32(SMALLEST_NORMAL_SCALE) if scale < np.float32(SMALLEST_NORMAL_SCALE) else scale
    scale = np.float32(1.0) if amax == 0 else scale
    return _bits_to_f32(_f32_to_bits(scale) & mask)


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
    """Largest finite |x[i]| for i in [start, stop), as float32 (0 if none)."""
    return _bits_to_f32(np.int64(_span_key(x[start:stop])))


@njit(nogil=True, cache=True, error_model="numpy")
def amax_columns(x, columns, row_start, row_stop, amax):
    """Fold rows [row_start, row_stop) of x viewed as [rows, columns] into per-column
    float32 maxima of the finite |x|. Element-wise across a row, so it vectorises as a
    blend; NaN fails the comparison and inf the bound, so neither enters."""
    inf = np.float32(np.inf)
    for r in range(row_start, row_stop):
        row = x[r * columns : (r + 1) * columns]
        for c in range(row.size):
            a = abs(_load(row, c))
            amax[c] = a if (a > amax[c]) & (a < inf) else amax[c]


@njit(nogil=True, cache=True, error_model="numpy")
def amax_to_scales(amax, fmax, mask, scales):
    for c in range(amax.size):
        scales[c] = scale_from_amax(amax[c], fmax, mask)


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_uniform(x, codes, start, stop, scale, tag):
    """Codes of x[start:stop] under one scale; returns the count of non-finite inputs."""
    p = _encode_params(tag)
    return _quantize_span(x[start:stop], codes[start:stop], scale, p)


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_groups(x, codes, scales, group, group_start, group_stop, tag, mask):
    """Per-group amax, scale and codes for contiguous groups of ``group`` elements.

    One read of each group from memory: the second pass over a group hits the cache.
    """
    p = _encode_params(tag)
    n = x.size
    fmax = p[0]
    bad = 0
    for g in range(group_start, group_stop):
        start = g * group
        stop = min(start + group, n)
        xs = x[start:stop]
        scale = scale_from_amax(_bits_to_f32(np.int64(_span_key(xs))), fmax, mask)
        scales[g] = scale
        bad += _quantize_span(xs, codes[start:stop], scale, p)
    return bad


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_columns(x, codes, scales, columns, row_start, row_stop, tag):
    """Codes of rows [row_start, row_stop) of x viewed as [rows, columns], scale per column."""
    p = _encode_params(tag)
    bad = 0
    for r in range(row_start, row_stop):
        row = x[r * columns : (r + 1) * columns]
        row_codes = codes[r * columns : (r + 1) * columns]
        for c in range(row.size):
            row_codes[c] = _fp8_code(_load(row, c), scales[c], p)
        bad += _count_nonfinite(row_codes, p)
    return bad


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


@njit(inline="always", error_model="numpy")
def _dequantize_span(codes, dp, scale, out):
    for i in range(codes.size):
        _store(out, i, _fp8_to_f32(codes[i], dp) * scale)


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize_uniform(codes, tag, scale, out, start, stop):
    _dequantize_span(codes[start:stop], _decode_params(tag), scale, out[start:stop])


@njit(nogil=True, cache=True, error_model="numpy")
def lookup(codes, table, out, start, stop):
    """out[i] = table[codes[i]]: decoding under one scale, with a 256-entry table of
    output values made by :func:`dequantize_uniform` itself (so the same bits)."""
    c = codes[start:stop]
    o = out[start:stop]
    for i in range(c.size):
        o[i] = table[c[i]]


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
