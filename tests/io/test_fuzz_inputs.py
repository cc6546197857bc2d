"""Fuzzing the readers and the decoder with random and mutated inputs: every input gets
a documented error or a correct result, never another exception.

- safetensors headers and bodies: fp8ray accepts exactly what the ``safetensors`` package
  accepts (but for keys given twice, which fp8ray refuses), files and bodies alike;
- frames: a mutated frame either fails with ``CorruptFrameError`` or, if the mutation
  left it intact, decodes to exactly what the original decodes to.

Seeded, so a failure reproduces; the counts are printed (pytest -s) for the record.
"""

from __future__ import annotations

import json
import random
import struct

import pyarrow.fs as pafs
import safetensors
import torch

import fp8ray
from fp8ray import CodecOptions, Fp8Codec
from fp8ray.errors import CorruptFrameError, SafetensorsFormatError
from fp8ray.io.safetensors import ITEMSIZES, build_body, parse_body, read_file_header

ALL = tuple(ITEMSIZES)
HEADERS = 3000
FRAMES = 3000


def seed_bodies() -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    bodies = []
    for n in (1, 2, 5):
        tensors = [
            (f"t{i}", "bfloat16" if i % 2 else "float32", (2, i + 1), torch.randn(2, i + 1, generator=g)) for i in range(n)
        ]
        bodies.append(
            build_body([(k, d, s, t.to(getattr(torch, d)).view(torch.uint8).numpy()) for k, d, s, t in tensors], {"m": "v"})
        )
    return bodies


def mutate_json(header: dict, rng: random.Random) -> bytes:
    """A plausible header made wrong in one place: a number, a type, a key, a structure."""
    entries = [k for k in header if k != "__metadata__"]
    key = rng.choice(entries)
    entry = header[key]
    choice = rng.randrange(10)
    if choice == 0:
        entry["data_offsets"][rng.randrange(2)] += rng.choice([-8, -1, 1, 2, 2**40])
    elif choice == 1:
        entry["shape"][rng.randrange(len(entry["shape"]))] = rng.choice([0, -1, 3, 2.5, "2", True, None, 2**64, 1e30])
    elif choice == 2:
        entry["dtype"] = rng.choice(["F32", "BF16", "U8", "I64", "F64", "X", 3, None])
    elif choice == 3:
        del entry[rng.choice(list(entry))]
    elif choice == 4:
        header[key] = rng.choice([[], "x", 1, None])
    elif choice == 5:
        header["__metadata__"] = rng.choice([{"k": 1}, "s", None, {"k": "v"}, []])
    elif choice == 6:
        entry["data_offsets"] = rng.choice([[0], [0, 1, 2], "0,1", [0.0, 1.0]])
    elif choice == 7:
        other = rng.choice(entries)
        header[key]["data_offsets"] = list(header[other]["data_offsets"])  # overlap or duplicate range
    elif choice == 8:
        text = json.dumps(header)
        return (text[:-1] + f',"{key}":' + json.dumps(entry) + "}").encode()  # a key given twice
    else:
        entry["extra"] = rng.random()
    return json.dumps(header).encode()


def mutated_bodies(rng: random.Random):
    seeds = seed_bodies()
    for i in range(HEADERS):
        body = bytearray(rng.choice(seeds))
        (n,) = struct.unpack("<Q", body[:8])
        kind = i % 4
        if kind == 0:  # the JSON made wrong in one place, length fixed up
            header = json.loads(body[8 : 8 + n])
            text = mutate_json(header, rng)
            yield struct.pack("<Q", len(text)) + text + bytes(body[8 + n :])
        elif kind == 1:  # bytes flipped anywhere
            for _ in range(rng.randint(1, 4)):
                body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
            yield bytes(body)
        elif kind == 2:  # truncated or extended
            yield bytes(body[: rng.randrange(len(body))]) if rng.random() < 0.5 else bytes(body) + bytes(rng.randint(1, 9))
        else:  # random bytes with a plausible length prefix
            tail = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
            yield struct.pack("<Q", rng.choice([0, 2, len(tail), len(tail) + 5, 2**63])) + tail


def package_accepts(data: bytes) -> bool:
    try:
        safetensors.deserialize(data)
        return True
    except Exception:  # the package's own error types
        return False


def has_repeated_key(data: bytes) -> bool:
    try:
        (n,) = struct.unpack("<Q", data[:8])
        pairs: list = []
        json.loads(data[8 : 8 + n], object_pairs_hook=lambda p: pairs.append([k for k, _ in p]) or dict(p))
        return any(len(keys) != len(set(keys)) for keys in pairs)
    except Exception:
        return False


def test_fuzzed_safetensors_headers(tmp_path, capsys):
    rng = random.Random(12345)
    path = tmp_path / "f.safetensors"
    outcomes = {"accepted": 0, "refused": 0}
    for data in mutated_bodies(rng):
        try:
            entries, metadata = parse_body(data, ALL)
            accepted = True
        except SafetensorsFormatError:
            accepted = False
        expected = package_accepts(data) and not has_repeated_key(data)
        assert accepted == expected, data[:300]
        path.write_bytes(data)
        try:
            read_file_header(pafs.LocalFileSystem(), str(path), str(path), ALL)
            assert accepted
        except SafetensorsFormatError:
            assert not accepted
        if accepted:  # what was accepted is consistent: tensors end to end over the data
            position = 0
            for e, view in entries:
                assert e.begin == position and view.size == e.end - e.begin
                position = e.end
        outcomes["accepted" if accepted else "refused"] += 1
    with capsys.disabled():
        print(f"\nfuzzed safetensors headers: {HEADERS} inputs, {outcomes}")
    assert outcomes["accepted"] > 50 and outcomes["refused"] > 1000  # both sides exercised


def test_fuzzed_frames(capsys):
    rng = random.Random(54321)
    g = torch.Generator().manual_seed(1)
    seeds = []
    for scaling in ("none", "tensor", "channel", "token", "block"):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            codec = Fp8Codec(options=CodecOptions(scaling=scaling, block_size=8))
            frame = bytes(codec.encode(torch.randn(3, 16, generator=g).to(dtype)))
            seeds.append((frame, fp8ray.decode(frame)))
    outcomes = {"refused": 0, "decoded intact": 0}
    for i in range(FRAMES):
        frame, expected = rng.choice(seeds)
        data = bytearray(frame)
        kind = i % 3
        if kind == 0:
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] = rng.getrandbits(8)
        elif kind == 1:
            data = data[: rng.randrange(len(data))] if rng.random() < 0.7 else data + bytes(rng.randint(1, 16))
        else:
            data = bytearray(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
            if rng.random() < 0.5:
                data[:4] = b"FP8R"
        try:
            got = fp8ray.decode(bytes(data))
        except CorruptFrameError:
            outcomes["refused"] += 1
            continue
        assert bytes(data) == frame or torch.equal(got, expected), "a damaged frame decoded to something else"
        outcomes["decoded intact"] += 1
    with capsys.disabled():
        print(f"\nfuzzed frames: {FRAMES} inputs, {outcomes}")
    assert outcomes["refused"] > FRAMES * 0.9
