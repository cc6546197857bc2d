"""The codec's derived error bound, per element (docs/ACCURACY.md): what ``verify`` holds
every decoded block to, and what the tests check the codec against.

For an element ``x`` decoded as ``y`` under scale ``s`` (1 under scaling ``none``)::

    |y - x| <= r |x| + s * q + u_out |y| + a (|x| + |y|) + h_out + 2**-149

with ``r = u / (1 + u)`` (``u`` the format's unit roundoff: the fp8 rounding of ``x / s``),
``q = 2**(emin_sub - 1)`` (half the format's smallest subnormal: rounding in its
subnormal range, times the scale), ``u_out`` and ``h_out`` the unit roundoff and half the
smallest subnormal of the output dtype (rounding ``fp8 * s`` into it), ``a = 2**-22``
(the two fp32 roundings of ``x / s`` and ``fp8 * s``), and ``2**-149`` for an
fp32-subnormal product. Under scaling ``none`` values beyond the format's range are
clamped on purpose (a scaled mode never clamps a finite value): there ``x`` is taken
clamped to +-finfo.max. Non-finite inputs (kept under ``nonfinite="keep"``) must decode
to non-finite values.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .formats import DTYPE_ITEMSIZES, Fp8Format, dtype_name
from .frame import element_index

if TYPE_CHECKING:
    import torch

ARITHMETIC = 2.0**-22
FP32_SUBNORMAL = 2.0**-149
# Output rounding of each dtype: unit roundoff, and half its smallest subnormal.
OUTPUT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 0.0}
OUTPUT_HALF_SUBNORMAL = {"bfloat16": 2.0**-134, "float16": 2.0**-25, "float32": 2.0**-150}


def bound_constants(fmt: Fp8Format, scaling: str) -> dict[str, float]:
    """The codec's terms of the bound, as an archive records them: ``relative`` (r),
    ``per_scale`` (q) and ``clamp`` (the range a scaling ``none`` input is clamped to, 0
    for the scaled modes); the others depend only on the output dtype and fp32."""
    u = fmt.unit_roundoff
    return {
        "relative": u / (1 + u),
        "per_scale": 2.0 ** (fmt.min_subnormal_exp - 1),
        "clamp": fmt.max if scaling == "none" else 0.0,
    }


# Elements the bound is checked on at a time (:func:`check_within_bound`).
CHECK_ELEMENTS = 1 << 20


def element_scales(scales: torch.Tensor, scaling: str, shape: tuple[int, ...], block_size: int) -> torch.Tensor:
    """The scale that applies to each element, flat, in row-major order."""
    import torch  # the bound is checked on tensors: loaded with them

    numel = math.prod(shape)
    last = shape[-1] if shape else 1
    if scaling == "none":
        return torch.ones(numel, dtype=torch.float32)
    if scaling == "tensor":
        return scales.expand(numel)
    if scaling == "channel":
        return scales.repeat(numel // last if last else 0)
    group = last if scaling == "token" else block_size
    if not numel:
        return scales[:0]
    # Each scale repeated for its group's elements, the last group's as many as it holds:
    # repeat_interleave(group)[:numel] made scales x group elements first (a block size may
    # be 2**32 - 1: gigabytes for a tensor of 15 elements).
    counts = torch.full((scales.numel(),), group, dtype=torch.int64)
    counts[-1] = numel - group * (scales.numel() - 1)
    return scales.repeat_interleave(counts, output_size=numel)


def element_bound(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, constants: dict[str, float]) -> torch.Tensor:
    """The bound on ``|y - x|`` of each element (flat, float64); ``scale`` per element
    (:func:`element_scales`), ``constants`` from :func:`bound_constants`."""
    xa = x.double().abs().reshape(-1)
    ya = y.double().abs().reshape(-1)
    return (
        constants["relative"] * xa
        + scale.double().reshape(-1) * constants["per_scale"]
        + OUTPUT_ROUNDOFF[dtype_name(y.dtype)] * ya
        + ARITHMETIC * (xa + ya)
        + OUTPUT_HALF_SUBNORMAL[dtype_name(y.dtype)]
        + FP32_SUBNORMAL
    )


def check_within_bound(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, constants: dict[str, float]) -> str | None:
    """``None`` when every element of ``y`` is within the bound of ``x``; else what is
    wrong, said of the first element that is not (and how many are not): the bound is per
    element, so a block's norms would not show it. Checked :data:`CHECK_ELEMENTS` at a
    time: the check holds about ten float64 temporaries per element (a 64 MiB bf16 block
    whole took 2.9 GB)."""
    xs, ys, ss = x.reshape(-1), y.reshape(-1), scale.reshape(-1)
    wrong, first = 0, None
    for start in range(0, max(xs.numel(), 1), CHECK_ELEMENTS):
        piece = slice(start, start + CHECK_ELEMENTS)
        count, found = _check_piece(xs[piece], ys[piece], ss[piece], constants)
        wrong += count
        if first is None and found is not None:
            first = (start + found[0], *found[1:])
    if not wrong:
        return None
    i, source, decoded, error, allowed = first
    count = f"{wrong} of {xs.numel()} elements out of their bound; {_first(i, tuple(x.shape))}"
    if error is not None:
        return (
            f"{count}, decodes to {decoded!r} where the source holds {source!r}: an error of {error:.6g}, "
            f"where the codec's derived bound allows {allowed:.6g}"
        )
    return f"{count}, decodes to {decoded!r} where the source holds {source!r}"


def _check_piece(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, constants: dict[str, float]) -> tuple[int, tuple | None]:
    """:func:`check_within_bound` of flat pieces: how many elements are out of their
    bound, and of the first, ``(index, source, decoded, error, bound)`` (error and bound
    None where one of the two is not finite)."""
    import torch

    x64 = x.double()
    finite = torch.isfinite(x64)
    if constants.get("clamp"):
        x64 = x64.clamp(-constants["clamp"], constants["clamp"])
    target = x64.where(finite, torch.zeros((), dtype=torch.float64))
    y64 = y.double()
    bound = element_bound(target, y, scale, constants).where(finite, torch.zeros((), dtype=torch.float64))  # |y| inf there
    diff = (y64 - target).where(finite, torch.zeros((), dtype=torch.float64))
    # y is finite where x is, and only there. (Not by boolean indexing: y64[finite] cost
    # 0.6 ms a block of 4096, 75% of verify --against on an archive of small blocks.)
    y_finite = torch.isfinite(y64)
    within = diff.abs() <= bound
    if bool(within.all()) and y_finite.equal(finite):
        return 0, None
    wrong = ~within | (y_finite != finite)
    i = int(wrong.nonzero()[0, 0])
    both_finite = bool(finite[i]) and bool(y_finite[i])
    error, allowed = (abs(float(diff[i])), float(bound[i])) if both_finite else (None, None)
    return int(wrong.sum()), (i, float(x[i]), float(y64[i]), error, allowed)


def check_identical(source: np.ndarray, stored: np.ndarray, dtype: str, shape: tuple[int, ...]) -> str | None:
    """``None`` when a stored frame's bytes (``stored``) are the source's (``source``, both
    uint8 arrays of a ``shape`` tensor of ``dtype``): a stored frame's bound is exactness;
    else how many elements differ and the first, by its bits."""
    if np.array_equal(source, stored):
        return None
    itemsize = DTYPE_ITEMSIZES[dtype]
    words = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    differs = source.view(words) != stored.view(words)
    i = int(np.flatnonzero(differs)[0])
    first = _first(i, shape)
    digits = 2 * itemsize + 2  # 0x and two hex digits a byte

    def bits(array: np.ndarray) -> str:
        return f"{int(array.view(words)[i]):#0{digits}x}"

    return (
        f"{int(differs.sum())} of {differs.size} {dtype} elements differ from the source, which the stored frame holds "
        f"exactly; {first}: bits {bits(stored)}, the source's {bits(source)}"
    )


def _first(i: int, shape: tuple[int, ...]) -> str:
    """The first wrong element, flat index ``i`` of a ``shape`` tensor, as the messages name it."""
    return f"the first, element {element_index(i, shape)}" if shape else "the only one"
