"""The codec layer: pure transforms between tensors and fp8 frames. No Ray, no files.

- :mod:`~fp8ray.codec.formats`: fp8 formats, scaling modes, dtypes and their wire codes;
  the scale convention.
- :mod:`~fp8ray.codec.options`: :class:`CodecOptions`, the one options type and default mode.
- :mod:`~fp8ray.codec.frame`: the self-describing, checksummed byte layout and its limits.
- :mod:`~fp8ray.codec.reference`: the plain-torch quantizer, the oracle and the CUDA path.
- :mod:`~fp8ray.codec.kernels`: the numba CPU kernels, bit-identical to the reference.
- :mod:`~fp8ray.codec.cpu`: runs the kernels on a thread pool.
- :mod:`~fp8ray.codec.fp8codec`: :class:`Fp8Codec` and :func:`decode`.
- :mod:`~fp8ray.codec.blocks`: blocks, and the one batch path (``encode_into``, ``decode_into``).
- :mod:`~fp8ray.codec.metrics`: error metrics of a round trip.
"""

from .fp8codec import DEFAULT_BLOCK_SIZE, Fp8Codec, decode, encoded_size
from .formats import E4M3FN, E5M2, Fp8Format
from .options import DEFAULT_OPTIONS, CodecOptions

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_OPTIONS",
    "E4M3FN",
    "E5M2",
    "CodecOptions",
    "Fp8Codec",
    "Fp8Format",
    "decode",
    "encoded_size",
]
