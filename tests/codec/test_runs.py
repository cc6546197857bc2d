"""Runs of same-shape small blocks (fp8ray.codec.runs): encode_into and decode_into give,
byte for byte, the frames and tensors of coding each block alone, in every mode and on
adversarial values; a damaged frame or refused value inside a run is named by its key."""

import itertools

import numpy as np
import pytest
import torch

from fp8ray import CodecOptions, Fp8Codec, decode
from fp8ray.codec import frame, runs
from fp8ray.codec.blocks import Block, BlockSpec, decode_into, decode_rows_into, dtype_name, encode_into, frame_sizes
from fp8ray.errors import BadInputError, CorruptFrameError, MismatchError, NonFiniteError

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _modes():
    for fp8, scaling, scale_dtype in itertools.product(
        ["e4m3fn", "e5m2"], ["none", "tensor", "channel", "token", "block"], ["float32", "bfloat16"]
    ):
        choices = ["amax", "mse"] if scaling in ("token", "block") else ["amax"]
        for choice in choices:
            if scaling == "none" and scale_dtype == "bfloat16":
                continue
            yield CodecOptions(fp8=fp8, scaling=scaling, scale_dtype=scale_dtype, scale_choice=choice, nonfinite="keep")


def _adversarial(shape, dtype, g, i) -> torch.Tensor:
    """Random values, with every few blocks zeros, subnormals, a single huge element,
    all-equal values or non-finite ones."""
    x = torch.randn(shape, generator=g) * float(10 ** (i % 5 - 2))
    flat = x.view(-1)
    kind = i % 6
    if kind == 1:
        flat.zero_()
    elif kind == 2:
        flat[::3] = torch.finfo(dtype).tiny / 4  # subnormal in fp16 and fp32 (bf16: rounds to its own)
    elif kind == 3:
        flat[5] = torch.finfo(dtype).max / 2
    elif kind == 4:
        flat.fill_(0.375)
    elif kind == 5:
        flat[1], flat[7], flat[9] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype)


def _blocks(shapes, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [Block.of(f"k{i}", _adversarial(shape, dtype, g, i)) for i, shape in enumerate(shapes)]


# Two runs of one shape, a block of another shape between them, a block whose size no
# block_size of 32 divides, and blocks too large for a run.
SHAPES = [(4, 64)] * 7 + [(2, 3, 32)] + [(4, 64)] * 3 + [(3, 7)] * 3 + [(2, 128)] * 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", list(_modes()), ids=lambda o: o.label())
def test_runs_equal_coding_each_block_alone(options, dtype):
    codec = Fp8Codec(options=options)
    blocks = _blocks(SHAPES, dtype)
    sizes = frame_sizes(codec, blocks)
    out = np.zeros(sum(sizes), np.uint8)
    encode_into(codec, blocks, out, sizes, threads=2)
    ends = np.cumsum(sizes).tolist()
    frames = [(b.key, out[end - size : end]) for b, size, end in zip(blocks, sizes, ends)]
    for block, (_, f) in zip(blocks, frames):
        assert f.tobytes() == bytes(codec.encode(block.tensor())), block.key

    raw = np.zeros(sum(b.nbytes for b in blocks), np.uint8)
    decode_into(frames, raw, [BlockSpec(b.key, b.dtype, b.shape) for b in blocks], threads=2)
    start = 0
    for block, (_, f) in zip(blocks, frames):
        alone = decode(f)
        got = torch.from_numpy(raw[start : start + block.nbytes].copy()).view(alone.dtype).reshape(alone.shape)
        assert torch.equal(got.view(torch.uint8), alone.view(torch.uint8)), block.key  # bits, NaN included
        start += block.nbytes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", list(_modes()), ids=lambda o: o.label())
def test_rows_of_frames_decode_as_each_frame_alone(options, dtype):
    """decode_rows_into (frames one a row, as a part's lie end to end) gives each frame's
    own decoding, bit for bit: in a run where the mode allows one, else one at a time."""
    codec = Fp8Codec(options=options)
    blocks = _blocks([(4, 64)] * 9, dtype, seed=5)
    rows = np.stack([np.frombuffer(bytes(codec.encode(b.tensor())), np.uint8) for b in blocks])
    raw = np.zeros(9 * blocks[0].nbytes + 3, np.uint8)
    decode_rows_into([b.key for b in blocks], rows, raw, blocks[0].dtype, (4, 64), threads=2)
    for i, block in enumerate(blocks):
        alone = decode(rows[i])
        got = torch.from_numpy(raw[i * block.nbytes : (i + 1) * block.nbytes].copy()).view(alone.dtype).reshape(4, 64)
        assert torch.equal(got.view(torch.uint8), alone.view(torch.uint8)), block.key  # bits, NaN included
    assert not raw[-3:].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8", ["e4m3fn", "e5m2"])
def test_nans_decode_to_the_same_bits_alone_and_in_a_run(fp8, dtype):
    """A NaN among a block's last codes (past its whole vectors of 16, decoded one by one
    alone) falls inside a vector when blocks of its shape are decoded as one run: either
    way it is the canonical quiet NaN, so a frame's decoding does not depend on its batch."""
    canonical = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}[dtype]
    codec = Fp8Codec(fp8=fp8, scaling="none", nonfinite="keep")
    x = torch.tensor([1.0, 2.0, -3.0, 4.0, float("nan")] * 4, dtype=dtype)[:19]  # NaNs at 4, 9, 14 (a vector) and 19 - 1
    x[-1] = -float("nan")
    frames = [(f"k{i}", np.frombuffer(bytes(codec.encode(x)), np.uint8)) for i in range(8)]
    alone = decode(frames[0][1])
    raw = np.zeros(8 * x.numel() * x.element_size(), np.uint8)
    decode_into(frames, raw, [BlockSpec(key, dtype_name(x), tuple(x.shape)) for key, _ in frames], threads=2)
    int_type = {4: torch.int32, 2: torch.int16}[x.element_size()]
    in_run = torch.from_numpy(raw).view(int_type).reshape(8, -1)
    nan = torch.isnan(x)
    assert nan.sum() == 4
    for bits in (alone.view(int_type), *in_run):
        assert torch.equal(bits[~nan], x.view(int_type)[~nan])
        assert (bits[nan].to(torch.int64) & (1 << 8 * x.element_size()) - 1 == canonical).all(), bits[nan]


def test_rows_of_small_frames_are_decoded_as_one_run(monkeypatch):
    """The point of rows: no frame is decoded on its own (which costs microseconds each)."""
    from fp8ray.codec import blocks as blocks_module

    codec = Fp8Codec()
    rows = np.stack([np.frombuffer(bytes(codec.encode(torch.randn(4, 64, dtype=torch.float16))), np.uint8) for _ in range(5)])
    expected = np.zeros(5 * 512, np.uint8)
    decode_rows_into(list("abcde"), rows, expected, "float16", (4, 64))
    monkeypatch.setattr(blocks_module, "_decode_each", lambda *a: pytest.fail("a frame was decoded alone"))
    raw = np.zeros(5 * 512, np.uint8)
    decode_rows_into(list("abcde"), rows, raw, "float16", (4, 64))
    assert raw.tobytes() == expected.tobytes() and raw.any()


def test_rows_of_frames_refuse_what_they_cannot_hold():
    codec = Fp8Codec()
    rows = np.stack([np.frombuffer(bytes(codec.encode(torch.ones(4, 64, dtype=torch.float16))), np.uint8)] * 3)
    out = np.zeros(3 * 512, np.uint8)
    with pytest.raises(MismatchError, match=r"^block 'a'"):  # the frames hold [4, 64]: named by the first key
        decode_rows_into(["a", "b", "c"], rows, out, "float16", (64, 4))
    with pytest.raises(MismatchError, match=r"^block 'a'"):
        decode_rows_into(["a", "b", "c"], rows, out, "bfloat16", (4, 64))
    with pytest.raises(BadInputError, match="2 keys for 3 frames"):
        decode_rows_into(["a", "b"], rows, out, "float16", (4, 64))
    with pytest.raises(BadInputError, match="2-d uint8"):
        decode_rows_into(["a", "b", "c"], rows.reshape(-1), out, "float16", (4, 64))
    with pytest.raises(BadInputError, match="out holds 1535 bytes"):
        decode_rows_into(["a", "b", "c"], rows, out[:-1], "float16", (4, 64))


def test_blocks_are_coded_in_runs():
    """The runs are what the batch path takes: same dtype and shape, small, consecutive."""
    codec = Fp8Codec()
    blocks = _blocks(SHAPES, torch.bfloat16)
    fits = [runs.fits_run(codec.scaling, codec.block_size, b.dtype, b.shape) for b in blocks]
    assert fits == [True] * 7 + [True] + [True] * 3 + [False] * 3 + [True] * 2  # 21 elements: no block of 32
    assert runs.runs_of(blocks, lambda b: runs.fits_run(codec.scaling, codec.block_size, b.dtype, b.shape)) == [
        (0, 7),
        (8, 11),
        (14, 16),
    ]
    big = [BlockSpec(f"b{i}", "bfloat16", (runs.RUN_BLOCK_BYTES // 2 + 32,)) for i in range(3)]
    assert runs.runs_of(big, lambda b: runs.small(b.dtype, b.shape)) == []
    per_run = runs.RUN_BYTES // 4096
    many = [BlockSpec(f"m{i}", "float32", (1024,)) for i in range(per_run + 5)]
    assert runs.runs_of(many, lambda b: runs.small(b.dtype, b.shape)) == [(0, per_run), (per_run, len(many))]


def test_a_refused_value_in_a_run_is_named_by_its_block():
    codec = Fp8Codec()  # nonfinite="error"
    blocks = [Block.of(f"k{i}", torch.ones(4, 64, dtype=torch.bfloat16)) for i in range(6)]
    bad = torch.ones(4, 64, dtype=torch.bfloat16)
    bad[2, 5] = float("inf")
    blocks[4] = Block.of("k4", bad)
    sizes = frame_sizes(codec, blocks)
    with pytest.raises(NonFiniteError, match=r"^block 'k4': .*inf at index \[2, 5\]"):
        encode_into(codec, blocks, np.zeros(sum(sizes), np.uint8), sizes)


@pytest.mark.parametrize("rows", [False, True], ids=["frames", "rows"])
@pytest.mark.parametrize("index", [0, 3])
@pytest.mark.parametrize("where", ["crc", "header", "scale"])
def test_a_damaged_frame_in_a_run_is_named_by_its_key(where, index, rows):
    codec = Fp8Codec(nonfinite="keep")
    blocks = _blocks([(4, 64)] * 6, torch.bfloat16, seed=9)
    sizes = frame_sizes(codec, blocks)
    out = np.zeros(sum(sizes), np.uint8)
    encode_into(codec, blocks, out, sizes)
    frames = [(b.key, out[i * sizes[0] : (i + 1) * sizes[0]].copy()) for i, b in enumerate(blocks)]
    damaged = frames[index][1]
    if where == "crc":
        damaged[-20] ^= 1
    elif where == "header":
        damaged[5] = 2  # e5m2 in an e4m3fn run, resealed: a valid frame of other options
    else:
        header = codec._header((4, 64), "bfloat16")
        damaged[header.scales_offset : header.scales_offset + 2] = 0  # scale 0, resealed
    if where != "crc":
        frame.seal(damaged)
    specs = [BlockSpec(b.key, b.dtype, b.shape) for b in blocks]
    raw = np.zeros(sum(b.nbytes for b in blocks), np.uint8)

    def decode_all():
        if rows:
            decode_rows_into([k for k, _ in frames], np.stack([f for _, f in frames]), raw, "bfloat16", (4, 64))
        else:
            decode_into(frames, raw, specs)

    if where == "header":  # not damaged: decoded alone, as its own header says
        decode_all()
        got = torch.from_numpy(raw[index * 512 : (index + 1) * 512].copy()).view(torch.bfloat16).reshape(4, 64)
        assert torch.equal(got.view(torch.int16), decode(damaged).view(torch.int16))  # bits: e5m2 reads give NaN
        others = [i for i in range(6) if i != index]
        for i in others:
            alone = decode(frames[i][1]).view(torch.int16)
            assert torch.equal(torch.from_numpy(raw[i * 512 : (i + 1) * 512].copy()).view(torch.int16).reshape(4, 64), alone)
        return
    with pytest.raises(CorruptFrameError, match=rf"^block 'k{index}'"):
        decode_all()
