"""QuantPool.encode_refs / decode_refs: blocks and frames that stay in Ray's object store."""

from __future__ import annotations

import numpy as np
import psutil
import pytest
import torch

from fp8ray import CodecOptions, Fp8Codec, QuantPool, decode
from fp8ray.codec.blocks import Block
from fp8ray.errors import InvalidOptionError

pytestmark = pytest.mark.usefixtures("ray_session")
MIB = 1 << 20


def test_frames_by_reference_equal_the_local_codec_and_never_reach_the_driver(ray_session):
    ray = ray_session

    @ray.remote
    def produce(i: int) -> torch.Tensor:  # an upstream task: the block never passes the driver
        g = torch.Generator().manual_seed(i)
        return torch.randn(4 * MIB // 2 // 256, 256, generator=g).to(torch.bfloat16)  # 4 MiB

    @ray.remote
    def produce_block(i: int) -> Block:
        return Block.of(f"b{i}", torch.full((8, 64), float(i)))

    options = CodecOptions(scaling="token")
    count = 12
    with QuantPool(num_workers=2, cpus_per_worker=0.5) as pool:  # a CPU left for the upstream tasks
        inputs = [produce.remote(i) for i in range(count)]
        ray.wait(inputs, num_returns=count, fetch_local=False)
        rss = psutil.Process().memory_info().rss
        frames = pool.encode_refs(inputs, options)
        blocks = pool.decode_refs(frames)
        ray.wait(blocks, num_returns=count, fetch_local=False)
        grown = psutil.Process().memory_info().rss - rss
        assert grown < 16 * MIB, f"the driver grew by {grown / MIB:.0f} MiB for {count * 4} MiB of blocks it never fetched"
        assert len(frames) == len(blocks) == count
        codec = Fp8Codec(options=options)
        for i in (0, count - 1):  # fetched only when asked
            x = ray.get(inputs[i])
            frame = ray.get(frames[i])
            assert frame.tobytes() == bytes(codec.encode(x))
            back = ray.get(blocks[i])
            assert (back.key, back.dtype, back.shape) == (str(i), "bfloat16", tuple(x.shape))
            assert torch.equal(back.tensor(), decode(frame))
        # Blocks made upstream keep their keys; a failing block names its key.
        [frame] = pool.encode_refs([produce_block.remote(3)], scale_choice="amax")
        assert ray.get(frame).tobytes() == bytes(Fp8Codec(scale_choice="amax").encode(torch.full((8, 64), 3.0)))
        [bad] = pool.encode_refs([ray.put(torch.tensor([1.0, float("nan")]))])
        with pytest.raises(ValueError, match=r"block '0': 1 non-finite value"):
            ray.get(bad)


def test_refs_need_ray_workers():
    with QuantPool(num_workers=1, address="inline") as pool, pytest.raises(InvalidOptionError, match="need Ray workers"):
        pool.encode_refs([np.zeros(4)])
