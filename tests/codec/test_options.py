"""CodecOptions: the one options type, its default mode, and its parsers."""

from __future__ import annotations

import pytest
import torch

from fp8ray import CodecOptions, Fp8Codec, QuantPool
from fp8ray.codec.options import DEFAULT_OPTIONS
from fp8ray.errors import InvalidOptionError


def test_the_default_mode_is_the_measured_kv_mode():
    assert CodecOptions() == DEFAULT_OPTIONS == CodecOptions("e4m3fn", "block", 32, "bfloat16", "mse", "error")
    assert DEFAULT_OPTIONS.label() == "e4m3fn, block 32, bfloat16 scales by mse"


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"fp8": "e5m2"}, CodecOptions("e5m2", "block", 32, "bfloat16", "mse")),
        ({"scaling": "token"}, CodecOptions("e4m3fn", "token", 32, "bfloat16", "mse")),
        ({"scaling": "tensor"}, CodecOptions("e4m3fn", "tensor", 32, "bfloat16", "amax")),  # mse does not apply
        ({"scaling": "channel", "scale_dtype": "float32"}, CodecOptions("e4m3fn", "channel", 32, "float32", "amax")),
        ({"block_size": "64"}, CodecOptions("e4m3fn", "block", 64, "bfloat16", "mse")),
        ({"scale_choice": "amax"}, CodecOptions("e4m3fn", "block", 32, "bfloat16", "amax")),
        ({"fp8": torch.float8_e5m2, "nonfinite": "keep"}, CodecOptions("e5m2", nonfinite="keep")),
    ],
)
def test_an_option_given_overrides_only_itself(given, expected):
    assert CodecOptions.parse(given) == expected


def test_parse_over_a_base_and_replace():
    base = CodecOptions(scaling="token", scale_dtype="float32", scale_choice="amax")
    assert CodecOptions.parse({"fp8": "e5m2"}, base=base) == CodecOptions("e5m2", "token", 32, "float32", "amax")
    assert base.replace(scaling="block", scale_choice="mse").scale_choice == "mse"


@pytest.mark.parametrize("over", [lambda base, **given: CodecOptions.parse(given, base=base), CodecOptions.replace])
def test_a_new_scaling_keeps_the_scale_choice_given_and_derives_one_left_out(over):
    """Over a base, a new scaling overrides only itself: the base's scale_choice, block_size
    and scale_dtype are kept where they were given; one left out is derived again."""
    given = CodecOptions(scaling="token", block_size=64, scale_dtype="float32", scale_choice="amax")
    assert over(given, scaling="block") == CodecOptions("e4m3fn", "block", 64, "float32", "amax")
    assert over(given, scaling="tensor") == CodecOptions("e4m3fn", "tensor", 64, "float32", "amax")
    left_out = CodecOptions(scaling="tensor", block_size=64)  # amax, as tensor scaling's own
    assert over(left_out, scaling="block") == CodecOptions("e4m3fn", "block", 64, "bfloat16", "mse")
    assert over(over(left_out, nonfinite="keep"), scaling="token").scale_choice == "mse"  # still left out
    assert over(CodecOptions(), scaling="tensor").scale_choice == "amax"
    with pytest.raises(InvalidOptionError, match=r"^scaling 'tensor' given over options whose scale_choice is 'mse'") as exc:
        over(CodecOptions(scaling="token", scale_choice="mse"), scaling="tensor")
    assert exc.value.field == "scale_choice"


def test_codec_and_pool_over_a_base_encode_as_the_options_spelt_out():
    base = CodecOptions(scaling="token", scale_choice="amax")
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    spelt_out = bytes(Fp8Codec(scaling="block", scale_choice="amax").encode(x))
    assert spelt_out != bytes(Fp8Codec(scaling="block", scale_choice="mse").encode(x))  # the test can tell them apart
    assert bytes(Fp8Codec(scaling="block", options=base).encode(x)) == spelt_out
    with QuantPool(num_workers=1, address="inline") as pool:
        [frame] = pool.encode_many([x], options=base, scaling="block")
    assert bytes(frame) == spelt_out


def test_options_are_values():
    a, b = CodecOptions(scaling="token"), CodecOptions.parse({"scaling": "token"})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.scaling = "block"  # frozen
    assert CodecOptions(fp8="float8_e4m3fn").fp8 == "e4m3fn"
    assert CodecOptions.parse(a.as_dict()) == a


def test_codecs_of_the_same_options_are_equal():
    """A codec is its options: two spelt differently but writing the same frames are
    equal (and one key of a dict), those of other options not."""
    a, b = Fp8Codec(scaling="block"), Fp8Codec(options=CodecOptions(), block_size=32)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Fp8Codec(scaling="token") and a != CodecOptions() and a != "fp8"


@pytest.mark.parametrize(
    "given, field, pattern",
    [
        ({"fp8": "e3m4"}, "fp8", "unknown fp8 format 'e3m4'"),
        ({"scaling": "row"}, "scaling", "unknown scaling 'row'"),
        ({"block_size": "0"}, "block_size", "block_size must be a positive integer"),
        ({"block_size": "1.5"}, "block_size", "block_size must be a positive integer"),
        ({"block_size": "9" * 5000}, "block_size", r"at most 4294967295\), got '9{40}\.\.\. \(5000 characters\)'"),
        ({"block_size": 2**32}, "block_size", "at most 4294967295"),
        ({"block_size": True}, "block_size", "positive integer"),
        ({"scale_dtype": "float16"}, "scale_dtype", "unknown scale_dtype 'float16'"),
        ({"scale_choice": "best"}, "scale_choice", "unknown scale_choice 'best'"),
        ({"scaling": "tensor", "scale_choice": "mse"}, "scale_choice", "needs scaling 'token' or 'block', not 'tensor'"),
        ({"nonfinite": "ignore"}, "nonfinite", "unknown nonfinite policy 'ignore'"),
        ({"blocksize": "32"}, "blocksize", "unknown codec option 'blocksize'"),
        ({"scaling": 3}, "scaling", "scaling must be a string"),
    ],
)
def test_bad_options_name_the_field(given, field, pattern):
    with pytest.raises(InvalidOptionError, match=pattern) as exc:
        CodecOptions.parse(given)
    assert exc.value.field == field and isinstance(exc.value, ValueError)


def test_mode_strings():
    assert CodecOptions.from_mode("e5m2:token") == CodecOptions("e5m2", "token")
    assert CodecOptions.from_mode("e4m3fn:block:block_size=64:scale_dtype=float32") == CodecOptions(
        block_size=64, scale_dtype="float32"
    )
    assert CodecOptions.mode_values("e4m3fn:block:block_size=64") == {"fp8": "e4m3fn", "scaling": "block", "block_size": 64}
    for bad, pattern in [
        ("e4m3fn", "expected FP8:SCALING"),
        ("e4m3fn:token:x", "'x' is not key=value"),
        ("e4m3fn:token:scaling=block", "'scaling' is given twice"),
        ("e4m3fn:tensor:scale_choice=mse", "needs scaling"),
    ]:
        with pytest.raises(InvalidOptionError, match=rf"mode '{bad}': .*{pattern}"):
            CodecOptions.from_mode(bad)


def test_options_that_are_not_codec_options_are_a_type_error():
    """Fp8Codec(options="x") said "'str' object has no attribute 'fmt'"."""
    for options in ("x", {}, {"scaling": "token"}):
        with pytest.raises(TypeError, match=f"options must be a CodecOptions \\(or None\\), got {type(options).__name__}"):
            Fp8Codec(options=options)
        with pytest.raises(TypeError, match="options must be a CodecOptions"):
            Fp8Codec(scaling="token", options=options)
    for values in (None, [("scaling", "token")]):  # AttributeError: no attribute 'items'
        said = rf"^codec options must be a mapping of names to values, got {type(values).__name__}$"
        with pytest.raises(TypeError, match=said):
            CodecOptions.parse(values)
