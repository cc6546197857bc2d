"""fp8ray inside LMCache (``lmcache/v1/distributed/serde/``): two serde pairs, the
registration of the second as an LMCache serde type, and the per-file conversion of
LMCache's filesystem stores. A layer of its own, above ``codec`` and ``io`` and below
``engine``; it needs neither Ray nor, until :func:`register` runs, LMCache.

LMCache's sync serde interface is ``Serializer.serialize(src, dst, key) -> int``,
``Serializer.estimate_serialized_size(layout_desc) -> int`` and
``Deserializer.deserialize(src, dst, key)``; ``src``/``dst`` are ``MemoryObj`` s (a KV
object, or a flat uint8 byte buffer sized by the estimate) and ``key`` the chunk's
``ObjectKey``. Both pairs accept the key and ignore it (it may be left out, as in
LMCache's older two-argument calls). Both also take tensors directly, for callers
without LMCache's objects: ``serialize_tensors(tensors, buffer) -> int``,
``serialized_size([(shape, dtype), ...])`` and ``deserialize_tensors(buffer, tensors)``.

- :mod:`~fp8ray.lmcache.objects`: how LMCache's memory objects, layouts and groups are read.
- :mod:`~fp8ray.lmcache.seed`: :class:`Fp8QuantizationSerializer` /
  :class:`Fp8QuantizationDeserializer`, drop-in replacements for LMCache's ``"fp8"``
  serde, byte-identical to it wherever its cast is finite; :func:`make_fp8_serde`.
- :mod:`~fp8ray.lmcache.frames`: :class:`Fp8FrameSerializer` /
  :class:`Fp8FrameDeserializer` (and the group pair), fp8ray's scaled, checked frames.
- :mod:`~fp8ray.lmcache.settings`: :func:`serde_options`, what an adapter's ``"serde"``
  kwargs ask of the registered type.
- :mod:`~fp8ray.lmcache.registry`: :func:`register` (serde type ``"fp8ray"``, with the
  exact size contract where LMCache has one) and the pairs as LMCache's own classes.
- :mod:`~fp8ray.lmcache.store_files`: converting an LMCache filesystem store's chunk
  files between forms, and into and out of an archive's frames (the file names, layouts
  and forms are :mod:`fp8ray.io.lmcache_store`'s).
"""

from .frames import (
    FP8_INPUT_POLICIES,
    Fp8FrameDeserializer,
    Fp8FrameMultiDeserializer,
    Fp8FrameMultiSerializer,
    Fp8FrameSerializer,
    read_frame_header,
)
from .objects import MemoryLayoutDesc
from .registry import (
    SERDE_TYPE,
    exact_size_contract,
    lmcache_multi_serde_classes,
    lmcache_serde_classes,
    make_serde_processor,
    register,
)
from .seed import Fp8QuantizationDeserializer, Fp8QuantizationSerializer, make_fp8_serde
from .settings import SerdeSettings, serde_options

__all__ = [
    "FP8_INPUT_POLICIES",
    "SERDE_TYPE",
    "Fp8FrameDeserializer",
    "Fp8FrameMultiDeserializer",
    "Fp8FrameMultiSerializer",
    "Fp8FrameSerializer",
    "Fp8QuantizationDeserializer",
    "Fp8QuantizationSerializer",
    "MemoryLayoutDesc",
    "SerdeSettings",
    "exact_size_contract",
    "lmcache_multi_serde_classes",
    "lmcache_serde_classes",
    "make_fp8_serde",
    "make_serde_processor",
    "read_frame_header",
    "register",
    "serde_options",
]
