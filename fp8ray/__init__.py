"""fp8ray: compress LLM KV caches to fp8, scaled, self-describing and checked."""

from .codec import DEFAULT_BLOCK_SIZE, Fp8Codec, decode, encoded_size
from .errors import CorruptFrameError, Fp8rayError, NonFiniteError
from .formats import E4M3FN, E5M2, Fp8Format

__version__ = "0.1.0"

# The engine imports Ray (and the model tools transformers), which take seconds: load
# them on first use only.
_ENGINE = {
    "QuantPool": "fp8ray.pool",
    "QuantWorker": "fp8ray.worker",
    "BlockError": "fp8ray.worker",
    "compress_archive": "fp8ray.operations",
    "decompress_archive": "fp8ray.operations",
    "verify_archive": "fp8ray.operations",
    "inspect_archive": "fp8ray.operations",
    "ArchiveExistsError": "fp8ray.operations",
    "CorruptArchiveError": "fp8ray.archive",
    "SourceError": "fp8ray.sources",
    "fidelity_report": "fp8ray.fidelity",
    "compress_store": "fp8ray.lmcache_store",
    "decompress_store": "fp8ray.lmcache_store",
    "evaluate_modes": "fp8ray.evalmodel",
}


def __getattr__(name: str):
    if name in _ENGINE:
        import importlib

        return getattr(importlib.import_module(_ENGINE[name]), name)
    raise AttributeError(f"module 'fp8ray' has no attribute {name!r}")

__all__ = [
    *_ENGINE,
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
