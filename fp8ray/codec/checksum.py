"""The frame's CRC-32C (Castagnoli), computed in pieces and combined.

The encoder's threads each take the CRC of the codes they have just written, while those
are still in cache, and :func:`combine` joins the pieces into the CRC of the whole: the
same value as one pass over the frame (the frame's checksum is unchanged), without that
pass. :func:`combine` is zlib's ``crc32_combine`` for the CRC-32C polynomial: the CRC of
``A + B`` is the CRC of ``A`` times ``x**(8 * len(B))`` modulo the polynomial, plus the
CRC of ``B`` (the initial and final inversions cancel).
"""

from __future__ import annotations

import crc32c as _crc32c
import numpy as np
from numba import njit

_POLYNOMIAL = 0x82F63B78  # CRC-32C, bit-reflected
_ONE = 1 << 31  # the polynomial 1, bit-reflected


def crc32c(data, value: int = 0) -> int:
    """The CRC-32C of ``data`` (bytes-like), continuing from ``value``."""
    return _crc32c.crc32c(data, value)


@njit(cache=True)
def _multiply(a, b):
    """``a * b`` modulo the polynomial, both bit-reflected (in int64s); branch-free, as
    the bits are random."""
    product = 0
    for i in range(32):
        product ^= b & -((a >> (31 - i)) & 1)
        b = (b >> 1) ^ (_POLYNOMIAL & -(b & 1))
    return product


@njit(cache=True)
def _combine(crc_a, crc_b, length_b):
    operator, power, n = _ONE, _ONE >> 8, length_b  # 1 and x**8 (one byte)
    while n:  # operator = x**(8 * length_b), by squaring
        if n & 1:
            operator = _multiply(power, operator)
        power = _multiply(power, power)
        n >>= 1
    return _multiply(operator, crc_a) ^ crc_b


def combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32C of ``A + B`` from the CRC-32C of ``A``, that of ``B`` and ``len(B)``
    (a few microseconds, compiled: Python's loops took 27)."""
    return int(_combine(np.int64(crc_a), np.int64(crc_b), np.int64(length_b)))


def combine_all(pieces) -> int:
    """The CRC-32C of the concatenation of pieces given as ``(crc, length)`` in order."""
    total = 0
    for crc, length in pieces:
        total = combine(total, crc, length)
    return total
