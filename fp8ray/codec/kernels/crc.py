"""CRC-32C by carry-less multiplication, on x86 CPUs with VPCLMULQDQ (AVX-512): 64 bytes
at a time in four independent running remainders, where SSE 4.2's ``crc32`` instruction
(the ``crc32c`` library's way) takes 8 bytes a cycle at most, one core's two threads
sharing that one unit.

A CRC is the message's polynomial times x**32 modulo the CRC's polynomial P, so any part
of the message can be replaced by anything congruent to it modulo P. Folding does that:
a 128-bit piece A followed by D more bits is replaced by ``A_lo * (x**(D + 31) mod P) +
A_hi * (x**(D - 33) mod P)`` (carry-less products, bit-reflected as CRC-32C is, 96 bits
at most), which is added into the 128 bits D further on. The last 128 bits left, and the
bytes past the last 64, go through ``crc32``. The constants are those of Intel's "Fast
CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction" (2009), derived
here from P (:func:`_fold_constants`); ``tests/codec/test_checksum.py`` compares with the
``crc32c`` library over lengths and starting values.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .bits import _FEATURES, CRC_IN_KERNELS, emit_crc32c

FOLD_CRC = CRC_IN_KERNELS and all(f"+{name}" in _FEATURES for name in ("avx512f", "vpclmulqdq"))
_POLYNOMIAL = 0x11EDC6F41  # CRC-32C's P, x**32 + ..., bit i the coefficient of x**i
_BLOCK = 64  # bytes a vector
_STREAMS = 4  # running remainders, 64 bytes apart: a product's latency is hidden
_I64 = ir.IntType(64)
_Z = ir.VectorType(_I64, _BLOCK // 8)


def _power_of_x(exponent: int) -> int:
    remainder = 1
    for _ in range(exponent):
        remainder <<= 1
        if remainder >> 32:
            remainder ^= _POLYNOMIAL
    return remainder


def _reflected(value: int) -> int:
    return int(f"{value:032b}"[::-1], 2)


def _fold_constants(distance: int) -> tuple[int, int]:
    """The multipliers of a 128-bit piece's first and second 64 bits that move it
    ``distance`` bits on (both bit-reflected, as the message's bytes are)."""
    return _reflected(_power_of_x(distance + 31)), _reflected(_power_of_x(distance - 33))


def _constants(*distances) -> ir.Constant:
    """A vector folding each of its four 128-bit lanes by its own distance (0: not at all)."""
    lanes = [(0, 0) if d == 0 else _fold_constants(d) for d in distances]
    return ir.Constant(_Z, [k for lane in lanes for k in lane])


def _fold(builder, z, constants):
    """The carry-less products of each lane's halves by its constants, added: ``z``
    folded on (:func:`_constants`)."""
    product = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_Z, [_Z, _Z, ir.IntType(8)]), "llvm.x86.pclmulqdq.512"
    )
    low = builder.call(product, [z, constants, ir.Constant(ir.IntType(8), 0x00)])
    high = builder.call(product, [z, constants, ir.Constant(ir.IntType(8), 0x11)])
    return builder.xor(low, high)


@intrinsic
def crc32c_update(typingctx, data, running):
    """The running CRC-32C (uninverted, int64) after the bytes of ``data`` (a contiguous
    uint8 array of at least 256 bytes, :data:`FOLD_CRC` true), from ``running``."""
    if not (isinstance(data, types.Array) and data.dtype == types.uint8 and data.layout == "C" and running == types.int64):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        n = builder.extract_value(array.shape, 0)
        blocks = builder.udiv(n, n.type(_BLOCK))
        vectors = builder.bitcast(array.data, _Z.as_pointer())

        def block(i):
            return builder.load(builder.gep(vectors, [i]), align=1)

        # The running value enters as the first 4 bytes' sum with it (a CRC is linear).
        start = builder.insert_element(
            ir.Constant(_Z, [0] * 8), builder.and_(args[1], _I64(0xFFFFFFFF)), ir.Constant(ir.IntType(32), 0)
        )
        streams = [cgutils.alloca_once_value(builder, block(_I64(k))) for k in range(_STREAMS)]
        builder.store(builder.xor(builder.load(streams[0]), start), streams[0])
        apart = _constants(*[_STREAMS * 512] * 4)
        rounds = builder.udiv(blocks, blocks.type(_STREAMS))
        with cgutils.for_range(builder, builder.sub(rounds, rounds.type(1))) as loop:
            first = builder.mul(builder.add(loop.index, loop.index.type(1)), loop.index.type(_STREAMS))
            for k, stream in enumerate(streams):
                builder.store(
                    builder.xor(_fold(builder, builder.load(stream), apart), block(builder.add(first, first.type(k)))), stream
                )
        z = cgutils.alloca_once_value(builder, builder.load(streams[-1]))
        for k, stream in enumerate(streams[:-1]):
            distance = (_STREAMS - 1 - k) * 512
            builder.store(builder.xor(builder.load(z), _fold(builder, builder.load(stream), _constants(*[distance] * 4))), z)
        next_block = _constants(*[512] * 4)
        with cgutils.for_range(builder, builder.sub(blocks, builder.mul(rounds, rounds.type(_STREAMS)))) as loop:
            i = builder.add(builder.mul(rounds, rounds.type(_STREAMS)), loop.index)
            builder.store(builder.xor(_fold(builder, builder.load(z), next_block), block(i)), z)
        # The four lanes onto the last: 384, 256 and 128 bits on; then its 128 bits by crc32.
        last = builder.load(z)
        lanes = builder.xor(
            _fold(builder, last, _constants(384, 256, 128, 0)), builder.and_(last, ir.Constant(_Z, [0] * 6 + [-1, -1]))
        )
        words = [builder.extract_element(lanes, ir.Constant(ir.IntType(32), j)) for j in range(8)]
        low = builder.xor(builder.xor(words[0], words[2]), builder.xor(words[4], words[6]))
        high = builder.xor(builder.xor(words[1], words[3]), builder.xor(words[5], words[7]))
        crc = cgutils.alloca_once_value(builder, emit_crc32c(builder, emit_crc32c(builder, _I64(0), low), high))
        bytes_ptr = builder.bitcast(array.data, ir.IntType(8).as_pointer())
        done = builder.mul(blocks, blocks.type(_BLOCK))
        with cgutils.for_range(builder, builder.sub(n, done)) as loop:  # fewer than 64
            byte = builder.load(builder.gep(bytes_ptr, [builder.add(done, loop.index)]))
            builder.store(emit_crc32c(builder, builder.load(crc), byte), crc)
        return builder.load(crc)

    return types.int64(data, running), codegen


@njit(nogil=True, cache=True)
def crc32c_fold(data, running):
    """:func:`crc32c_update` (``data`` of at least 256 bytes)."""
    return crc32c_update(data, running)
