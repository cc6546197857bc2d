"""verify --against's check of a decoded block against its source
(:func:`fp8ray.codec.bound.check_within_bound`): every element within the derived bound,
and the block finite exactly where the source is."""

from __future__ import annotations

import math

import pytest
import torch

from fp8ray import CodecOptions, Fp8Codec, decode
from fp8ray.codec import frame
from fp8ray.codec.bound import bound_constants, check_within_bound, element_scales

OPTIONS = CodecOptions(nonfinite="keep")  # the default mode, non-finite values stored


@pytest.fixture(scope="module")
def block():
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[0, 3], x[1, 7], x[2, 9] = math.nan, math.inf, -math.inf
    buf = frame.as_byte_array(Fp8Codec(options=OPTIONS).encode(x))
    header = frame.parse(buf)
    scales = element_scales(torch.from_numpy(frame.scales_of(buf, header).copy()), "block", header.shape, header.block_size)
    return x, decode(buf), scales


def check(x, y, scales):
    return check_within_bound(x, y, scales, bound_constants(OPTIONS.fmt, OPTIONS.scaling))


def test_the_decoded_block_is_within_its_bound(block):
    assert check(*block) is None


def test_one_element_past_its_bound_fails_naming_it(block):
    """The block's norms were reported ("relative error 2.465% ... where the bound allows
    6.273%"), which could not show an element past its own bound."""
    x, y, scales = block
    far = y.clone()
    far[3, 100] = x[3, 100].float() * 1.5 + 1
    source, decoded = float(x[3, 100]), float(far[3, 100])
    message = check(x, far, scales)
    assert message.startswith(
        f"1 of 4096 elements out of their bound; the first, element [3, 100], decodes to {decoded!r} "
        f"where the source holds {source!r}: an error of {abs(decoded - source):.6g}, where the codec's derived bound allows "
    ), message
    far[0, 5] = 100.0
    assert check(x, far, scales).startswith("2 of 4096 elements out of their bound; the first, element [0, 5], ")


@pytest.mark.parametrize("at, value", [((0, 3), 0.0), ((1, 7), 1.0), ((2, 9), -2.0)])
def test_a_finite_value_where_the_source_is_not_fails(block, at, value):
    x, y, scales = block
    wrong = y.clone()
    wrong[at] = value  # NaN or inf in the source: the codec kept it, so must the block
    assert check(x, wrong, scales) is not None


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_value_where_the_source_is_finite_fails_with_an_infinite_error(block, value):
    x, y, scales = block
    wrong = y.clone()
    wrong[3, 5] = value
    assert check(x, wrong, scales) == (
        f"1 of 4096 elements out of their bound; the first, element [3, 5], decodes to {value!r} "
        f"where the source holds {float(x[3, 5])!r}"
    )


@pytest.mark.parametrize("piece", [7, 1024, 4095])
def test_a_block_checked_in_pieces_says_what_it_says_whole(block, monkeypatch, piece):
    """The check takes a block CHECK_ELEMENTS at a time (its float64 temporaries, about
    75 bytes an element, held 2.9 GB for a 64 MiB block): the count and the first element
    are the whole block's, wherever the pieces fall."""
    import fp8ray.codec.bound as bound

    x, y, scales = block
    wrong = y.clone()
    wrong[2, 1000], wrong[3, 5], wrong[3, 900] = 50.0, math.nan, -7.0  # past their bounds, in different pieces
    whole = check(x, wrong, scales)
    assert whole.startswith("3 of 4096 elements out of their bound; the first, element [2, 1000], decodes to 50.0 ")
    monkeypatch.setattr(bound, "CHECK_ELEMENTS", piece)
    assert check(x, wrong, scales) == whole
    assert check(*block) is None


def test_a_0d_block_past_its_bound_is_the_only_one():
    x = torch.tensor(1.0)
    scales = element_scales(torch.ones(1), "none", (), 0)
    message = check_within_bound(x, torch.tensor(2.0), scales, bound_constants(OPTIONS.fmt, "none"))
    assert message.startswith("1 of 1 elements out of their bound; the only one, decodes to 2.0 where the source holds 1.0")


def test_a_block_size_far_past_the_tensor_costs_no_memory_of_its_size():
    """element_scales repeated each scale block_size times before cutting to the tensor's
    elements: verify --against of a 15-element tensor under --block-size 536870912 took
    2.5 GB, and 2**32 - 1 (the frame's limit) 17 GB. Measured in a fresh process: its
    peak memory stays far below the 4 GB the old way made for 2**30."""
    import subprocess
    import sys

    # VmHWM, the peak of this process's own memory: ru_maxrss of a forked child starts at
    # its parent's (Linux records the forked memory's peak as the child execs).
    code = (
        "import re, torch\n"
        "from fp8ray.codec.bound import element_scales\n"
        "s = element_scales(torch.tensor([2.0]), 'block', (3, 5), 2**30)\n"
        "assert torch.equal(s, torch.full((15,), 2.0)), s\n"
        "t = element_scales(torch.tensor([1.0, 3.0]), 'block', (3, 5), 8)\n"
        "assert t.tolist() == [1.0] * 8 + [3.0] * 7, t\n"
        "print(re.search(r'VmHWM:\\s*(\\d+) kB', open('/proc/self/status').read()).group(1))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout) < 1_500_000, result.stdout  # KiB: torch itself takes a few hundred MB


@pytest.mark.parametrize("piece", [7, 4096, 1 << 22])
def test_a_blocks_error_sums_in_pieces_are_its_sums_whole(block, monkeypatch, piece):
    """verify --against sums a block's errors SUM_ELEMENTS at a time (each sum held float64
    copies of the whole block): the same sums, up to float64 rounding of the additions (a
    sum of n positive terms in another order: within n 2^-53 relative, 4.5e-13 for these
    4096), the count and the largest error exactly, non-finite elements still out."""
    import fp8ray.codec.metrics as metrics

    x, y, _ = block
    whole = metrics.row_sums(x.reshape(1, -1), y.reshape(1, -1))[0]
    monkeypatch.setattr(metrics, "SUM_ELEMENTS", piece)
    pieces = metrics.error_sums(x, y)
    assert (pieces.elements, pieces.max_abs) == (whole.elements, whole.max_abs) == (4096, whole.max_abs)
    for name in ("err2", "ref2", "dec2", "dot"):
        assert getattr(pieces, name) == pytest.approx(getattr(whole, name), rel=1e-12), name
    assert math.isfinite(pieces.err2) and pieces.err2 > 0
