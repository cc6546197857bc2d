"""--resume reuses parts only of the source files the interrupted run read: a file
rewritten since (same keys and shapes, new values) is refused by name, and so is a plan
written before the files' sizes and times were recorded."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from safetensors.torch import save_file

import fp8ray
from fp8ray.engine.archives import compress_archive, verify_archive
from fp8ray.errors import ArchiveExistsError, InvalidOptionError, SourceError
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
        r"\(was \d+ bytes, modified at \d+ ns; now \d+ bytes, modified at \d+ ns\); "
        r"pass --overwrite instead of --resume to start again$",
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
    # Its speed is of the parts it wrote: the resumed ones' bytes took none of its seconds.
    written = fp8ray.open_archive(str(arch)).manifest.parts[report.parts_reused :]  # part 0 was finished
    assert report.written_raw_bytes == sum(p.raw_bytes for p in written) < report.raw_bytes
    assert report.input_gbps == report.written_raw_bytes / report.seconds / 1e9


def test_resume_and_overwrite_together_are_refused_keeping_the_finished_parts(tmp_path):
    """The tool's own advice names them as alternatives; given both, overwrite won and
    every finished part was written again, unsaid."""
    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    write_source(src, 1)
    interrupted(src, arch)
    before = sorted(p.name for p in arch.iterdir())
    with pytest.raises(InvalidOptionError, match="^--resume keeps what an interrupted compress finished, --overwrite"):
        compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE, resume=True, overwrite=True)
    assert sorted(p.name for p in arch.iterdir()) == before
    assert compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE, resume=True).parts_reused >= 1


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


def test_a_refused_resume_says_what_differs_and_takes_the_same_source_spelled_otherwise(tmp_path, monkeypatch):
    """Every refusal said "started from another source, options or plan (<source>, <codec>)",
    naming nothing that differed; and a relative path refused a plan an absolute one had
    written (a job is given absolute paths: resuming its archive from a shell failed)."""
    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    write_source(src, 1)
    interrupted(src, arch)
    for given, message in (
        (
            {"scaling": "token"},
            "with other codec options: scaling 'block' (this run's: 'token'); "
            "pass --overwrite instead of --resume to start again",
        ),
        ({"lossless": "none"}, "with another lossless stage, zstd:3 (this run's: none)"),
        ({"part_bytes": PART * 2}, "with another plan of parts ("),
    ):
        options = {"part_bytes": PART, **given}
        with pytest.raises(ArchiveExistsError, match=re.escape(f"it was started {message}")):
            compress_archive(str(src), str(arch), pool=INLINE, resume=True, **options)
    other = tmp_path / "other.safetensors"
    write_source(other, 1)
    with pytest.raises(ArchiveExistsError, match=re.escape(f"from another source, {src} (this run's: {other})")):
        compress_archive(str(other), str(arch), part_bytes=PART, pool=INLINE, resume=True)
    escaped = tmp_path / "o\x1b[31mther.safetensors"  # shown escaped, the refusal one line
    write_source(escaped, 1)
    with pytest.raises(ArchiveExistsError, match=re.escape(f"(this run's: {tmp_path}/o\\x1b[31mther.safetensors)")):
        compress_archive(str(escaped), str(arch), part_bytes=PART, pool=INLINE, resume=True)
    monkeypatch.chdir(tmp_path)
    report = compress_archive("./kv.safetensors", str(arch), part_bytes=PART, pool=INLINE, resume=True)
    assert report.parts_reused >= 1 and verify_archive(str(arch), against=str(src), pool=INLINE).ok


def test_a_run_started_with_a_relative_source_is_resumed_from_another_directory(tmp_path, monkeypatch):
    """The plan recorded the source as typed, and a resume resolved it against its own
    directory: an archive started as `fp8ray compress kv kv.fp8` could not be resumed by a
    job (given absolute paths, run in its own directory) nor from any other directory."""
    (tmp_path / "elsewhere").mkdir()
    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    write_source(src, 1)
    for given in (str(src), "../kv.safetensors"):
        shutil.rmtree(arch, ignore_errors=True)
        monkeypatch.chdir(tmp_path)
        interrupted(Path("kv.safetensors"), Path("kv.fp8"))
        monkeypatch.chdir(tmp_path / "elsewhere")
        report = compress_archive(given, str(arch), part_bytes=PART, pool=INLINE, resume=True)
        assert report.parts_reused >= 1 and verify_archive(str(arch), against=str(src), pool=INLINE).ok


def test_a_plan_spelling_its_lossless_stage_otherwise_is_resumed(tmp_path):
    """An earlier fp8ray recorded --lossless as typed ('zstd:03'); this one records
    'zstd:3', and must not refuse that run's archive for the spelling."""
    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    write_source(src, 1)
    interrupted(src, arch)
    plan = json.loads((arch / archive.PLAN_NAME).read_text())
    (arch / archive.PLAN_NAME).write_text(json.dumps({**plan, "lossless": "zstd:03"}, sort_keys=True))
    report = compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE, resume=True)
    assert report.parts_reused >= 1


@pytest.mark.parametrize("how", ["rewritten", "removed"])
def test_a_source_file_changed_while_compress_reads_it_fails_the_run_naming_it(tmp_path, how):
    """The workers read each file at the offsets the scan found: a file rewritten while a
    compress ran (a longer ``__metadata__`` moves every tensor) was archived from shifted
    bytes, and the run said it succeeded."""
    src, arch = tmp_path / "src", tmp_path / "kv.fp8"
    src.mkdir()
    write_source(src / "a.safetensors", 1)
    write_source(src / "z.safetensors", 2)

    done = []

    def progress(n):
        done.append(n)
        if how == "removed" and sum(done) == 12:  # every block read: the file goes before the manifest
            os.remove(src / "z.safetensors")
        elif how == "rewritten" and len(done) == 2:  # after the first part: z is read later
            torch.manual_seed(2)
            new = tmp_path / "z.new"
            tensors = {f"layer{i}.k": torch.randn(8, 1024).bfloat16() for i in range(6)}
            save_file(tensors, str(new), metadata={"note": "x" * 100})
            os.replace(new, src / "z.safetensors")

    now = r"now absent" if how == "removed" else r"now \d+ bytes"
    with pytest.raises(SourceError, match=rf"^source file z.safetensors changed while compress read it \(was \d+ bytes.*; {now}"):
        compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE, progress=progress)
    assert not arch.exists()


def test_an_archive_replaced_while_read_is_said_to_be_replaced_not_damaged(tmp_path):
    """verify and decompress running while a compress --overwrite replaced the archive
    reported every later part "damaged" (its footer's CRC not the entry's), or "N bytes,
    the manifest records M": the archive was fine, only another one."""
    first, second, arch = tmp_path / "first", tmp_path / "second", tmp_path / "kv.fp8"
    for seed, source in enumerate((first, second)):
        source.mkdir()
        for i in range(4):  # a file a task, each in parts of its own
            write_source(source / f"{i}.safetensors", 10 * seed + i)
    compress_archive(str(first), str(arch), part_bytes=PART, pool=INLINE)
    for command in ("verify", "decompress"):
        calls = []

        def replace_it(blocks, calls=calls):
            calls.append(blocks)
            if len(calls) == 1:  # a task done: another compress replaces the archive
                compress_archive(str(second), str(arch), part_bytes=PART, overwrite=True, scaling="token", pool=INLINE)

        said = rf"^archive {arch} was replaced while {command} read it \(a compress --overwrite\?\)"
        if command == "verify":
            report = verify_archive(str(arch), progress=replace_it, pool=INLINE)
            assert len(report.errors) == 1 and re.match(said, report.errors[0]), report.errors
        else:
            with pytest.raises(SourceError, match=said + ".*: run it again; nothing written$"):
                fp8ray.decompress_archive(str(arch), str(tmp_path / "out"), progress=replace_it, pool=INLINE)
            assert not (tmp_path / "out").exists()
        compress_archive(str(first), str(arch), part_bytes=PART, overwrite=True, pool=INLINE)


def test_an_interrupt_once_the_manifest_is_written_leaves_the_archive_whole(tmp_path, monkeypatch):
    """A Ctrl-C landing between the manifest's write and the removal of the plan and the
    sidecars left them in a complete archive (the CLI said "the compress had finished"; CI
    met it once, 0.09 s into a run)."""
    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    write_source(src, 1)
    clean_scratch = archive.clean_scratch
    calls = []

    def interrupted_once(fs, directory):
        calls.append(directory)
        if len(calls) == 1:
            raise KeyboardInterrupt
        clean_scratch(fs, directory)

    monkeypatch.setattr(archive, "clean_scratch", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        compress_archive(str(src), str(arch), part_bytes=PART, pool=INLINE)
    assert len(calls) == 2 and sorted(p.name for p in arch.iterdir() if not p.name.startswith("part-")) == ["_manifest.json"]
    assert verify_archive(str(arch), against=str(src), pool=INLINE).ok
