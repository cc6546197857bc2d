"""Inputs the codec cannot take, refused with fp8ray's own message naming what was wrong
(each gave torch's or numpy's own error before, or a wrong result): sparse, nested and
masked inputs, foreign byte orders, devices that hold no data, outputs that overlap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8ray import Fp8Codec, decode
from fp8ray.codec import fp8codec
from fp8ray.codec.blocks import Block, frame_sizes, frames_buffer
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
    for overlapping in (torch.empty(1, 4).expand(3, 4), torch.empty(8).as_strided((3, 4), (2, 1))):  # the second wrote on
        with pytest.raises(BadInputError, match=r"^out's strides \(\d, 1\) let elements of its shape \(3, 4\) share memory"):
            decode(frame, out=overlapping)
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


def test_a_batch_too_large_to_allocate_names_its_largest_block(monkeypatch):
    """The batch paths (encode_many, encode_refs, Ray Data's Fp8Encoder) put a batch's
    frames in one buffer: one no process can allocate is refused by the key of the block
    that needs it, as Fp8Codec.encode refuses it (numpy's MemoryError, naming none, before).
    Allocations of a TiB or more fail here as they would without overcommit."""
    from fp8ray import QuantPool

    empty = np.empty

    def bounded_empty(shape, *args, **kwargs):
        if np.prod(shape) >= 2**40:
            raise MemoryError("Unable to allocate")
        return empty(shape, *args, **kwargs)

    monkeypatch.setattr(np, "empty", bounded_empty)

    codec = Fp8Codec(scaling="token")
    blocks = [Block.of("small", torch.ones(3)), Block.of("huge", torch.empty(2**40, 0, dtype=torch.bfloat16))]
    sizes = frame_sizes(codec, blocks)
    refusal = r"^block 'huge': its frame needs 2199023255588 bytes, more than this process can allocate$"
    with pytest.raises(BadInputError, match=refusal):
        frames_buffer(blocks, sizes)
    with QuantPool(num_workers=1, address="inline") as pool, pytest.raises(BadInputError, match=refusal.replace("huge", "1")):
        pool.encode_many([blocks[0].tensor(), blocks[1].tensor()], scaling="token")


def test_outputs_that_overlap_their_input_are_refused_before_anything_is_written():
    """An ``out`` sharing memory with what is read: encode wrote its header over the
    tensor's first elements and sealed a frame of the wrong values (decode took it); a
    decode into the frame's own bytes overwrote the frame and blamed its checksum."""
    x = torch.randn(64)
    space = torch.zeros(1024, dtype=torch.uint8)
    codec = Fp8Codec()
    expected = bytes(codec.encode(x))
    size = len(expected)
    inside = space[:256].view(torch.float32)  # the tensor's bytes: space[:256]
    inside.copy_(x)
    for tensor in (inside, inside.view(torch.int32)):  # encoded, and stored
        out = space.numpy()[200 : 200 + codec.encoded_size(tensor.shape, tensor.dtype)]
        with pytest.raises(BadInputError, match=r"^out overlaps the tensor being encoded: give a buffer of its own$"):
            codec.encode(tensor, out=out)
    with pytest.raises(BadInputError, match=r"^out overlaps the tensor being encoded"):
        codec.encode_raw(space.numpy()[:256], "float32", (64,), out=space.numpy()[200 : 200 + size])
    assert torch.equal(inside, x)  # nothing written
    buf = np.frombuffer(bytearray(expected) + bytearray(512), np.uint8)
    with pytest.raises(BadInputError, match=r"^out overlaps the frame being decoded"):
        decode(buf[:size], out=torch.from_numpy(buf[16 : 16 + 256]).view(torch.float32))
    with pytest.raises(BadInputError, match=r"^out overlaps the frame being decoded"):
        fp8codec.decode_raw(buf[:size], "float32", (64,), out=buf[8 : 8 + 256])
    assert bytes(buf[:size]) == expected  # the frame untouched
    assert torch.equal(decode(expected), decode(buf[:size].copy()))


def test_an_out_that_requires_grad_is_refused_as_autograd_would():
    frame = Fp8Codec().encode(DENSE)
    for out in (torch.zeros(3, 4, requires_grad=True), torch.zeros(4, 3, requires_grad=True).t()):
        with pytest.raises(BadInputError, match=r"^out requires grad: decode writes it in place, outside autograd"):
            decode(frame, out=out)
        assert not out.detach().any()
    assert torch.equal(decode(frame, out=torch.zeros(3, 4, requires_grad=True).detach()), decode(frame))


@pytest.mark.parametrize("value", ["abc", "1.5", "0", "-1", ""])
def test_a_bad_thread_count_in_the_environment_is_named(monkeypatch, value):
    monkeypatch.setenv("FP8RAY_NUM_THREADS", value)
    if not value:  # unset in effect: the default
        assert fp8ray_threads() >= 1
        return
    with pytest.raises(InvalidOptionError, match=rf"^FP8RAY_NUM_THREADS must be a whole number of at least 1, got '{value}'$"):
        Fp8Codec().encode(DENSE)


def fp8ray_threads() -> int:
    from fp8ray.codec import cpu

    return cpu.num_threads()


def test_a_read_only_array_encodes_without_a_warning_and_numpy_integers_are_options(recwarn):
    """``np.load(..., mmap_mode="r")`` and ``np.frombuffer(bytes)`` give read-only arrays:
    torch warned that it could write them (fp8ray never does)."""
    data = np.random.default_rng(0).standard_normal(96).astype(np.float32)
    read_only = np.frombuffer(data.tobytes(), np.float32)
    codec = Fp8Codec(block_size=np.int64(16))
    assert codec.block_size == 16 and type(codec.block_size) is int
    expected = bytes(Fp8Codec(block_size=16).encode(torch.from_numpy(data)))
    assert bytes(codec.encode(read_only)) == bytes(codec.encode(data)) == expected
    assert not [w for w in recwarn.list if "not writable" in str(w.message)]
