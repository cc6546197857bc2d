"""Inputs the codec cannot take, refused with fp8ray's own message naming what was wrong
(each gave torch's or numpy's own error before, or a wrong result): sparse, nested and
masked inputs, foreign byte orders, devices that hold no data, outputs that overlap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8ray import Fp8Codec, decode
from fp8ray.codec import fp8codec
from fp8ray.errors import BadInputError, BlockError, InvalidOptionError

DENSE = torch.arange(12, dtype=torch.float32).reshape(3, 4)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning", "ignore:Sparse CSR tensor:UserWarning")
@pytest.mark.parametrize(
    "make, message",
    [
        (DENSE.to_sparse, r"^cannot encode a sparse_coo tensor: give a dense one \(tensor\.to_dense\(\)\)$"),
        (DENSE.to_sparse_csr, r"^cannot encode a sparse_csr tensor: give a dense one"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), r"^cannot encode a nested tensor: give a dense"),
        (lambda: np.ma.masked_array([1.0, 1e30], mask=[False, True], dtype=np.float32), r"^cannot encode a masked array"),
    ],
    ids=["sparse", "csr", "nested", "masked"],
)
def test_inputs_that_are_not_plain_dense_data_are_refused(make, message):
    with pytest.raises(BlockError, match=message):
        Fp8Codec().encode(make())


def test_a_foreign_byte_order_is_named_and_a_numpy_scalar_is_a_0d_array():
    with pytest.raises(TypeError, match=r"^array dtype >f4 is not in this machine's byte order; convert it first"):
        Fp8Codec().encode(np.arange(4, dtype=">f4"))
    codec = Fp8Codec(scaling="tensor")
    assert bytes(codec.encode(np.float32(1.5))) == bytes(codec.encode(np.array(1.5, dtype=np.float32)))


def test_decode_refuses_devices_without_data_and_outputs_that_overlap():
    frame = Fp8Codec().encode(DENSE)
    with pytest.raises(InvalidOptionError, match=r"^device 'bogus' is not a torch device; expected 'cpu', 'cuda' or 'cuda:N'$"):
        decode(frame, device="bogus")
    for kwargs in ({"device": "meta"}, {"out": torch.empty(3, 4, device="meta")}):  # returned a tensor of no data
        with pytest.raises(InvalidOptionError, match=r"^decode runs on the CPU or a CUDA device, not 'meta'$"):
            decode(frame, **kwargs)
    with pytest.raises(BadInputError, match=r"^out overlaps itself \(an expanded view\)"):
        decode(frame, out=torch.empty(1, 4).expand(3, 4))
    with pytest.raises(TypeError, match=r"^out must be a torch.Tensor, got ndarray$"):
        decode(frame, out=np.empty((3, 4), np.float32))
    assert torch.equal(decode(frame, out=torch.empty(4, 3).t()), decode(frame))  # strided is fine


def test_a_strided_frame_view_is_read_as_its_bytes_in_order():
    frame = bytes(Fp8Codec().encode(DENSE))
    doubled = bytes(b for pair in zip(frame, bytes(len(frame))) for b in pair)
    assert torch.equal(decode(memoryview(doubled)[::2]), decode(frame))  # was a BufferError


def test_a_result_too_large_to_allocate_is_named(monkeypatch):
    """An empty tensor's frame still holds a scale per channel or row: ``[0, 2**40]``
    under channel scaling asks for 2 TiB (numpy's raw MemoryError before)."""

    def refuse(*args, **kwargs):
        raise MemoryError("Unable to allocate")

    monkeypatch.setattr(fp8codec.np, "empty", refuse)
    with pytest.raises(BadInputError, match=r"^the result needs 2199023255588 bytes, more than this process can allocate$"):
        fp8codec._byte_buffer(None, 2199023255588)
