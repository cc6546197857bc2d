"""Numba CPU kernels: one pass over memory, no per-element branches, vectorised loops.

Each kernel works on a range (of elements, groups or rows) so that the caller can split
a tensor across threads; all are ``nogil``. Inputs and outputs are flat numpy arrays:
``float32``; ``uint16`` holding bfloat16 bits; ``int16`` holding float16 bits. The
conversions between those and fp32 are done on the bits, in int64 arithmetic (numba
promotes mixed signed/unsigned integers to float, so unsigned types are avoided), and
every selection is written so that LLVM turns it into a vector blend. Where the CPU has
them, the decode widens fp8 codes through its fp16 conversion (x86 F16C), narrows bf16
outputs in one instruction (AVX-512 BF16) and takes the frame's CRC-32C in its loop (SSE
4.2's ``crc32``); each is chosen when a kernel is compiled (for the CPU numba compiles
for, ``NUMBA_CPU_NAME`` and ``NUMBA_CPU_FEATURES`` included), with the same bits: every
NaN decodes to fp32's canonical quiet NaN (then bf16 0x7FC0, fp16 0x7E00) on every route.

Every kernel is compiled with ``error_model="numpy"``: under numba's default ("python")
each division checks for a zero divisor, and that per-element branch stops LLVM from
vectorising any loop whose divisor varies (channel scaling ran 3x slower). Scales are
never zero (see fp8ray.codec.formats), so the check would never fire.

The results must equal :mod:`fp8ray.codec.reference` bit for bit; ``tests/codec/test_kernels.py``
checks that exhaustively where it can (every bf16 and fp16 value, every fp8 code) and
on random data elsewhere.
"""

import hashlib
from pathlib import Path

from numba.core.caching import FunctionCache

from . import bits, decode, encode, search
from .bits import CRC_IN_KERNELS, FORMAT_TAGS, decode_params, format_params, scale_from_amax
from .decode import dequantize_columns, dequantize_groups, dequantize_uniform
from .encode import amax_columns, amax_span, amax_to_scales, quantize_columns, quantize_groups, quantize_uniform
from .search import SEARCH_WIDTH, pad_candidates, quantize_groups_search


def _flush_stale_caches() -> None:
    """Numba keys a cached kernel on the file that defines it, but a kernel here is built
    from the IR of bits.py and vectors.py too, and from the formats' constants: after a
    change to those alone (a pull, a hand edit) it would load the old machine code, wrong
    bits and all. A digest of those sources is kept beside the cache; when it differs,
    every kernel's cache is flushed (each compiles again on first use)."""
    here = Path(__file__).parent
    sources = [*sorted(here.glob("*.py")), here.parent / "formats.py"]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()
    caches = [
        kernel._cache
        for module in (bits, decode, encode, search)
        for kernel in vars(module).values()
        if isinstance(getattr(kernel, "_cache", None), FunctionCache)
    ]
    if not caches:
        return
    stamp = Path(caches[0].cache_path) / "fp8ray-kernel-sources.sha256"
    try:
        if stamp.exists() and stamp.read_text() == digest:
            return
        for cache in caches:
            cache.flush()
        stamp.write_text(digest)
    except OSError:  # a cache numba cannot write either: nothing of ours is in it
        pass


_flush_stale_caches()

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
