"""Views torch makes that look like plain tensors but are not laid out as one: a single
element with a stride other than 1 (torch calls it contiguous), and a negative view
(``z.conj().imag``: its memory holds its values' negatives). Each encodes to the frame of
its values and decodes into as it would into a plain tensor (each raised torch's own
RuntimeError before)."""

from __future__ import annotations

import pytest
import torch

from fp8ray import Fp8Codec, decode
from fp8ray.codec.blocks import Block


@pytest.mark.filterwarnings("ignore:.*float64.*:UserWarning")
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_one_element_with_a_stride_encodes_as_its_value(dtype):
    odd = torch.arange(6).to(dtype).reshape(2, 3)[:1, 1]  # shape (1,), stride (3,)
    assert odd.stride() == (3,) and odd.is_contiguous()
    plain = odd.clone(memory_format=torch.contiguous_format)
    frame = bytes(Fp8Codec().encode(odd))
    assert frame == bytes(Fp8Codec().encode(plain))
    assert torch.equal(decode(frame), plain)
    block = Block.of("k", odd)  # what encode_many and encode_refs make of a tensor
    assert torch.equal(block.tensor(), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64], ids=str)
def test_a_negative_view_encodes_its_values_and_is_decoded_into(dtype):
    z = torch.tensor(1 + 2j, dtype=torch.complex64)  # 0-d: its view is contiguous, so no copy resolves it
    negative = z.conj().imag if dtype == torch.float32 else z.conj()
    assert (negative.is_neg() or negative.is_conj()) and negative.is_contiguous()
    values = negative.resolve_neg().resolve_conj()
    assert bytes(Fp8Codec().encode(negative)) == bytes(Fp8Codec().encode(values))
    if dtype == torch.float32:
        into = torch.tensor(0 + 9j, dtype=torch.complex64).conj().imag  # a negative view to write
        decode(Fp8Codec(scaling="none").encode(torch.tensor(-7.0)), out=into)
        assert into.is_neg() and into.item() == -7.0
