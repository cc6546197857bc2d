"""The fp8 formats, scaling modes, source dtypes and scale options fp8ray knows, their
names and wire codes (the one table of each).

The scale convention, in one place for the whole project::

    scale   = amax / finfo(fp8).max      (fp32; amax over the finite values of a group)
    stored  = fp8(clamp(x / scale, -finfo.max, +finfo.max))   (round to nearest even)
    decoded = fp32(stored) * scale, then rounded to the original dtype

A group whose amax is 0 (all zeros, or empty) gets scale 1, so zeros decode to exact
zeros. A scale below the smallest normal fp32 (2**-126) is raised to it, so the scale
itself is exact and ``x / scale`` cannot overflow. Scaling ``none`` is scale 1 with no
scale stored.

Two options refine the scale, both applied in fp32 after the rules above:

- ``scale_dtype="bfloat16"`` stores each scale in 2 bytes: the fp32 scale is truncated
  (rounded toward zero) to bfloat16, so ``amax / scale`` may exceed finfo.max by less
  than 2**-7 relative and is clamped, and no decoded value ever exceeds the group's amax
  (rounding up could: 65504 in float16 would decode to inf). Encoding divides by the
  stored scale, so decoding is exact to the encoder's intent.
- ``scale_choice="mse"`` (token and block scaling) tries the scales ``amax / c`` for every
  finite fp8 value ``c`` in (finfo.max / 2, finfo.max] (largest first; each maps the amax
  onto a grid point, and together they cover one binade of alignments) and keeps the first
  with the least squared error, measured in units of the scale through its reciprocal,
  rounded on the bits and summed by fused multiply-adds in 16 fp32 lanes
  (:func:`fp8ray.codec.reference.search_error`, docs/FORMAT.md).
  ``"amax"`` is ``c = finfo.max`` alone.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import cache

import numpy as np

from ..errors import BadInputError, InvalidOptionError
from .names import (  # noqa: F401 (re-exported: the formats module names them all)
    DTYPE_CODES,
    FP8_CODES,
    NONFINITE_POLICIES,
    SCALE_CHOICES,
    SCALE_DTYPES,
    SCALINGS,
    SEARCHED_SCALINGS,
    STORED_DTYPE_CODES,
)

SMALLEST_NORMAL_SCALE = 2.0**-126


@dataclass(frozen=True)
class Fp8Format:
    """One fp8 format: its name, wire code and the constants the kernels need."""

    name: str
    code: int
    mantissa_bits: int
    exponent_bias: int
    max: float  # finfo.max, the clamp bound
    unit_roundoff: float  # u = 2**-(mantissa_bits + 1)
    min_subnormal_exp: int  # smallest subnormal is 2**min_subnormal_exp
    nan_code: int  # canonical NaN written for NaN input under nonfinite="keep"
    posinf_code: int  # code written for +inf under nonfinite="keep"
    neginf_code: int  # code written for -inf under nonfinite="keep"

    @property
    def dtype(self):
        """The torch dtype (``torch.float8_e4m3fn``). torch is loaded here, on first use:
        the CPU path from raw bytes (``fp8ray compress``) runs without it."""
        import torch

        return getattr(torch, f"float8_{self.name}")


E4M3FN = Fp8Format(
    name="e4m3fn",
    code=FP8_CODES["e4m3fn"],
    mantissa_bits=3,
    exponent_bias=7,
    max=448.0,
    unit_roundoff=2.0**-4,
    min_subnormal_exp=-9,
    nan_code=0x7F,
    # e4m3fn has no infinities: under nonfinite="keep", +-inf is stored as NaN.
    posinf_code=0x7F,
    neginf_code=0x7F,
)
E5M2 = Fp8Format(
    name="e5m2",
    code=FP8_CODES["e5m2"],
    mantissa_bits=2,
    exponent_bias=15,
    max=57344.0,
    unit_roundoff=2.0**-3,
    min_subnormal_exp=-16,
    nan_code=0x7F,
    posinf_code=0x7C,
    neginf_code=0xFC,
)

FORMATS = {f.name: f for f in (E4M3FN, E5M2)}
FORMATS_BY_CODE = {f.code: f for f in FORMATS.values()}

# Scaling modes (names.SCALINGS, with their wire codes).
SCALINGS_BY_CODE = {v: k for k, v in SCALINGS.items()}

# Every dtype a block or a frame holds, by name (torch's): those fp8 encodes
# (names.DTYPE_CODES) and those a frame stores as they are (names.STORED_DTYPE_CODES),
# with their wire codes and bytes per element; and the numpy type the kernels see an
# encoded dtype's elements as (bfloat16 as uint16 bits, float16 as int16 bits: see
# fp8ray.codec.kernels).
FRAME_DTYPE_CODES = {**DTYPE_CODES, **STORED_DTYPE_CODES}
DTYPE_NAMES_BY_CODE = {v: k for k, v in FRAME_DTYPE_CODES.items()}
DTYPE_ITEMSIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex64": 8,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


def tensor_nbytes(dtype: str, shape) -> int:
    """The bytes of a ``dtype`` tensor (a name of DTYPE_ITEMSIZES) of ``shape``."""
    return math.prod(shape) * DTYPE_ITEMSIZES[dtype]


KERNEL_TYPES = {"float32": np.float32, "float16": np.int16, "bfloat16": np.uint16}
# The largest finite value of each dtype fp8 encodes (torch.finfo(dtype).max).
LARGEST = {"float32": 3.4028234663852886e38, "float16": 65504.0, "bfloat16": 3.3895313892515355e38}
# The bits of +inf of the 16-bit ones, as the kernels hold their elements (KERNEL_TYPES):
# its exponent, all set (with any other mantissa: NaN).
INFINITY_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80}


def __getattr__(name: str):
    """The tables keyed by torch dtypes, built on first use (loading torch takes about a
    second, which the CPU path from raw bytes does without): ``DTYPES_BY_NAME`` (name ->
    torch dtype) and ``DTYPE_NAMES`` (torch dtype -> name) of every dtype a frame holds,
    ``DTYPES`` (torch dtype -> wire code) of those fp8 encodes, and ``FORMATS_BY_DTYPE``
    (torch fp8 dtype -> format)."""
    if name in TORCH_TABLES:
        return _torch_tables()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TORCH_TABLES = ("DTYPES_BY_NAME", "DTYPE_NAMES", "DTYPES", "FORMATS_BY_DTYPE")


@cache
def _torch_tables() -> dict:
    import torch

    # Those this torch has: float8_e8m0fnu came in torch 2.7 (torch_dtype names it).
    by_name = {name: getattr(torch, name) for name in DTYPE_ITEMSIZES if hasattr(torch, name)}
    return {
        "DTYPES_BY_NAME": by_name,
        "DTYPE_NAMES": {dtype: name for name, dtype in by_name.items()},
        "DTYPES": {by_name[name]: code for name, code in DTYPE_CODES.items()},
        "FORMATS_BY_DTYPE": {f.dtype: f for f in FORMATS.values()},
    }


def torch_dtype(name: str):
    """The torch dtype of ``name`` (a name of :data:`DTYPE_ITEMSIZES`); loads torch.
    Raises :class:`~fp8ray.errors.BadInputError` naming it where this torch has none."""
    by_name = _torch_tables()["DTYPES_BY_NAME"]
    if name not in by_name:
        import torch

        raise BadInputError(
            f"dtype {name} is not in this torch ({torch.__version__}; a later one has it): read the block "
            "without torch (ArchiveReader.block, fp8ray.decode_raw), or upgrade torch"
        )
    return by_name[name]


def is_torch_dtype(value) -> bool:
    """Whether ``value`` is a torch dtype (never, while torch is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype)


def dtype_name(dtype) -> str:
    """The name of a dtype a frame holds (:data:`DTYPE_ITEMSIZES`), given by name
    (``"bfloat16"``), as a torch dtype or as a numpy one (the arrays ``encode`` takes);
    ``TypeError`` for any other."""
    if is_torch_dtype(dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        # numpy names the dtypes it shares with torch as torch does (it has no bfloat16 or
        # fp8 of its own); one not in this machine's byte order would be misread: str()
        # names it as numpy does (>f4)
        given = np.dtype(dtype)
        if given.name not in DTYPE_ITEMSIZES or not given.isnative:
            numpy_names = sorted(n for n in DTYPE_ITEMSIZES if n != "bfloat16" and not n.startswith("float8"))
            raise TypeError(
                f"unsupported numpy dtype {given}; expected one of {numpy_names} in this machine's byte order "
                "(or a torch bfloat16)"
            )
        name = given.name
    else:
        name = dtype
    if not isinstance(name, str) or name not in DTYPE_ITEMSIZES:
        raise TypeError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPE_ITEMSIZES)}")
    return name


def is_stored(dtype: str) -> bool:
    """Whether a frame holds a tensor of ``dtype`` (a name) as its bytes are, not in fp8."""
    return dtype in STORED_DTYPE_CODES


# Scale dtypes (names.SCALE_DTYPES, with their wire codes): bytes per scale, and the mask
# that truncates an fp32 scale's bits to it.
SCALE_DTYPES_BY_CODE = {v: k for k, v in SCALE_DTYPES.items()}
SCALE_BYTES = {"float32": 4, "bfloat16": 2}
SCALE_MASKS = {"float32": 0xFFFFFFFF, "bfloat16": 0xFFFF0000}


def scale_candidates(fmt: Fp8Format, scale_choice: str) -> tuple[float, ...]:
    """The divisors ``c`` of ``scale = amax / c`` the encoder tries, in the order tried.

    ``amax``: finfo.max alone. ``mse``: every finite fp8 value in (max/2, max], largest
    first (e4m3fn: 448, 416, ..., 256, 240; e5m2: 57344, 49152, 40960, 32768).
    """
    if scale_choice == "amax":
        return (fmt.max,)
    if scale_choice == "mse":
        values = positive_values(fmt)
        top = values[(values > fmt.max / 2) & (values <= fmt.max)]
        return tuple(sorted((float(v) for v in top), reverse=True))
    raise InvalidOptionError(
        f"unknown scale_choice {scale_choice!r}; expected one of {list(SCALE_CHOICES)}", field="scale_choice"
    )


def positive_values(fmt: Fp8Format) -> np.ndarray:
    """The value of each code 0..127 (sign bit clear) as the format's bits say, in fp64;
    the NaN and inf codes come out above ``fmt.max`` (a plain exponent and mantissa)."""
    codes = np.arange(128)
    exponent, mantissa = codes >> fmt.mantissa_bits, codes & ((1 << fmt.mantissa_bits) - 1)
    fraction = mantissa / (1 << fmt.mantissa_bits)
    normal = (1 + fraction) * 2.0 ** (exponent - fmt.exponent_bias)
    return np.where(exponent > 0, normal, fraction * 2.0 ** (1 - fmt.exponent_bias))


def max_code(fmt: Fp8Format) -> int:
    """The code of ``+fmt.max``, the largest a finite input gets."""
    return int(np.flatnonzero(positive_values(fmt) == fmt.max)[0])


def get_format(fp8) -> Fp8Format:
    """Look up a format by name (``"e4m3fn"``, ``"float8_e4m3fn"``), torch dtype or itself."""
    if isinstance(fp8, Fp8Format):
        return fp8
    if is_torch_dtype(fp8):
        by_dtype = _torch_tables()["FORMATS_BY_DTYPE"]
        if fp8 in by_dtype:
            return by_dtype[fp8]
        raise InvalidOptionError(
            f"unsupported fp8 dtype {fp8}; expected one of {sorted(str(f.dtype) for f in FORMATS.values())}", field="fp8"
        )
    if isinstance(fp8, str):
        name = fp8.removeprefix("torch.").removeprefix("float8_")
        if name in FORMATS:
            return FORMATS[name]
    raise InvalidOptionError(f"unknown fp8 format {fp8!r}; expected one of {sorted(FORMATS)}", field="fp8")


def num_scales(scaling: str, shape: tuple[int, ...], block_size: int) -> int:
    """How many fp32 scales a tensor of ``shape`` carries under ``scaling``.

    ``channel`` has one per index of the last dimension, ``token`` one per row of the
    last dimension (a 0-d tensor counts as one row of one element), ``block`` one per
    ``block_size`` contiguous elements (the last block may be short).
    """
    numel = math.prod(shape)
    if scaling == "none":
        return 0
    if scaling == "tensor":
        return 1
    if scaling == "channel":
        return shape[-1] if shape else 1
    if scaling == "token":
        return math.prod(shape[:-1]) if shape else 1
    if scaling == "block":
        return -(-numel // block_size)
    raise InvalidOptionError(f"unknown scaling {scaling!r}; expected one of {sorted(SCALINGS)}", field="scaling")
