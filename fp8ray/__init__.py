"""fp8ray: compress LLM KV caches to fp8, scaled, self-describing and checked."""

from .codec import DEFAULT_BLOCK_SIZE, Fp8Codec, decode, encoded_size
from .errors import CorruptFrameError, Fp8rayError, NonFiniteError
from .formats import E4M3FN, E5M2, Fp8Format

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "E4M3FN",
    "E5M2",
    "CorruptFrameError",
    "Fp8Codec",
    "Fp8Format",
    "Fp8rayError",
    "NonFiniteError",
    "__version__",
    "decode",
    "encoded_size",
]
