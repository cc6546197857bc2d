"""Numba CPU kernels: one pass over memory, no per-element branches, vectorised loops.

Each kernel works on a range (of elements, groups or rows) so that the caller can split
a tensor across threads; all are ``nogil``. Inputs and outputs are flat numpy arrays:
``float32``; ``uint16`` holding bfloat16 bits; ``int16`` holding float16 bits. The
conversions between those and fp32 are done on the bits, in int64 arithmetic (numba
promotes mixed signed/unsigned integers to float, so unsigned types are avoided), and
every selection is written so that LLVM turns it into a vector blend. Where the CPU has
them, the decode widens fp8 codes through its fp16 conversion (x86 F16C), narrows bf16
outputs in one instruction (AVX-512 BF16) and takes the frame's CRC-32C in its loop (SSE
4.2's ``crc32``); each is chosen when a kernel is compiled, and the bits are the same.

Every kernel is compiled with ``error_model="numpy"``: under numba's default ("python")
each division checks for a zero divisor, and that per-element branch stops LLVM from
vectorising any loop whose divisor varies (channel scaling ran 3x slower). Scales are
never zero (see fp8ray.codec.formats), so the check would never fire.

The results must equal :mod:`fp8ray.codec.reference` bit for bit; ``tests/codec/test_kernels.py``
checks that exhaustively where it can (every bf16 and fp16 value, every fp8 code) and
on random data elsewhere.
"""

from .bits import CRC_IN_KERNELS, FORMAT_TAGS, decode_params, format_params, scale_from_amax
from .decode import dequantize_columns, dequantize_groups, dequantize_uniform
from .encode import amax_columns, amax_span, amax_to_scales, quantize_columns, quantize_groups, quantize_uniform
from .search import SEARCH_WIDTH, pad_candidates, quantize_groups_search

__all__ = [
    "CRC_IN_KERNELS",
    "FORMAT_TAGS",
    "SEARCH_WIDTH",
    "amax_columns",
    "amax_span",
    "amax_to_scales",
    "decode_params",
    "dequantize_columns",
    "dequantize_groups",
    "dequantize_uniform",
    "format_params",
    "pad_candidates",
    "quantize_columns",
    "quantize_groups",
    "quantize_groups_search",
    "quantize_uniform",
    "scale_from_amax",
]
