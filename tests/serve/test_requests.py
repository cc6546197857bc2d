"""The service's request parsing and refusals, without Serve or Ray."""

from __future__ import annotations

import re

import pytest

from fp8ray import CodecOptions
from fp8ray.errors import (
    BlockError,
    CorruptFrameError,
    InvalidOptionError,
    NonFiniteError,
    RequestError,
    SafetensorsFormatError,
    WorkersUnavailableError,
)
from fp8ray.serve.options import ServiceOptions
from fp8ray.serve.requests import codec_options, is_safetensors, raw_layout, refusal, split


def test_codec_options_from_a_query():
    assert codec_options({}) == CodecOptions()
    assert codec_options({"scaling": "token", "block_size": "64"}) == CodecOptions(scaling="token", block_size=64)
    assert codec_options({"dtype": "bfloat16", "fp8": "e5m2"}, ignore=("dtype",)) == CodecOptions(fp8="e5m2")


@pytest.mark.parametrize(
    "params, field, pattern",
    [
        ({"nonfinite": "keep"}, "nonfinite", "unknown option 'nonfinite'"),  # never NaN stored silently
        ({"colour": "red"}, "colour", "unknown option 'colour'"),
        ({"block_size": "-1"}, "block_size", "positive integer"),
        ({"scaling": "tensor", "scale_choice": "mse"}, "scale_choice", "needs scaling"),
    ],
)
def test_bad_query_options_are_400_naming_the_field(params, field, pattern):
    with pytest.raises(RequestError, match=pattern) as exc:
        codec_options(params)
    assert (exc.value.status, exc.value.field) == (400, field)


def test_raw_layout_is_checked_against_the_body():
    assert raw_layout("bfloat16", "2,3", 12) == ("bfloat16", (2, 3))
    assert raw_layout("torch.float32", "", 4) == ("float32", ())
    assert raw_layout("float16", " 2, 8 ", 32) == ("float16", (2, 8))
    for args, field, pattern in [
        ((None, "2", 4), "dtype", "dtype is required for a raw body; .* with Content-Type: application/x-safetensors"),
        (("complex128", "2", 16), "dtype", "unknown dtype 'complex128'"),
        (("float16", None, 4), "shape", "shape is required"),
        (("float16", "2,x", 4), "shape", "not comma-separated integers"),
        (("float16", "-2", 4), "shape", "negative size"),
        (("float16", "1_6", 32), "shape", "not comma-separated integers"),  # int() takes these three
        (("float16", "+16", 32), "shape", "not comma-separated integers"),
        (("float16", "\u0661\u0666", 32), "shape", "not comma-separated integers"),
        (("float16", ",".join(["1"] * 65), 2), "shape", "65 dimensions exceeds the frame's limit of 64"),
        (("float16", "3", 4), "shape", r"shape \[3\] of float16 needs 6 bytes but the body has 4"),
        (("float32", "9" * 5000, 4), "shape", "^shape has a size of 5000 digits; a frame holds"),  # int() raised: a 500
        (("float32", f"{2**62},0", 0), "shape", f"multiply to {2**62}, more than {(2**63 - 1) // 4} for float32"),
        (("bfloat16", f"{2**62},0", 0), "shape", f"more than {(2**63 - 1) // 2} for bfloat16"),
    ]:
        with pytest.raises(RequestError, match=pattern) as exc:
            raw_layout(*args)
        assert (exc.value.status, exc.value.field) == (400, field)


def test_split_keeps_order_and_refuses_nothing_to_do():
    assert split(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split([1], 4) == [[1]]
    with pytest.raises(RequestError, match="holds no tensors"):
        split([], 2)


def test_content_types():
    assert is_safetensors("application/x-safetensors; charset=binary") and is_safetensors("Application/X-Safetensors")
    assert not is_safetensors(None) and not is_safetensors("application/octet-stream")


@pytest.mark.parametrize(
    "exc, status, field",
    [
        (RequestError("too big", 413, "body"), 413, "body"),
        (InvalidOptionError("bad", field="fp8"), 400, "fp8"),
        (SafetensorsFormatError("bad header", "k0"), 400, "k0"),
        (NonFiniteError("nan"), 422, "body"),
        (CorruptFrameError("crc"), 422, "body"),
        (BlockError("block 'x': 70 dimensions"), 422, "body"),
        (WorkersUnavailableError("none"), 503, None),
    ],
)
def test_every_refusal_has_a_status_and_a_field(exc, status, field):
    assert refusal(exc) == (status, str(exc), field)


def test_bugs_are_not_refusals():
    assert refusal(KeyError("x")) is None and refusal(ZeroDivisionError()) is None


def test_service_options():
    assert ServiceOptions.from_args({"workers": "4", "max_body_mb": "8"}) == ServiceOptions(workers=4, max_body_mb=8.0)
    with pytest.raises(InvalidOptionError, match="unknown fp8ray.serve option"):
        ServiceOptions.from_args({"wokers": 2})
    with pytest.raises(InvalidOptionError, match=r"^fp8ray.serve option workers must be at least 1, got 0$"):
        ServiceOptions.from_args({"workers": 0})


@pytest.mark.parametrize(
    "name, value",
    [
        ("max_body_mb", "inf"),
        ("max_body_mb", "nan"),
        ("max_body_mb", "1e-9"),
        ("max_body_mb", "1e303"),  # finite, but not in bytes: an OverflowError traceback
        ("cpus_per_worker", "inf"),
        ("gpus_per_worker", "nan"),
    ],
)
def test_service_options_that_no_comparison_catches_are_named(name, value):
    """NaN and inf pass ``<=`` tests (a traceback from int(inf) later, or num_gpus=nan given
    to Ray), and a body limit under a byte answered every request 413."""
    with pytest.raises(InvalidOptionError, match=rf"^fp8ray.serve option {name} must be a finite number") as info:
        ServiceOptions.from_args({name: value})
    assert info.value.field == name


@pytest.mark.parametrize(
    "name, value, kind",
    [
        ("workers", 2.9, "a whole number"),  # a config file's number: it was cut to 2
        ("workers", "2.9", "a whole number"),
        ("replicas", True, "a whole number"),  # YAML's true: it was 1
        ("archives", None, "a string"),  # an empty `archives:`: it was the directory 'None'
        ("max_body_mb", [8], "a number"),
        ("max_body_mb", 10**400, "a number"),  # a config's integer past any float: an OverflowError traceback
    ],
)
def test_service_options_are_converted_without_cutting_them(name, value, kind):
    with pytest.raises(
        InvalidOptionError, match="^" + re.escape(f"fp8ray.serve option {name} must be {kind}, got {value!r}")
    ) as info:
        ServiceOptions.from_args({name: value})
    assert info.value.field == name
    assert ServiceOptions.from_args({"workers": 2.0, "cpus_per_worker": 1}) == ServiceOptions(workers=2, cpus_per_worker=1.0)
    # "2.0" from `serve run ... workers=2.0` as a config's 2.0 (it was refused as not a whole number)
    assert ServiceOptions.from_args({"workers": "2.0", "replicas": "1e1"}) == ServiceOptions(workers=2, replicas=10)


def test_a_block_error_keeps_its_class_and_field():
    from fp8ray.errors import block_error

    err = block_error("k0", InvalidOptionError("bad scaling", field="scaling"))
    assert type(err) is InvalidOptionError and err.field == "scaling" and str(err).startswith("block 'k0': ")
    assert refusal(block_error("k1", NonFiniteError("nan")))[0] == 422
    assert block_error("k2", ValueError("no")).field == "k2"
