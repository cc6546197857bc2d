"""--resume reuses parts only of the source files the interrupted run read: a file
rewritten since (same keys and shapes, new values) is refused by name, and so is a plan
written before the files' sizes and times were recorded."""

from __future__ import annotations

import json
import os

import pyarrow.fs as pafs
import pytest
import torch
from safetensors.torch import save_file

import fp8ray
from fp8ray.engine.archives import compress_archive, verify_archive
from fp8ray.errors import ArchiveExistsError
from fp8ray.io import archive

INLINE = fp8ray.PoolSettings(num_workers=1, address="inline")
PART = 40_000  # bytes of input per part: one block each


class Stop(Exception):
    pass


def write_source(path, seed: int) -> None:
    torch.manual_seed(seed)
    save_file({f"layer{i}.k": torch.randn(8, 1024).bfloat16() for i in range(6)}, str(path))


def interrupted(src, arch) -> None:
    """A compress stopped once its first part is finished: the plan and that part stay."""
    calls = []

    def progress(n):
        calls.append(n)
        if len(calls) == 2:  # the first call counts the parts reused
            raise Stop

    with pytest.raises(Stop):
        compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE, progress=progress)
    assert (arch / archive.PLAN_NAME).exists() and list(arch.glob("_part-*.json"))


def test_a_source_rewritten_since_is_not_resumed(tmp_path):
    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    write_source(src, 1)
    interrupted(src, arch)
    write_source(src, 2)  # the cache captured again into the same file: same keys, shapes and size
    stat = os.stat(src)
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a clock too coarse must not hide it
    plan = json.loads((arch / archive.PLAN_NAME).read_text())
    assert plan["files"][0][:2] == ["kv.safetensors", stat.st_size]
    with pytest.raises(
        ArchiveExistsError,
        match=r"cannot resume .*kv.fp8: source file kv.safetensors changed since the interrupted run read it "
        r"\(was \d+ bytes, modified at \d+ ns; now \d+ bytes, modified at \d+ ns\); pass --overwrite to start again$",
    ):
        compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE, resume=True)
    report = compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE, overwrite=True)
    assert report.parts_reused == 0
    assert verify_archive(str(arch), against=str(src), pool=INLINE).ok


def test_an_unchanged_source_is_resumed(tmp_path):
    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    write_source(src, 1)
    interrupted(src, arch)
    report = compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE, resume=True)
    assert report.parts_reused >= 1
    assert verify_archive(str(arch), against=str(src), pool=INLINE).ok


def test_a_plan_from_before_the_files_were_recorded_is_not_resumed(tmp_path):
    """Such a plan still loads; whether its source changed cannot be told, so it is refused."""
    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    write_source(src, 1)
    interrupted(src, arch)
    plan = json.loads((arch / archive.PLAN_NAME).read_text())
    del plan["files"]
    (arch / archive.PLAN_NAME).write_text(json.dumps(plan, sort_keys=True))
    assert archive.read_plan(pafs.LocalFileSystem(), str(arch)).files is None
    with pytest.raises(ArchiveExistsError, match=r"does not record the source files' sizes and times.*--overwrite"):
        compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE, resume=True)


@pytest.mark.parametrize("damage", ["a byte of the part", "the sidecar's block count"])
def test_a_finished_part_damaged_since_is_written_again_not_reused(tmp_path, damage):
    """--resume kept a part whose sidecar matched its size, damaged or not: compress exited
    0 and verify refused the archive. The part's CRC-32C and block count are checked now."""
    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    write_source(src, 1)
    interrupted(src, arch)
    sidecar, *others = sorted(arch.glob("_part-*.json"))
    part = arch / json.loads(sidecar.read_text())["name"]
    if damage == "a byte of the part":
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 1  # the same size
        part.write_bytes(data)
    else:
        info = json.loads(sidecar.read_text())
        sidecar.write_text(json.dumps({**info, "blocks": info["blocks"] + 1}))
    report = compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE, resume=True)
    assert report.parts_reused == len(others)  # the damaged one is written again
    assert verify_archive(str(arch), against=str(src), pool=INLINE).ok
