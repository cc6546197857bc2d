"""The codec layer: pure transforms between tensors (or their raw bytes) and fp8 frames.
No Ray, no files; torch only where a tensor is given or asked for.

- :mod:`~fp8ray.codec.names`: the options' names, values, wire codes and the default
  mode, without torch (what the command line's help needs).
- :mod:`~fp8ray.codec.formats`: fp8 formats, scaling modes, dtypes and their wire codes;
  the scale convention.
- :mod:`~fp8ray.codec.options`: :class:`CodecOptions`, the one options type and default mode.
- :mod:`~fp8ray.codec.frame`: the self-describing, checksummed byte layout and its limits.
- :mod:`~fp8ray.codec.reference`: the plain-torch quantizer, the oracle and the CUDA path.
- :mod:`~fp8ray.codec.kernels`: the numba CPU kernels, bit-identical to the reference.
- :mod:`~fp8ray.codec.cpu`: runs the kernels on a thread pool.
- :mod:`~fp8ray.codec.fp8codec`: :class:`Fp8Codec` and :func:`decode`.
- :mod:`~fp8ray.codec.blocks`: blocks, and the one batch path (``encode_into``, ``decode_into``).
- :mod:`~fp8ray.codec.runs`: runs of same-shape small blocks, coded in one kernel call.
- :mod:`~fp8ray.codec.metrics`: error metrics of a round trip.
- :mod:`~fp8ray.codec.numba_cache`: where numba caches the kernels, where it cannot choose.
"""

from .numba_cache import choose_cache_folder

choose_cache_folder()  # before any kernel module imports numba

# The public names, each loaded from its module on first use: importing a submodule
# (fp8ray.codec.names, for the command line's help) then does not load torch.
_LAZY = {
    "DEFAULT_BLOCK_SIZE": "fp8codec",
    "Fp8Codec": "fp8codec",
    "decode": "fp8codec",
    "decode_raw": "fp8codec",
    "encoded_size": "fp8codec",
    "E4M3FN": "formats",
    "E5M2": "formats",
    "Fp8Format": "formats",
    "DEFAULT_OPTIONS": "options",
    "CodecOptions": "options",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_LAZY)
