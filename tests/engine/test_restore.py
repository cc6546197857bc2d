"""decompress gives back what was compressed, written by the workers: a directory of
files (keys repeating across files), a single file, a raw-block Parquet source; a worker
SIGKILLed mid-decompress; an interrupted decompress leaves nothing."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _util import quant_worker_pids
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fp8ray
from fp8ray import CodecOptions, Fp8Codec
from fp8ray.engine.archives import compress_archive, decompress_archive, verify_archive
from fp8ray.errors import ArchiveExistsError, CorruptArchiveError, DestinationError
from fp8ray.eval.sample import sample_kv_chunk

pytestmark = pytest.mark.usefixtures("ray_session")
OPTIONS = CodecOptions(scaling="token")
CODEC = Fp8Codec(options=OPTIONS)


def round_trip(t: torch.Tensor) -> torch.Tensor:
    return fp8ray.decode(CODEC.encode(t))


def read_metadata(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def key_order(path: Path) -> list[str]:
    """Keys in the order of their bytes in the file."""
    import json
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


@pytest.fixture(scope="module")
def request_dir(tmp_path_factory):
    """One file per request, each holding the same key names, with its own metadata, and
    an empty file that holds only metadata."""
    root = tmp_path_factory.mktemp("requests") / "kv"
    root.mkdir()
    files = {}
    for r in range(4):
        tensors = {
            f"layer{i}.{kv}": sample_kv_chunk(layers=1, tokens=16 + r, seed=10 * r + i, dtype=torch.bfloat16)[0, 0]
            for i in range(3)
            for kv in "kv"
        }
        save_file(tensors, str(root / f"req{r}.safetensors"), {"request": str(r)})
        files[f"req{r}.safetensors"] = tensors
    save_file({}, str(root / "empty.safetensors"), {"note": "metadata only"})
    files["empty.safetensors"] = {}
    return root, files


def test_a_directory_comes_back_file_by_file(request_dir, tmp_path):
    src, files = request_dir
    arch, out = tmp_path / "arch", tmp_path / "out"
    report = compress_archive(str(src), str(arch), options=OPTIONS, part_bytes=20_000)
    assert report.blocks == 24 and report.parts > 1
    assert verify_archive(str(arch), against=str(src)).ok
    back = decompress_archive(str(arch), str(out), pool=fp8ray.PoolSettings(num_workers=2))
    assert back.files == 5 and back.blocks == 24
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    for name, tensors in files.items():
        assert read_metadata(out / name) == read_metadata(src / name)
        assert key_order(out / name) == key_order(src / name)
        restored = load_file(str(out / name))
        assert list(restored) == list(load_file(str(src / name)))
        for key, t in tensors.items():
            assert torch.equal(restored[key], round_trip(t)), (name, key)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no scratch left


def test_single_file_restores_as_a_file_and_single_file_option(kv_source, tmp_path):
    src, tensors = kv_source
    arch = tmp_path / "arch"
    compress_archive(str(src), str(arch), options=OPTIONS, part_bytes=200_000)
    out = tmp_path / "back.safetensors"
    decompress_archive(str(arch), str(out))
    assert read_metadata(out) == read_metadata(src) and key_order(out) == key_order(src)
    restored = load_file(str(out))
    assert all(torch.equal(restored[k], round_trip(t)) for k, t in tensors.items())
    one = tmp_path / "one.safetensors"
    decompress_archive(str(arch), str(one), single_file=True)
    assert "fp8ray_archive" in read_metadata(one) and load_file(str(one)).keys() == restored.keys()
    assert read_metadata(one) == {**read_metadata(src), "fp8ray_archive": read_metadata(one)["fp8ray_archive"]}


def test_single_file_keeps_the_metadata_every_source_file_agrees_on(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        save_file({f"l{i}.k": torch.randn(4, 64)}, str(src / f"f{i}.safetensors"), {"model": "m", "part": str(i)})
    compress_archive(str(src), str(tmp_path / "arch"), pool=fp8ray.PoolSettings(address="inline"))
    one = tmp_path / "one.safetensors"
    decompress_archive(str(tmp_path / "arch"), str(one), single_file=True, pool=fp8ray.PoolSettings(address="inline"))
    assert read_metadata(one).keys() == {"model", "fp8ray_archive"} and read_metadata(one)["model"] == "m"


def test_single_file_refuses_keys_that_repeat_across_files(request_dir, tmp_path):
    src, _ = request_dir
    compress_archive(str(src), str(tmp_path / "arch"), options=OPTIONS)
    with pytest.raises(DestinationError, match=r"key 'layer0.k' is in both req0.safetensors and req1.safetensors"):
        decompress_archive(str(tmp_path / "arch"), str(tmp_path / "one.safetensors"), single_file=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch"]


def test_a_parquet_source_comes_back_with_its_columns(tmp_path):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((3, 40)).astype(np.float16) for _ in range(7)]
    schema = pa.schema(
        [("key", pa.large_string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int32())), ("data", pa.binary())],
        metadata={b"owner": b"me"},
    )
    table = pa.table(
        {
            "key": [f"b{i}" for i in range(7)],
            "dtype": ["float16"] * 7,
            "shape": [[3, 40]] * 7,
            "data": [a.tobytes() for a in arrays],
        },
        schema=schema,
    )
    pq.write_table(table, tmp_path / "raw.parquet", row_group_size=3)
    compress_archive(str(tmp_path / "raw.parquet"), str(tmp_path / "arch"), options=OPTIONS, part_bytes=500)
    decompress_archive(str(tmp_path / "arch"), str(tmp_path / "back.parquet"))
    back = pq.read_table(tmp_path / "back.parquet")
    assert back.schema.equals(pq.read_schema(tmp_path / "raw.parquet"), check_metadata=True)  # its metadata too
    assert back.schema.metadata == {b"owner": b"me"}
    assert back.column("key").to_pylist() == table.column("key").to_pylist()
    assert back.column("shape").to_pylist() == table.column("shape").to_pylist()
    for a, data in zip(arrays, back.column("data").to_pylist()):
        expected = round_trip(torch.from_numpy(a))
        assert data == expected.numpy().tobytes()
    with pytest.raises(DestinationError, match=r"ends in .safetensors, but the archive gives back a parquet file"):
        decompress_archive(str(tmp_path / "arch"), str(tmp_path / "back.safetensors"))


def test_destinations_are_checked_before_any_work(request_dir, kv_source, tmp_path):
    src, _ = request_dir
    arch = tmp_path / "arch"
    compress_archive(str(src), str(arch), options=OPTIONS)
    (tmp_path / "file").write_bytes(b"keep")
    for overwrite in (False, True):  # not "pass --overwrite", which would not help
        with pytest.raises(DestinationError, match="is a file, and the archive gives back a directory: not replacing it; name"):
            decompress_archive(str(arch), str(tmp_path / "file"), overwrite=overwrite)
    (tmp_path / "dir").mkdir()
    with pytest.raises(ArchiveExistsError, match=r"exists \(pass --overwrite to replace it with the archive's directory\)"):
        decompress_archive(str(arch), str(tmp_path / "dir"))
    assert (tmp_path / "file").read_bytes() == b"keep"
    with pytest.raises(DestinationError, match=r"directory .*missing does not exist"):
        decompress_archive(str(arch), str(tmp_path / "missing" / "out"))
    with pytest.raises(DestinationError, match="inside each other"):
        decompress_archive(str(arch), str(arch / "out"))
    decompress_archive(str(arch), str(tmp_path / "made" / "out"), parents=True)
    assert len(list((tmp_path / "made" / "out").iterdir())) == 5
    single, _ = kv_source
    compress_archive(str(single), str(tmp_path / "one"), options=OPTIONS)
    with pytest.raises(DestinationError, match="names a directory, but the archive gives back one file"):
        decompress_archive(str(tmp_path / "one"), str(tmp_path / "rdir2") + "/")


def test_overwrite_replaces_a_directory_only_when_complete(request_dir, tmp_path):
    src, files = request_dir
    arch, out = tmp_path / "arch", tmp_path / "out"
    compress_archive(str(src), str(arch), options=OPTIONS, part_bytes=20_000)
    out.mkdir()
    (out / "old").write_bytes(b"old")
    # A damaged part: the old output stays as it was.
    part = sorted(arch.glob("part-*.parquet"))[-1]
    good = part.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    part.write_bytes(bytes(bad))
    with pytest.raises(CorruptArchiveError, match=part.name):
        decompress_archive(str(arch), str(out), force_replace=True)
    assert [p.name for p in out.iterdir()] == ["old"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    part.write_bytes(good)
    # "old" is not the archive's: --overwrite alone leaves it, --force-replace says it deletes it, then does.
    with pytest.raises(DestinationError, match=r"holds 1 entry the archive does not describe \(old\)"):
        decompress_archive(str(arch), str(out), overwrite=True)
    said = []
    back = decompress_archive(str(arch), str(out), force_replace=True, announce=said.append)
    assert said == [f"--force-replace: replacing {out} deletes 1 entry the archive does not describe: old"]
    assert back.deleted == ["old"] and sorted(p.name for p in out.iterdir()) == sorted(files)
    decompress_archive(str(arch), str(out), overwrite=True)  # its own output: replaced without a word
    assert sorted(p.name for p in out.iterdir()) == sorted(files)


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("many") / "kv"
    root.mkdir()
    for f in range(24):
        save_file(
            {f"c{i}": sample_kv_chunk(layers=2, tokens=64, seed=100 * f + i) for i in range(4)},
            str(root / f"f{f:02d}.safetensors"),
        )
    return root


@pytest.mark.slow
def test_sigkill_of_a_worker_mid_decompress_gives_identical_output(many_files, tmp_path):
    arch = tmp_path / "arch"
    compress_archive(str(many_files), str(arch), options=OPTIONS, part_bytes=1 << 20)
    decompress_archive(str(arch), str(tmp_path / "clean"))
    faulty = tmp_path / "faulty"
    killed: list[int] = []

    def kill_one_when_started():
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            if any(tmp_path.glob(".faulty.tmp-*/*.safetensors")):
                pids = quant_worker_pids()
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
            time.sleep(0.005)

    killer = threading.Thread(target=kill_one_when_started)
    killer.start()
    decompress_archive(str(arch), str(faulty))
    killer.join()
    assert killed, "the job ended before a worker could be killed"
    clean = {p.name: p.read_bytes() for p in sorted((tmp_path / "clean").iterdir())}
    assert {p.name: p.read_bytes() for p in sorted(faulty.iterdir())} == clean


@pytest.mark.slow
def test_an_interrupted_decompress_leaves_nothing(many_files, tmp_path):
    """The driver stopped mid-run (KeyboardInterrupt, as Ctrl-C gives): no output, no scratch."""
    arch = tmp_path / "arch"
    compress_archive(str(many_files), str(arch), options=OPTIONS, part_bytes=1 << 20)
    seen = []

    def interrupt(n):
        seen.append(n)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        decompress_archive(str(arch), str(tmp_path / "out"), progress=interrupt)
    time.sleep(1)  # a worker may still finish a file into the scratch directory it was given
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch"]
