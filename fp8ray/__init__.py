"""fp8ray: compress LLM KV caches to fp8, scaled, self-describing and checked.

The layers, each importing only those above it in this list (an import-linter contract
in pyproject.toml enforces it):

- ``fp8ray.errors``: every exception class.
- ``fp8ray.codec``: pure transforms (formats, options, frame, kernels, ``Fp8Codec``).
- ``fp8ray.io``: sources and sinks (paths, safetensors, blocks, archives, LMCache stores).
- ``fp8ray.lmcache``: fp8ray inside LMCache (the serde pairs, ``register()``, store-file
  conversion).
- ``fp8ray.engine`` (Ray), ``fp8ray.eval`` (models, fidelity) and ``fp8ray.data`` (Ray
  Data callables), side by side.
- ``fp8ray.serve``, ``fp8ray.bench``, ``fp8ray.cli``: entry points.
"""

from .errors import (
    ArchiveExistsError,
    BadInputError,
    BlockError,
    CorruptArchiveError,
    CorruptFrameError,
    Fp8rayError,
    NonFiniteError,
    SourceError,
    WorkerLostError,
)

__version__ = "0.1.0"

# The codec's tensor paths import torch, the engine Ray, the eval layer transformers, each taking
# seconds: load them on first use only (``import fp8ray`` and ``fp8ray --help`` stay fast).
_LAZY = {
    **dict.fromkeys(
        (
            "DEFAULT_BLOCK_SIZE",
            "E4M3FN",
            "E5M2",
            "CodecOptions",
            "Fp8Codec",
            "Fp8Format",
            "decode",
            "decode_raw",
            "encoded_size",
        ),
        "fp8ray.codec",
    ),
    "QuantPool": "fp8ray.engine.pool",
    "PoolSettings": "fp8ray.engine.pool",
    "QuantWorker": "fp8ray.engine.worker",
    "compress_archive": "fp8ray.engine.archives",
    "decompress_archive": "fp8ray.engine.archives",
    "verify_archive": "fp8ray.engine.archives",
    "inspect_archive": "fp8ray.engine.archives",
    "open_archive": "fp8ray.io.reader",
    "compress_store": "fp8ray.engine.stores",
    "decompress_store": "fp8ray.engine.stores",
    "fidelity_report": "fp8ray.eval.fidelity",
    "evaluate_modes": "fp8ray.eval.eval_model",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fp8ray' has no attribute {name!r}")


__all__ = [
    *_LAZY,
    "ArchiveExistsError",
    "BadInputError",
    "BlockError",
    "CorruptArchiveError",
    "CorruptFrameError",
    "Fp8rayError",
    "NonFiniteError",
    "SourceError",
    "WorkerLostError",
    "__version__",
]
