"""fp8ray's frame serde as LMCache's serde type ``"fp8ray"``: :func:`register`, the factory
it registers, the size contract it declares, and the frame pairs as subclasses of
LMCache's own base classes.

An L2 adapter's ``{"serde": {"type": "fp8ray", ...}}`` then builds an
``AsyncSerdeProcessor`` over the frame pair (:func:`make_serde_processor`). Where the
installed LMCache's ``register_serde_factory`` takes a ``size_contract`` (LMCache after
0.5.6), the serde is registered with ``SerdeSizeContract.EXACT``, so every L2 adapter (S3
and Valkey too) accepts it; on 0.5.6, which has no contract, it is registered without
one. ``lmcache`` is imported only when one of these functions runs (it is optional), so
the package loads without it; the subclasses are built on first use for the same reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from ..errors import BadInputError
from .frames import Fp8FrameDeserializer, Fp8FrameMultiDeserializer, Fp8FrameMultiSerializer, Fp8FrameSerializer
from .install import INSTALL_COMMAND
from .settings import serde_options

SERDE_TYPE = "fp8ray"  # the name register() gives the frame serde in LMCache by default


def _lmcache_serde():
    """LMCache's serde package, or an ImportError saying which package is missing."""
    try:
        from lmcache.v1.distributed import serde
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        if missing == "lmcache" or missing.startswith("lmcache."):
            reason = f"the 'lmcache' package is not installed ({INSTALL_COMMAND})"
        else:
            reason = f"the 'lmcache' package failed to import: it needs {missing!r}, which is not installed ({exc})"
        raise ImportError(f"fp8ray's LMCache serde needs LMCache: {reason}", name=missing) from exc
    return serde


_CLASSES: tuple[type, type] | None = None
_MULTI_CLASSES: tuple[type, type] | None = None


def lmcache_serde_classes() -> tuple[type, type]:
    """The frame pair as subclasses of LMCache's own ``Serializer`` and ``Deserializer``
    (built on first use, as LMCache is optional)."""
    global _CLASSES
    if _CLASSES is None:
        serde = _lmcache_serde()

        class LMCacheFp8FrameSerializer(Fp8FrameSerializer, serde.Serializer):
            """:class:`Fp8FrameSerializer`, an LMCache ``Serializer``."""

        class LMCacheFp8FrameDeserializer(Fp8FrameDeserializer, serde.Deserializer):
            """:class:`Fp8FrameDeserializer`, an LMCache ``Deserializer``."""

        _CLASSES = (LMCacheFp8FrameSerializer, LMCacheFp8FrameDeserializer)
    return _CLASSES


def lmcache_multi_serde_classes() -> tuple[type, type]:
    """The group pair (:class:`Fp8FrameMultiSerializer`, :class:`Fp8FrameMultiDeserializer`)
    as subclasses of LMCache's ``MultiSerializer`` and ``MultiDeserializer``; an
    ``ImportError`` where the installed LMCache has no multi serde interface."""
    global _MULTI_CLASSES
    if _MULTI_CLASSES is None:
        serde = _lmcache_serde()
        multi_ser, multi_de = getattr(serde, "MultiSerializer", None), getattr(serde, "MultiDeserializer", None)
        if multi_ser is None or multi_de is None:
            raise ImportError("fp8ray's group serde needs LMCache's MultiSerializer, which the installed lmcache lacks")

        class LMCacheFp8FrameMultiSerializer(Fp8FrameMultiSerializer, multi_ser):
            """:class:`Fp8FrameMultiSerializer`, an LMCache ``MultiSerializer``."""

        class LMCacheFp8FrameMultiDeserializer(Fp8FrameMultiDeserializer, multi_de):
            """:class:`Fp8FrameMultiDeserializer`, an LMCache ``MultiDeserializer``."""

        _MULTI_CLASSES = (LMCacheFp8FrameMultiSerializer, LMCacheFp8FrameMultiDeserializer)
    return _MULTI_CLASSES


def make_serde_processor(kwargs: Mapping[str, object] | None = None):
    """LMCache serde factory: an ``AsyncSerdeProcessor`` over the frame pair, from the
    adapter's ``"serde"`` kwargs (:func:`~fp8ray.lmcache.settings.serde_options`)."""
    settings = serde_options(kwargs)  # refuse bad options before anything starts
    serializer, deserializer = lmcache_serde_classes()
    serde = _lmcache_serde()
    return serde.AsyncSerdeProcessor(
        serializer(settings.options, settings.fp8_input),
        deserializer(settings.options, settings.fp8_input),
        max_workers=settings.max_workers,
    )


def exact_size_contract(serde=None):
    """What to pass as ``size_contract`` to the installed LMCache's
    ``register_serde_factory``: its ``SerdeSizeContract.EXACT`` where the function takes
    that keyword (LMCache after 0.5.6), else ``None`` (0.5.6: no contract to declare).
    Detected by feature, not by version: ``serde`` is LMCache's serde package (or an
    object shaped like it), imported when not given."""
    serde = serde if serde is not None else _lmcache_serde()
    contract = getattr(serde, "SerdeSizeContract", None)
    if contract is None:
        contract = getattr(getattr(serde, "base", None), "SerdeSizeContract", None)
    exact = getattr(contract, "EXACT", None)
    if exact is None:
        return None
    try:
        params = inspect.signature(serde.register_serde_factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read: do not guess
        return None
    if any((p.name == "size_contract" and p.kind is not p.POSITIONAL_ONLY) or p.kind is p.VAR_KEYWORD for p in params):
        return exact
    return None


def _registered_factory(serde, name: str):
    registry = getattr(getattr(serde, "factory", None), "_SERDE_FACTORY_REGISTRY", None)
    if registry is None:
        registry = getattr(serde, "_SERDE_FACTORY_REGISTRY", {})
    return registry.get(name)


def register(name: str = SERDE_TYPE):
    """Register the frame serde with LMCache as serde type ``name`` (``register_serde_factory``).

    Where the installed LMCache's ``register_serde_factory`` takes ``size_contract``, the
    serde is declared ``SerdeSizeContract.EXACT`` (its estimate is what it writes), so
    LMCache accepts it with every L2 adapter, not only ``fs``; on LMCache 0.5.6 it is
    registered without one, as that version has none. Returns the contract declared, or
    ``None`` where the installed LMCache has none.

    Call it in the LMCache process before its L2 adapters are built (docs/LMCACHE.md);
    a second call with the same name is a no-op. Raises ``ImportError`` naming the
    missing package when LMCache cannot be imported, and a ``ValueError``
    (:class:`~fp8ray.errors.BadInputError`) when ``name`` is taken by another serde
    (LMCache's own ``"fp8"``, say).
    """
    if not isinstance(name, str) or not name:
        raise BadInputError(f"a serde type name must be a non-empty string, got {name!r}", field="name")
    serde = _lmcache_serde()
    contract = exact_size_contract(serde)
    if name in serde.get_registered_serde_types():
        registered = _registered_factory(serde, name)
        if (
            getattr(registered, "__module__", None) == __name__
            and getattr(registered, "__name__", None) == "make_serde_processor"
        ):
            return contract  # ours already (a second call, or this module loaded again)
        raise BadInputError(
            f"LMCache serde type {name!r} is already registered by another factory; choose another name", field="name"
        )
    if contract is None:
        serde.register_serde_factory(name, make_serde_processor)
    else:
        serde.register_serde_factory(name, make_serde_processor, size_contract=contract)
    return contract
