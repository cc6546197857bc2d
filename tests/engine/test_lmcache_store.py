"""LMCache filesystem stores: chunk names, and conversion to/from the fp8 serde's files on Ray.

The fake store holds chunk files named as LMCache's FS adapter names them, in the small
layout bfloat16 [2, 2, 16, 64] with K about 8 and V about 1/64 in magnitude (so that V
reaches e4m3fn's subnormal range), plus files the conversion must leave alone.

Round-trip bound (docs/ACCURACY.md with scaling none, scale 1): x / 1 and q * 1 are
exact and every e4m3fn value is exact in bfloat16, so the only error is the fp8 rounding:

    |y - x| <= (u / (1 + u)) |x| + 2^(emin_sub - 1),   u = 2^-4, emin_sub = -9 (e4m3fn)

for |x| <= 448; beyond it the value saturates to +-448 by design.
"""

from __future__ import annotations

import hashlib
import json
import os
from types import SimpleNamespace

import pytest
import torch

from fp8ray.cli import main
from fp8ray.lmcache import Fp8QuantizationSerializer
from fp8ray.engine.stores import compress_store, decompress_store
from fp8ray.errors import ArchiveExistsError, DestinationError, NonFiniteError, SourceError
from fp8ray.io.lmcache_store import ChunkName, format_chunk_name, parse_chunk_name, parse_layout

pytestmark = pytest.mark.usefixtures("ray_session")

LAYOUT = "bfloat16:2,2,16,64"
SHAPE = (2, 2, 16, 64)
NUMEL = 2 * 2 * 16 * 64
RAW = NUMEL * 2
U, HALF_SUBNORMAL = 2.0**-4, 2.0**-10  # e4m3fn


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def kv_rank(world_size: int, rank: int) -> int:
    """LMCache's ObjectKey.ComputeKVRank with local == global."""
    return (world_size << 24) | (rank << 16) | (world_size << 8) | rank


CHUNKS = [
    ChunkName("meta-llama/Llama-3.1-8B-Instruct", kv_rank(1, 0), 0, bytes.fromhex("9f3a" * 16)),
    ChunkName("meta-llama/Llama-3.1-8B-Instruct", kv_rank(2, 1), 0, bytes.fromhex("0b17" * 16)),
    ChunkName("meta-llama/Llama-3.1-8B-Instruct", kv_rank(1, 0), 0x1F, bytes.fromhex("c4d5" * 16), "tenant-42"),
    ChunkName("Qwen/Qwen2.5-7B-Instruct", kv_rank(1, 0), 0, bytes.fromhex("77aa" * 16)),
    ChunkName("local-model", kv_rank(1, 0), 2, bytes.fromhex("01" * 8)),
]


def chunk_tensor(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(SHAPE, generator=g)
    kv[0] *= 8.0  # K
    kv[1] /= 64.0  # V: many values below e4m3fn's smallest normal 2^-6
    if seed == len(CHUNKS) - 1:  # the last chunk also has values beyond e4m3fn's range (+-448)
        kv[0, 0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 464.0])
    return kv.to(torch.bfloat16)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def store(tmp_path):
    src = tmp_path / "store"
    src.mkdir()
    tensors = {}
    for i, chunk in enumerate(CHUNKS):
        name = format_chunk_name(chunk)
        tensors[name] = chunk_tensor(i)
        (src / name).write_bytes(tensor_bytes(tensors[name]))
    short = format_chunk_name(ChunkName("meta-llama/Llama-3.1-8B-Instruct", kv_rank(1, 0), 0, b"\x01\x02"))
    (src / short).write_bytes(b"\0" * (RAW - 2))
    fp8_sized = format_chunk_name(ChunkName("meta-llama/Llama-3.1-8B-Instruct", kv_rank(1, 0), 0, b"\x03\x04"))
    (src / fp8_sized).write_bytes(b"\0" * NUMEL)
    (src / "notes.data").write_bytes(b"\0" * RAW)  # right size, not a chunk name
    (src / "m@0x1@zz@00.data").write_bytes(b"\0" * RAW)  # object_group_id is not hex
    (src / "tmp").mkdir()  # e.g. LMCache's relative_tmp_dir
    skipped = {short: "bytes, the layout needs", fp8_sized: "already compressed?", "notes.data": "not an LMCache chunk name",
               "m@0x1@zz@00.data": "not an LMCache chunk name", "tmp": "not a regular file"}
    return src, tensors, skipped


def digests(directory) -> dict[str, str]:
    return {p.name: sha(p.read_bytes()) for p in sorted(directory.iterdir()) if p.is_file()}


def test_chunk_names_follow_lmcache():
    name = ChunkName("meta-llama/Llama-3.1-8B", 0x01000100, 0x1F, bytes.fromhex("00ff10"), "tenant")
    assert format_chunk_name(name) == "meta-llama-SEP-Llama-3.1-8B@0x01000100@1f@00ff10@tenant.data"
    assert format_chunk_name(ChunkName("m", 1, 0, b"\xab")) == "m@0x00000001@0@ab.data"
    for chunk in CHUNKS:
        assert parse_chunk_name(format_chunk_name(chunk)) == chunk
    assert parse_chunk_name("a-SEP-b-SEP-c@0x2@A@FF.data") == ChunkName("a/b/c", 2, 10, b"\xff")
    bad = {
        "m@0x1@0@ab.bin": "does not end in .data",
        "m@0x1@ab.data": "3 '@'-separated fields",
        "m@0x1@0@ab@salt@x.data": "6 '@'-separated fields",
        "m@0x1@0@abc.data": "malformed",  # odd number of hex digits
        "m@rank@0@ab.data": "malformed",
        "m@0x1@-1@ab.data": "object_group_id must be >= 0",
        f"m@0x1@0@ab@{'s' * 129}.data": "at most 128",
        "m@0x1@0@ab@a\\b.data": "cache_salt must not contain",
    }
    for filename, reason in bad.items():
        with pytest.raises(ValueError, match=reason):
            parse_chunk_name(filename)
    with pytest.raises(ValueError, match="'@'"):
        ChunkName("a@b", 0, 0, b"")


def test_layout_parsing():
    assert parse_layout("bfloat16:2,30,256,192").shape == (2, 30, 256, 192)
    assert parse_layout("float32:4").raw_bytes == 16
    for text in ("bf16:2,3", "bfloat16", "bfloat16:2,x", "float16:2,0"):
        with pytest.raises(ValueError, match="layout"):
            parse_layout(text)


def test_compress_writes_exactly_the_fp8_serde_files_and_decompress_restores_within_bound(store, tmp_path):
    src, tensors, skipped = store
    before = digests(src)
    dst = tmp_path / "store.fp8"
    report = compress_store(str(src), str(dst), LAYOUT, workers=2)

    assert digests(src) == before  # the source is never touched
    assert sorted(os.listdir(dst)) == sorted(tensors)  # same names; skipped files are not copied
    assert report.files == len(tensors) and report.bytes_before == len(tensors) * RAW
    assert report.bytes_after == len(tensors) * NUMEL
    assert {s["name"]: s["reason"] for s in report.skipped}.keys() == skipped.keys()
    for s in report.skipped:
        assert skipped[s["name"]] in s["reason"], s
    serializer = Fp8QuantizationSerializer()
    for name, t in tensors.items():
        expected = torch.empty(NUMEL, dtype=torch.uint8)
        serializer.serialize(SimpleNamespace(tensor=t), SimpleNamespace(tensor=expected))
        written = (dst / name).read_bytes()
        assert sha(written) == sha(expected.numpy().tobytes()), name
        if t.abs().max() <= 448:  # and LMCache's own serde, a plain cast, gives the same bytes
            assert sha(written) == sha(t.to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()), name

    back = tmp_path / "store.bf16"
    report = decompress_store(str(dst), str(back), LAYOUT, workers=2)
    assert report.files == len(tensors) and report.skipped == [] and report.bytes_after == len(tensors) * RAW
    assert sorted(os.listdir(back)) == sorted(tensors)
    for name, x in tensors.items():
        y = torch.frombuffer(bytearray((back / name).read_bytes()), dtype=torch.bfloat16).reshape(SHAPE)
        # Exactly LMCache's deserializer, an fp8 -> bf16 cast of the stored bytes:
        codes = torch.frombuffer(bytearray((dst / name).read_bytes()), dtype=torch.uint8)
        assert torch.equal(y, codes.view(torch.float8_e4m3fn).to(torch.bfloat16).reshape(SHAPE))
        x64, y64 = x.double(), y.double()
        in_range = x64.abs() <= 448
        bound = (U / (1 + U)) * x64.abs() + HALF_SUBNORMAL
        assert bool(((y64 - x64).abs() <= bound)[in_range].all()), name
        assert torch.equal(y64[~in_range], 448.0 * x64[~in_range].sign())  # saturated, by design
        assert bool((y64 != x64).any())  # lossy indeed: the bound is what is tested
    saturating = tensors[format_chunk_name(CHUNKS[-1])]
    assert int((saturating.double().abs() > 448).sum()) == 3  # 1000, -1000 and 464 (which rounds to 448 too)


def test_non_finite_source_fails_naming_the_file_and_leaves_no_destination(store, tmp_path):
    src, tensors, _ = store
    bad = sorted(tensors)[2]
    x = tensors[bad].clone()
    x[1, 0, 3, 5] = float("nan")
    (src / bad).write_bytes(tensor_bytes(x))
    dst = tmp_path / "out"
    with pytest.raises(NonFiniteError, match=rf"{bad}.*1 non-finite value"):
        compress_store(str(src), str(dst), LAYOUT, workers=2)
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no scratch left


def test_destination_rules(store, tmp_path):
    src, tensors, _ = store
    dst = tmp_path / "exists"
    dst.mkdir()
    (dst / "keep").write_bytes(b"x")
    with pytest.raises(ArchiveExistsError, match="exists"):
        compress_store(str(src), str(dst), LAYOUT)
    assert os.listdir(dst) == ["keep"]
    with pytest.raises(DestinationError, match="is the source"):
        compress_store(str(src), str(src), LAYOUT)
    with pytest.raises(DestinationError, match="inside each other"):
        compress_store(str(src), str(src / "fp8"), LAYOUT)
    with pytest.raises(SourceError, match="not a directory"):
        compress_store(str(tmp_path / "missing"), str(tmp_path / "x"), LAYOUT)


def test_cli_json_overwrite_and_errors(store, tmp_path, capsys):
    src, tensors, skipped = store
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "stale").write_bytes(b"x")
    argv = ["lmcache-compress", str(src), str(dst), "--layout", LAYOUT, "--workers", "2"]
    assert main(argv) == 1
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "exists (pass --overwrite" in err

    assert main([*argv, "--overwrite", "--json"]) == 0
    out, _ = capsys.readouterr()
    report = json.loads(out)
    assert report["files"] == len(tensors) and {s["name"] for s in report["skipped"]} == set(skipped)
    assert report["bytes_before"] == 2 * report["bytes_after"] and report["fp8"] == "e4m3fn"
    assert sorted(os.listdir(dst)) == sorted(tensors)  # "stale" went with the old destination

    assert main(["lmcache-compress", str(src), str(tmp_path / "x"), "--layout", "bfloat16:2,2"]) == 0
    out, err = capsys.readouterr()  # every chunk has another size: all reported, none converted
    assert "compressed 0 chunk files" in out and err.count("fp8ray: skipped") == len(tensors) + len(skipped)


def test_overwrite_keeps_the_old_store_if_the_swap_fails(store, tmp_path, monkeypatch):
    """--overwrite moves the old destination aside, then the new one in; if that second
    rename fails, the old destination is put back and no scratch is left."""
    import fp8ray.engine.stores as lmcache_store

    src, _, _ = store
    dst = tmp_path / "previous"
    dst.mkdir()
    (dst / "keep").write_bytes(b"x")
    real_rename = os.rename

    def failing_rename(a, b):
        if str(b) == str(dst) and not str(a).endswith(".old"):  # the new store moving into place
            raise OSError("simulated failure of the swap")
        return real_rename(a, b)

    monkeypatch.setattr(lmcache_store.os, "rename", failing_rename)
    with pytest.raises(OSError, match="simulated"):
        compress_store(str(src), str(dst), LAYOUT, overwrite=True)
    assert os.listdir(dst) == ["keep"] and (dst / "keep").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous", "store"]  # no scratch left
