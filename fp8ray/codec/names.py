"""The codec's options by name: the values each takes, their wire codes and the default
mode, without torch.

:mod:`~fp8ray.codec.formats` and :mod:`~fp8ray.codec.options` build on these tables;
the command line builds its option names, choices and help from them, so that
``fp8ray --help`` does not load torch (seconds).
"""

from __future__ import annotations

# fp8 formats and their wire codes (formats.py binds each to its torch dtype and constants).
FP8_CODES = {"e4m3fn": 1, "e5m2": 2}

# Scaling modes and their wire codes.
SCALINGS = {"none": 0, "tensor": 1, "channel": 2, "token": 3, "block": 4}

# Source dtypes fp8 encodes, by torch's name for them, and their wire codes.
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}

# The dtypes fp8 cannot hold or gains nothing on (integers, booleans, float64, complex,
# fp8 itself: every other dtype torch and safetensors share), by torch's name, and their
# wire codes: a frame stores such a tensor's bytes as they are (docs/FORMAT.md, "Stored
# frames"), so a file that holds one is archived whole.
STORED_DTYPE_CODES = {
    "float64": 4,
    "int8": 5,
    "uint8": 6,
    "int16": 7,
    "uint16": 8,
    "int32": 9,
    "uint32": 10,
    "int64": 11,
    "uint64": 12,
    "bool": 13,
    "float8_e4m3fn": 14,
    "float8_e5m2": 15,
    "complex64": 16,
    "float8_e4m3fnuz": 17,
    "float8_e5m2fnuz": 18,
    "float8_e8m0fnu": 19,
}

# Scale dtypes and their wire codes.
SCALE_DTYPES = {"float32": 0, "bfloat16": 1}

# How the encoder picks a group's scale (formats.py); not recorded in the frame, which
# needs only the scales themselves to decode.
SCALE_CHOICES = ("amax", "mse")
SEARCHED_SCALINGS = ("token", "block")

NONFINITE_POLICIES = ("error", "keep")

# The values each string option takes, for parsers and help texts.
CHOICES = {
    "fp8": tuple(FP8_CODES),
    "scaling": tuple(SCALINGS),
    "scale_dtype": tuple(SCALE_DTYPES),
    "scale_choice": SCALE_CHOICES,
    "nonfinite": NONFINITE_POLICIES,
}

# The default mode, option by option (CodecOptions' fields, in order; the measurements
# behind it are in options.py). scale_choice None: the scaling's own (default_scale_choice).
DEFAULT_MODE = {
    "fp8": "e4m3fn",
    "scaling": "block",
    "block_size": 32,
    "scale_dtype": "bfloat16",
    "scale_choice": None,
    "nonfinite": "error",
}
OPTION_NAMES = tuple(DEFAULT_MODE)


def default_scale_choice(scaling: str) -> str:
    """``mse`` where the scaling can search (token and block), else ``amax``."""
    return "mse" if scaling in SEARCHED_SCALINGS else "amax"


def mode_label(fp8: str, scaling: str, block_size: int, scale_dtype: str, scale_choice: str | None, nonfinite: str) -> str:
    """A short description of a mode: ``e4m3fn, block 32, bfloat16 scales by mse``."""
    parts = [fp8, scaling + (f" {block_size}" if scaling == "block" else "")]
    if scaling != "none":
        parts.append(f"{scale_dtype} scales by {scale_choice or default_scale_choice(scaling)}")
    if nonfinite != "error":
        parts.append(f"nonfinite {nonfinite}")
    return ", ".join(parts)
