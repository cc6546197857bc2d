"""Error metrics between original tensors and their fp8 round trips: the one
implementation that verify, fidelity and eval-model use.

Metrics of a group G of elements (a tensor, a layer's K, a whole cache), with ``x`` the
original and ``y`` the decoded value, from sums accumulated in float64::

    rel_fro = sqrt( sum_G (y - x)^2 / sum_G x^2 )
    max_abs = max_G |y - x|
    snr_db  = 10 log10( sum_G x^2 / sum_G (y - x)^2 )
    cosine  = sum_G x y / sqrt( sum_G x^2 * sum_G y^2 )

A group's metrics come from the sums over all its elements, never from a mean of its
members' ratios, so a large tensor weighs as much as its elements do. Edge cases: no
error gives ``rel_fro`` 0 and ``snr_db`` +inf; an all-zero original with an error gives
``rel_fro`` +inf and ``snr_db`` -inf; ``cosine`` is 1 when both are zero and 0 when
exactly one is. Elements whose original is not finite (a NaN or infinity kept by
``nonfinite="keep"``) are left out of the sums: the bound (:mod:`fp8ray.codec.bound`)
checks them apart, as values that must decode to non-finite ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import MismatchError

if TYPE_CHECKING:
    import torch


# Elements summed at a time by error_sums.
SUM_ELEMENTS = 1 << 22


@dataclass
class ErrorSums:
    """Running sums over a group of elements, from which its metrics follow exactly."""

    elements: int = 0
    err2: float = 0.0  # sum (y - x)^2
    ref2: float = 0.0  # sum x^2
    dec2: float = 0.0  # sum y^2
    dot: float = 0.0  # sum x y
    max_abs: float = 0.0

    def add(self, other: ErrorSums) -> None:
        self.elements += other.elements
        self.err2 += other.err2
        self.ref2 += other.ref2
        self.dec2 += other.dec2
        self.dot += other.dot
        self.max_abs = max(self.max_abs, other.max_abs)

    @property
    def rel_fro(self) -> float:
        return relative_error(self.err2, self.ref2)

    def metrics(self) -> dict:
        """``rel_fro``, ``max_abs``, ``snr_db``, ``cosine`` and ``elements``."""
        if self.err2 == 0:
            snr = math.inf
        elif self.ref2 == 0:
            snr = -math.inf
        else:
            snr = 10 * math.log10(self.ref2 / self.err2)
        if self.ref2 == 0 and self.dec2 == 0:
            cosine = 1.0
        elif self.ref2 == 0 or self.dec2 == 0:
            cosine = 0.0
        else:
            cosine = self.dot / math.sqrt(self.ref2 * self.dec2)
        return {"rel_fro": self.rel_fro, "max_abs": self.max_abs, "snr_db": snr, "cosine": cosine, "elements": self.elements}


def relative_error(err2: float, ref2: float) -> float:
    """``sqrt(err2 / ref2)``: 0 when there is no error, +inf for an error on zeros."""
    if err2 == 0:
        return 0.0
    return math.sqrt(err2 / ref2) if ref2 else math.inf


def row_sums(original: torch.Tensor, decoded: torch.Tensor) -> list[ErrorSums]:
    """:class:`ErrorSums` of each row of two ``[rows, n]`` tensors (any float dtype)."""
    if original.shape != decoded.shape:
        raise MismatchError(f"shapes differ: original {tuple(original.shape)}, decoded {tuple(decoded.shape)}")
    import torch  # loaded already: the caller has tensors

    x, y = original.double(), decoded.double()
    finite = torch.isfinite(x)
    if not bool(finite.all()):  # kept non-finite values: out of the sums (module docstring)
        zero = torch.zeros((), dtype=torch.float64)
        x, y = x.where(finite, zero), y.where(finite, zero)
    diff = y - x
    err2, ref2, dec2, dot = (diff * diff).sum(1), (x * x).sum(1), (y * y).sum(1), (x * y).sum(1)
    max_abs = diff.abs().amax(1) if x.shape[1] else torch.zeros(x.shape[0], dtype=torch.float64)
    return [
        ErrorSums(int(x.shape[1]), float(err2[i]), float(ref2[i]), float(dec2[i]), float(dot[i]), float(max_abs[i]))
        for i in range(x.shape[0])
    ]


def error_sums(original: torch.Tensor, decoded: torch.Tensor) -> ErrorSums:
    """:class:`ErrorSums` of a whole tensor against its round trip (same shape), summed
    :data:`SUM_ELEMENTS` at a time: each sum holds float64 copies of its elements (a
    block of a billion whole: tens of GB)."""
    if original.shape != decoded.shape:
        raise MismatchError(f"shapes differ: original {tuple(original.shape)}, decoded {tuple(decoded.shape)}")
    x, y = original.reshape(1, -1), decoded.reshape(1, -1)
    sums = ErrorSums()
    for start in range(0, max(x.shape[1], 1), SUM_ELEMENTS):
        (piece,) = row_sums(x[:, start : start + SUM_ELEMENTS], y[:, start : start + SUM_ELEMENTS])
        sums.add(piece)
    return sums


def error_metrics(original: torch.Tensor, decoded: torch.Tensor) -> dict:
    """The metrics (see the module docstring) of a tensor against its round trip."""
    return error_sums(original, decoded).metrics()


def json_safe(value):
    """``value`` (metrics, or a report holding them) with each non-finite float as the
    string ``"inf"``, ``"-inf"`` or ``"nan"``: JSON has no such numbers (an exact round
    trip's ``snr_db`` is +inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
