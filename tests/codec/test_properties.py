"""Property tests: any shape, dtype, format and mode; fast path == reference; within the bound."""

from __future__ import annotations

import numpy as np
import torch
from _util import DTYPES, SCALINGS, assert_same_bits, element_scales, error_bound
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8ray
from fp8ray import Fp8Codec
from fp8ray.codec import frame, reference
from fp8ray.codec.formats import FORMATS, SCALE_CHOICES, SCALE_DTYPES, SEARCHED_SCALINGS

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)


@st.composite
def cases(draw):
    shape = draw(shapes)
    dtype = draw(st.sampled_from(DTYPES))
    fmt_name = draw(st.sampled_from(sorted(FORMATS)))
    scaling = draw(st.sampled_from(SCALINGS))
    scale_dtype = draw(st.sampled_from(list(SCALE_DTYPES)))
    choice = draw(st.sampled_from(SCALE_CHOICES)) if scaling in SEARCHED_SCALINGS else "amax"
    block_size = draw(st.integers(1, 40))
    exponent_lo = draw(st.integers(-24, 10))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    numel = int(np.prod(shape)) if shape else 1
    mags = np.exp2(rng.uniform(exponent_lo, exponent_lo + draw(st.integers(0, 30)), size=numel))
    values = mags * rng.choice([-1.0, 1.0], size=numel) * (rng.random(numel) > 0.1)  # some zeros
    finite_max = torch.finfo(dtype).max
    x = torch.from_numpy(values.clip(-finite_max, finite_max).astype(np.float32)).reshape(shape).to(dtype)
    if scaling == "none":
        x = x.float().clamp(-FORMATS[fmt_name].max, FORMATS[fmt_name].max).to(dtype)
    return x, fmt_name, scaling, block_size, scale_dtype, choice


@settings(max_examples=400, deadline=None)
@given(cases())
def test_encode_matches_reference_and_bound(case):
    x, fmt_name, scaling, block_size, scale_dtype, choice = case
    codec = Fp8Codec(fmt_name, scaling, block_size=block_size, scale_dtype=scale_dtype, scale_choice=choice)
    f = codec.encode(x)
    assert len(f) == codec.encoded_size(x.shape, x.dtype)
    buf = frame.as_byte_array(f)
    header = frame.parse(buf)
    codes, scales, _ = reference.quantize(x, codec.fmt, scaling, block_size, False, scale_dtype, choice)
    assert np.array_equal(frame.codes_of(buf, header), codes.numpy())
    assert np.array_equal(frame.scales_of(buf, header).view(np.int32), scales.numpy().view(np.int32))
    y = fp8ray.decode(f)
    assert_same_bits(y, reference.dequantize(codes, scales, codec.fmt, scaling, tuple(x.shape), x.dtype, block_size))
    scale = element_scales(scales, scaling, tuple(x.shape), block_size)
    assert ((y.double() - x.double()).abs().reshape(-1) <= error_bound(x, y, scale, fmt_name)).all()
