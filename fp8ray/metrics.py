"""Error metrics between an original tensor and its fp8 round trip."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class ErrorMetrics:
    """``rel_fro``: ||y - x||_F / ||x||_F; ``max_abs``: max |y - x|; ``snr_db``: 10 log10(||x||^2 / ||y - x||^2)."""

    rel_fro: float
    max_abs: float
    snr_db: float

    def as_dict(self) -> dict:
        return asdict(self)


def error_metrics(original: torch.Tensor, decoded: torch.Tensor) -> ErrorMetrics:
    if original.shape != decoded.shape:
        raise ValueError(f"shapes differ: original {tuple(original.shape)}, decoded {tuple(decoded.shape)}")
    x = original.double()
    diff = decoded.double() - x
    signal = float((x * x).sum())
    noise = float((diff * diff).sum())
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    rel = math.sqrt(noise / signal) if signal else (0.0 if noise == 0 else math.inf)
    snr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal else -math.inf)
    return ErrorMetrics(rel_fro=rel, max_abs=max_abs, snr_db=snr)
