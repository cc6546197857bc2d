"""The frame's CRC-32C in pieces: the threads' pieces combine to the CRC-32C of the whole,
so a frame's checksum is the same however its encode was split."""

from __future__ import annotations

import os
import random

import crc32c
import numpy as np
import pytest
import torch
from _util import SCALINGS, kv_like

from fp8ray import Fp8Codec
from fp8ray.codec import checksum, cpu


@pytest.mark.parametrize("length_a, length_b", [(0, 0), (0, 7), (7, 0), (1, 1), (3, 4096), (4096, 3), (1000, 1 << 20)])
def test_combine_is_the_crc_of_the_concatenation(length_a, length_b):
    a, b = os.urandom(length_a), os.urandom(length_b)
    assert checksum.combine(crc32c.crc32c(a), crc32c.crc32c(b), length_b) == crc32c.crc32c(a + b)


def test_combining_many_pieces_in_order_is_the_crc_of_the_whole():
    rng = random.Random(4)
    data = os.urandom(50_000)
    cuts = sorted(rng.sample(range(1, len(data)), 9))
    crc = 0
    for start, stop in zip([0, *cuts], [*cuts, len(data)]):
        crc = checksum.combine(crc, crc32c.crc32c(data[start:stop]), stop - start)
    assert crc == crc32c.crc32c(data)
    assert checksum.combine(crc, 0, 0) == crc  # an empty piece changes nothing


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("choice", ["amax", "mse"])
@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_the_frame_checksum_is_the_crc_of_its_body_however_the_encode_is_split(scaling, choice, threads, monkeypatch):
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 4096)  # many tasks, a short last one
    monkeypatch.setenv("FP8RAY_NUM_THREADS", threads)
    x = kv_like((4, 100, 97), torch.bfloat16, seed=6)
    choice = choice if scaling in ("token", "block") else None
    frame = np.frombuffer(Fp8Codec("e4m3fn", scaling, block_size=100, scale_choice=choice).encode(x), np.uint8)
    assert int.from_bytes(frame[-4:].tobytes(), "little") == crc32c.crc32c(frame[:-4].tobytes())
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 1 << 20)  # one task: the same bytes
    monkeypatch.setenv("FP8RAY_NUM_THREADS", "1")
    assert bytes(Fp8Codec("e4m3fn", scaling, block_size=100, scale_choice=choice).encode(x)) == frame.tobytes()


@pytest.mark.parametrize(
    "count, per_task, threads, expected",
    [(0, 5, 2, 1), (5, 100, 2, 1), (2949120 // 32, (1 << 20) // 32, 2, 4), (7, 2, 3, 6), (100, 10, 4, 12), (3, 1, 4, 3)],
)
def test_spans_cover_the_items_in_order_in_a_multiple_of_the_threads(count, per_task, threads, expected):
    spans = cpu._spans(count, per_task, threads)
    assert len(spans) == expected
    assert spans[0][0] == 0 and spans[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    sizes = [stop - start for start, stop in spans]
    assert max(sizes) <= per_task and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("size", [0, 1, cpu.CHUNK_ELEMENTS, 3 * cpu.CHUNK_ELEMENTS + 5])
def test_the_threaded_crc_is_the_crc_of_the_whole(size, threads):
    """cpu.crc32c (the CUDA path's codes) splits the array over threads and combines."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert cpu.crc32c(data, threads) == crc32c.crc32c(data)
