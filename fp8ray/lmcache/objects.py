"""LMCache's memory objects as the serdes read them: the tensors of a KV object, the bytes
of a serialized buffer, a layout's shapes and dtypes, and groups of objects.

LMCache hands a serde ``MemoryObj`` s: a KV object (one tensor per kernel group of its
object group, ``layout_desc.shapes``/``dtypes``, read through ``get_tensor(i)``) or a flat
uint8 byte buffer sized by the serde's estimate. Any object with a ``.tensor`` works as
an object of one tensor; callers without objects (the store-file conversion) hand the
serdes' ``serialize_tensors``/``deserialize_tensors`` tensors instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..codec.formats import DTYPES
from ..codec.fp8codec import not_dense
from ..errors import BadInputError

Shape = tuple[int, ...]


@dataclass
class MemoryLayoutDesc:
    """The layout LMCache describes a memory object with: one shape and dtype per tensor
    (kernel group), in order. Like LMCache's, lists of unequal length raise ``ValueError``
    (a :class:`~fp8ray.errors.BadInputError`)."""

    shapes: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)

    def __post_init__(self):
        if len(self.shapes) != len(self.dtypes):
            raise BadInputError(
                f"MemoryLayoutDesc: shapes and dtypes must have the same length "
                f"(got {len(self.shapes)} shapes and {len(self.dtypes)} dtypes)"
            )


def layout_pairs(layout_desc) -> list[tuple[Shape, torch.dtype]]:
    """``(shape, dtype)`` per tensor of a layout (fp8ray's or LMCache's)."""
    shapes, dtypes = list(layout_desc.shapes), list(layout_desc.dtypes)
    if len(shapes) != len(dtypes):
        raise BadInputError(f"layout has {len(shapes)} shapes but {len(dtypes)} dtypes")
    for i, dtype in enumerate(dtypes):
        if not isinstance(dtype, torch.dtype):  # LMCache's layouts hold torch dtypes, never names
            raise TypeError(f"layout dtype {i} is {dtype!r}, not a torch dtype (torch.bfloat16, ...)")
    return [(tuple(int(d) for d in shape), dtype) for shape, dtype in zip(shapes, dtypes)]


def kv_tensors(obj) -> list[torch.Tensor]:
    """The tensors of a KV object, one per (shape, dtype) of its layout, in order.

    LMCache's ``MemoryObj.tensor`` views the whole object with its *first* shape, which
    fails when the object holds several kernel groups; those are read with
    ``get_tensor(i)``. Objects with only ``.tensor`` (any duck type) hold one tensor.
    """
    count = 1
    get_shapes = getattr(obj, "get_shapes", None)
    if callable(get_shapes) and callable(getattr(obj, "get_tensor", None)):
        try:
            count = len(get_shapes())
        except (AssertionError, AttributeError, TypeError):  # no per-group layout recorded
            count = 1
    tensors = [obj.get_tensor(i) for i in range(count)] if count > 1 else [getattr(obj, "tensor", None)]
    if any(t is None for t in tensors):
        raise BadInputError("Fp8 serde requires src and dst to have tensors")
    return tensors


def byte_view(t: torch.Tensor | None, role: str) -> torch.Tensor:
    """A serialized buffer (``obj.tensor`` of a byte buffer object) as a flat uint8 tensor
    over the same memory, refused where writes would be lost (a copy) or the elements are
    not bytes."""
    if t is None:
        raise BadInputError("Fp8 serde requires src and dst to have tensors")
    if not isinstance(t, torch.Tensor):  # wrapping would hide whether writes land in the caller's memory
        raise BadInputError(
            f"{role} must be a torch tensor of 1-byte elements, got {type(t).__name__} "
            "(torch.frombuffer or torch.from_numpy wraps a writable buffer without a copy)"
        )
    check_dense(t, role)
    if t.element_size() != 1:
        raise BadInputError(f"{role} must be a 1-byte buffer (e.g. uint8), got a {t.dtype} tensor")
    if not t.is_contiguous():
        # reshape(-1) of a non-contiguous tensor is a copy: written bytes would be lost.
        raise BadInputError(f"{role} tensor must be contiguous, or the written bytes would land in a copy")
    return t.view(torch.uint8).reshape(-1)


def check_dense(t: torch.Tensor, role: str) -> None:
    """Refuse a ``role`` tensor with no dense memory to read or write: a meta one (its
    writes went nowhere and the serde said it had written them), a sparse or nested one."""
    kind = not_dense(t)
    if kind is not None:
        raise BadInputError(f"{role} tensor is a {kind} tensor: the Fp8 serde takes dense ones (tensor.to_dense())")
    if t.device.type == "meta":
        raise BadInputError(f"{role} tensor is a meta tensor: it has no data")


def check_dtype(t: torch.Tensor) -> None:
    """Refuse a source tensor of a dtype the codec does not encode."""
    if t.dtype not in DTYPES:
        raise TypeError(f"src tensor has unsupported dtype {t.dtype}; expected bfloat16, float16 or float32")


def is_group(obj) -> bool:
    """Whether ``obj`` is a group of objects (LMCache's ``MemoryObjGroup`` or
    ``LayoutDescGroup``: a tuple, one slot per object, e.g. K then V)."""
    return isinstance(obj, (tuple, list))


def check_group(group, group_size: int | None, role: str) -> None:
    """Refuse a group of another size than the serde's (``None``: any size)."""
    if group_size is not None and len(group) != group_size:
        raise BadInputError(f"the {role} group has {len(group)} slots; this serde takes groups of {group_size}")


def one_byte(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one byte per element (uint8, int8, a float8), as a tensor already in fp8 is."""
    return dtype != torch.bool and dtype.itemsize == 1
