"""The one batch path: Block, frame_sizes, encode_into and decode_into."""

import numpy as np
import pytest
import torch

from fp8ray import CodecOptions, Fp8Codec, decode
from fp8ray.codec.blocks import Block, BlockSpec, decode_into, encode_into, frame_sizes
from fp8ray.errors import BlockError, CorruptFrameError

MODES = [CodecOptions(), CodecOptions(scaling="token", scale_choice="amax"), CodecOptions(fp8="e5m2", scaling="tensor")]


def _blocks() -> list[Block]:
    g = torch.Generator().manual_seed(7)
    tensors = [
        torch.randn(4, 96, generator=g).to(torch.bfloat16),
        torch.randn(3, 5, generator=g).to(torch.float16),
        torch.zeros(0, 8),
        torch.randn(2, 2, 64, generator=g),
    ]
    return [Block.of(f"b{i}", t) for i, t in enumerate(tensors)]


@pytest.mark.parametrize("options", MODES, ids=lambda o: o.label())
def test_encode_into_lays_each_blocks_own_frame_end_to_end(options):
    codec = Fp8Codec(options=options)
    blocks = _blocks()
    sizes = frame_sizes(codec, blocks)
    out = np.full(sum(sizes) + 5, 0xAB, np.uint8)  # room to spare: left untouched
    assert encode_into(codec, blocks, out, threads=1) == sizes
    start = 0
    for block, size in zip(blocks, sizes):
        assert out[start : start + size].tobytes() == bytes(codec.encode(block.tensor()))
        start += size
    assert out[start:].tolist() == [0xAB] * 5

    frames = [(b.key, out[s - n : s]) for b, n, s in zip(blocks, sizes, np.cumsum(sizes))]
    raw = np.empty(sum(b.nbytes for b in blocks), np.uint8)
    specs = decode_into(frames, raw, threads=2)
    assert specs == [BlockSpec(b.key, b.dtype, b.shape) for b in blocks]
    start = 0
    for block, (_, f) in zip(blocks, frames):
        expected = decode(f)
        got = raw[start : start + block.nbytes]
        assert got.tobytes() == expected.contiguous().view(torch.uint8).numpy().tobytes()
        start += block.nbytes


def test_thread_count_does_not_change_a_frame():
    x = torch.randn(64, 1 << 15).to(torch.bfloat16)  # several kernel chunks
    codec = Fp8Codec()
    one, three = bytes(codec.encode(x, threads=1)), bytes(codec.encode(x, threads=3))
    assert one == three
    assert torch.equal(decode(one, threads=1), decode(one, threads=3))


def test_a_bad_block_is_refused_where_it_is_made_naming_its_key():
    with pytest.raises(BlockError, match=r"block 'k': 6 bytes of data, its shape \[2, 2\] bfloat16 needs 8"):
        Block("k", "bfloat16", (2, 2), np.zeros(6, np.uint8))
    with pytest.raises(BlockError, match=r"block 'k': unsupported dtype 'complex128'"):
        Block("k", "complex128", (2,), np.zeros(16, np.uint8))
    with pytest.raises(BlockError, match=r"block 'k': unsupported dtype torch.complex128"):
        Block.of("k", torch.zeros(2, dtype=torch.complex128))
    with pytest.raises(BlockError, match=r"block 'k': data must be a 1-D uint8 array"):
        Block("k", "float32", (1,), b"\0\0\0\0")


def test_a_failing_frame_or_block_is_named_by_its_key():
    codec = Fp8Codec()
    good = Block.of("good", torch.ones(4, 32))
    nan = Block.of("nan", torch.tensor([[1.0, float("nan")]]))
    out = np.empty(sum(frame_sizes(codec, [good, nan])), np.uint8)
    with pytest.raises(ValueError, match=r"block 'nan': 1 non-finite value"):
        encode_into(codec, [good, nan], out)
    frame = np.frombuffer(bytes(codec.encode(good.tensor())), np.uint8).copy()
    frame[-1] ^= 1
    with pytest.raises(CorruptFrameError, match=r"^block 'bad': "):
        decode_into([("bad", frame)], np.empty(good.nbytes, np.uint8))
    sound = np.frombuffer(bytes(codec.encode(good.tensor())), np.uint8)
    with pytest.raises(ValueError, match=r"^block 'other': expected a \(32,\) float16 tensor, the frame holds \(4, 32\) float32"):
        decode_into([("other", sound)], np.empty(64, np.uint8), [BlockSpec("other", "float16", (32,))])
    with pytest.raises(ValueError, match=r"out holds 3 bytes"):
        encode_into(codec, [good], np.empty(3, np.uint8))


def test_frame_sizes_take_a_shape_given_as_a_list():
    codec = Fp8Codec()
    assert (
        frame_sizes(codec, [BlockSpec("k", "float32", [2, 32]), BlockSpec("j", "float32", (2, 32))])
        == [codec.encoded_size((2, 32), torch.float32)] * 2
    )
    with pytest.raises(BlockError, match="^block 'bad'"):
        frame_sizes(codec, [BlockSpec("bad", "complex128", [2])])
