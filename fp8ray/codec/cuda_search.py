"""The scale search's work per element as one Triton kernel, for the CUDA path.

:func:`fp8ray.codec.reference.error_lanes` written in torch ops emulates each fused
multiply-add in fp64 (a dozen passes over the data per candidate): on an H200 the default
mode's search took 110 ms for 128 Mi elements, 20x the amax mode's whole quantize
(BENCHMARKS.md, "GPU"). Here each element is read once per candidate and the lanes are
summed with the GPU's own fused multiply-add: the same operations in the same order, so
the same bits (``scripts/device_check`` compares every frame with the CPU kernels').
Floating-point contraction is off for the kernel, so that ``round(q) - q`` stays a
subtraction of the rounded product, as the reference computes it.

Before its first use on a GPU the kernel is run on a sample there (subnormal quotients,
short rows) and compared with the torch ops bit for bit; where Triton is not installed
(it comes with CUDA builds of torch on Linux), fails, or differs, or on ROCm builds
(never checked), the torch ops run instead, with a warning where it failed or differed.
"""

from __future__ import annotations

import functools
import warnings

import torch

from . import reference
from .formats import FORMATS, Fp8Format

ROWS = 32  # groups per program


def lanes_for(device: torch.device):
    """The function that computes :func:`~fp8ray.codec.reference.error_lanes` on ``device``:
    :func:`error_lanes` where the kernel runs there and gives the torch ops' bits."""
    if device.type != "cuda" or torch.version.cuda is None:
        return reference.error_lanes
    index = torch.cuda.current_device() if device.index is None else device.index
    return error_lanes if _checked(index) else reference.error_lanes


def error_lanes(magnitudes: torch.Tensor, recips: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """:func:`fp8ray.codec.reference.error_lanes` of CUDA tensors, in one kernel."""
    from .triton_lanes import square_lanes

    rows, length = magnitudes.shape
    magnitudes, recips = magnitudes.contiguous(), recips.contiguous()
    lanes = torch.empty(rows, reference.SEARCH_LANES, dtype=torch.float32, device=magnitudes.device)
    if rows:
        shift = 23 - fmt.mantissa_bits  # nearest_with_mantissa on the bits
        with torch.cuda.device(magnitudes.device):  # Triton launches on the current device
            square_lanes[(-(-rows // ROWS),)](
                magnitudes,
                recips,
                lanes,
                rows,
                LENGTH=length,  # a constant: one compile per group length (block size, or row length)
                HALF=1 << (shift - 1),
                KEEP=-(1 << shift),
                ROWS=ROWS,
                LANES=reference.SEARCH_LANES,
                enable_fp_fusion=False,
            )
    return lanes


@functools.cache
def _checked(index: int) -> bool:
    """Whether the kernel runs on GPU ``index`` and equals the torch ops there, bit for bit,
    on a sample: magnitudes from subnormal to large, rows of one chunk, several and a
    short last one, both formats."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    device = torch.device("cuda", index)
    try:
        differences = differences_from_torch_ops(device, ((3, 16), (70, 32), (5, 130)))
    except Exception as exc:  # a compile or launch failure: the torch ops still work
        warnings.warn(f"fp8ray: the scale search's Triton kernel failed on {device} ({exc!r}); using the torch ops", stacklevel=2)
        return False
    if differences:
        warnings.warn(
            f"fp8ray: the scale search's Triton kernel differs from its torch ops on {device} "
            f"({differences[0]}); using the torch ops",
            stacklevel=2,
        )
    return not differences


def differences_from_torch_ops(device: torch.device, shapes) -> list[str]:
    """The kernel against :func:`fp8ray.codec.reference.error_lanes` on ``device``, bit for
    bit, for rows x length in ``shapes`` and both formats: magnitudes from subnormal to
    large, reciprocals from 2**-12 to 2**12. Each difference named by format, shape and
    first differing lane."""
    g = torch.Generator().manual_seed(0)
    differences = []
    for fmt in FORMATS.values():
        for rows, length in shapes:
            mags = torch.exp2(torch.empty(rows, length).uniform_(-150, 10, generator=g)).to(device)
            recips = torch.exp2(torch.empty(rows).uniform_(-12, 12, generator=g)).to(device)
            expected, got = reference.error_lanes(mags, recips, fmt), error_lanes(mags, recips, fmt)
            unequal = (expected.view(torch.int32) != got.view(torch.int32)).flatten().nonzero()
            if unequal.numel():
                i = int(unequal[0])
                differences.append(
                    f"{fmt.name}, {rows} x {length}: lane {i} is {got.flatten()[i].item()!r}, "
                    f"its torch ops give {expected.flatten()[i].item()!r}"
                )
    return differences
