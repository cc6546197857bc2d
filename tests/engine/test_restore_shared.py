"""One large file, decompressed by every worker at once: the driver writes its header and
size, each part's task its blocks' byte ranges. The output is the single writer's, byte
for byte, whatever the number of workers, after a worker is killed mid-write, and
whatever a range held before; no worker holds more than a part or two, whatever the
file's size."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _util import failing_fallocate, quant_worker_pids
from safetensors.torch import save_file

import fp8ray
import fp8ray.io.safetensors
from fp8ray import CodecOptions
from fp8ray.engine.archives import compress_archive, decompress_archive
from fp8ray.engine.worker import QuantWorker
from fp8ray.errors import DestinationError
from fp8ray.eval.sample import sample_kv_chunk
from fp8ray.io import archive
from fp8ray.io.paths import resolve
from fp8ray.io.restore import RESTORE_COLUMNS, RestorePlan, plan_restore

pytestmark = pytest.mark.usefixtures("ray_session")
FAST = CodecOptions(scaling="tensor", scale_choice="amax")  # the codec is not what these tests are about
INLINE = fp8ray.PoolSettings(num_workers=1, address="inline")
BLOCK_BYTES = 256 << 10  # sample_kv_chunk(layers=1) in bfloat16


def write_source(path: Path, blocks: int, prefix: str = "") -> Path:
    save_file(
        {f"{prefix}layer{i:03d}": sample_kv_chunk(layers=1, tokens=256, kv_heads=4, seed=i) for i in range(blocks)},
        str(path),
        {"model": "test"},
    )
    return path


def archive_of(src: Path, arch: Path, part_bytes: int) -> Path:
    compress_archive(str(src), str(arch), options=FAST, lossless="none", part_bytes=part_bytes, pool=INLINE)
    return arch


def restore_plan(arch: Path, ranged: bool, single_file_name: str | None = None) -> RestorePlan:
    fs, path = resolve(str(arch))
    manifest = archive.read_manifest(fs, path)
    columns = archive.read_metadata_columns(fs, path, manifest, RESTORE_COLUMNS)
    return plan_restore(manifest, columns, single_file_name, ranged)


def single_writer_output(arch: Path, directory: Path, single_file_name: str | None = None) -> bytes:
    """The file as one writer streams it, in order (what every output got before files
    were shared, and what object stores still get)."""
    plan = restore_plan(arch, ranged=False, single_file_name=single_file_name)
    (task,) = plan.tasks
    assert not plan.shared and not task.ranges
    manifest = archive.read_manifest(*resolve(str(arch)))
    directory.mkdir()
    QuantWorker(reuse_buffers=False, device="cpu").restore_files(
        str(arch), {i: manifest.parts[i] for i in task.parts}, task, str(directory)
    )
    return (directory / task.files[0].name).read_bytes()


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """One safetensors file of 24 blocks in 12 parts, and its single writer's output."""
    root = tmp_path_factory.mktemp("big")
    arch = archive_of(write_source(root / "kv.safetensors", 24), root / "arch", part_bytes=2 * BLOCK_BYTES)
    return arch, single_writer_output(arch, root / "one-writer")


def test_a_file_from_several_parts_is_shared_on_a_local_output_only(big_file):
    arch, _ = big_file
    shared = restore_plan(arch, ranged=True)
    assert [f.name for f in shared.shared] == ["kv.safetensors"] and shared.files == list(shared.shared)
    assert [t.parts for t in shared.tasks] == [(i,) for i in range(12)]  # one task per part, each one range
    assert all(not t.files and len(t.ranges) == 1 and t.blocks == 2 for t in shared.tasks)
    offsets = [r.offset for t in shared.tasks for r in t.ranges]
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [2 * BLOCK_BYTES] * 11  # end to end, in file order
    streamed = restore_plan(arch, ranged=False)
    assert not streamed.shared and [t.parts for t in streamed.tasks] == [tuple(range(12))]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_one_file_is_the_single_writers_byte_for_byte_with_any_number_of_workers(big_file, tmp_path, workers):
    arch, expected = big_file
    out = tmp_path / "back.safetensors"
    pool = fp8ray.PoolSettings(num_workers=workers, cpus_per_worker=0.5)  # 3 fit on the 2 CPUs of the tests' Ray
    report = decompress_archive(str(arch), str(out), pool=pool)
    assert (report.files, report.blocks, report.raw_bytes) == (1, 24, 24 * BLOCK_BYTES)
    assert out.read_bytes() == expected
    assert [p.name for p in tmp_path.iterdir()] == ["back.safetensors"]  # no scratch left


def test_single_file_of_a_tree_is_shared_too(tmp_path):
    src = tmp_path / "tree"
    src.mkdir()
    for f in range(3):  # keys unique across the files, as --single-file needs
        write_source(src / f"f{f}.safetensors", 3, prefix=f"f{f}.")
    arch = archive_of(src, tmp_path / "arch", part_bytes=2 * BLOCK_BYTES)
    expected = single_writer_output(arch, tmp_path / "one-writer", "one.safetensors")
    plan = restore_plan(arch, ranged=True, single_file_name="one.safetensors")
    assert len(plan.shared) == 1 and len(plan.tasks) > 1
    out = tmp_path / "one.safetensors"
    decompress_archive(str(arch), str(out), single_file=True, pool=fp8ray.PoolSettings(num_workers=2))
    assert out.read_bytes() == expected


def test_a_tree_shares_its_large_file_in_a_subfolder_and_streams_the_small_ones(tmp_path):
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    write_source(src / "a.safetensors", 1)
    write_source(src / "sub" / "big.safetensors", 7)
    write_source(src / "z.safetensors", 1)
    arch = archive_of(src, tmp_path / "arch", part_bytes=2 * BLOCK_BYTES)
    plan = restore_plan(arch, ranged=True)
    assert [f.name for f in plan.shared] == ["sub/big.safetensors"]
    assert sorted(f.name for t in plan.tasks for f in t.files) == ["a.safetensors", "z.safetensors"]
    streamed = restore_plan(arch, ranged=False)
    manifest = archive.read_manifest(*resolve(str(arch)))
    (tmp_path / "one-writer").mkdir()
    worker = QuantWorker(reuse_buffers=False, device="cpu")
    for task in streamed.tasks:
        (tmp_path / "one-writer" / "sub").mkdir(exist_ok=True)
        worker.restore_files(str(arch), {i: manifest.parts[i] for i in task.parts}, task, str(tmp_path / "one-writer"))
    out = tmp_path / "out"
    report = decompress_archive(str(arch), str(out), pool=fp8ray.PoolSettings(num_workers=2))
    assert report.files == 3 and report.blocks == 9
    for name in ("a.safetensors", "sub/big.safetensors", "z.safetensors"):
        assert (out / name).read_bytes() == (tmp_path / "one-writer" / name).read_bytes(), name


def test_ranges_written_again_in_any_order_over_anything_give_the_same_file(big_file, tmp_path):
    """What a retry after a worker killed mid-write does: the ranges are absolute, so a
    task run again, after others or over bytes a dying writer left, writes the same file."""
    arch, expected = big_file
    plan = restore_plan(arch, ranged=True)
    (shared,) = plan.shared
    shared.create_presized(str(tmp_path))
    path = tmp_path / shared.name
    header = len(expected) - 24 * BLOCK_BYTES
    with open(path, "r+b") as f:  # garbage where the data goes, as a half-written range might leave
        f.seek(header)
        f.write(b"\xa5" * (24 * BLOCK_BYTES))
    manifest = archive.read_manifest(*resolve(str(arch)))
    worker = QuantWorker(reuse_buffers=False, device="cpu")
    buffers = []  # held: a freed buffer's address could come back for a new one
    for task in [*reversed(plan.tasks), plan.tasks[3], plan.tasks[0]]:
        result = worker.restore_files(str(arch), {i: manifest.parts[i] for i in task.parts}, task, str(tmp_path))
        assert (result.files, result.blocks) == (0, 2)  # the driver counts the shared file, once
        buffers.append(worker._decoded)
    assert path.read_bytes() == expected
    assert all(b is buffers[0] for b in buffers)  # every task decoded into the pages of the one before


@pytest.mark.slow
def test_sigkill_of_a_worker_mid_write_gives_identical_output(tmp_path):
    src = write_source(tmp_path / "kv.safetensors", 96)
    arch = archive_of(src, tmp_path / "arch", part_bytes=2 * BLOCK_BYTES)
    expected = single_writer_output(arch, tmp_path / "one-writer")
    data_start = len(expected) - 96 * BLOCK_BYTES
    killed: list[int] = []

    def writing() -> bool:
        """A worker is writing: a block of the presized file is no longer zeros (its
        blocks are allocated as it is created, so its size on disk says nothing)."""
        for p in tmp_path.glob(".back.*.tmp-*/*.safetensors"):  # the file, not the folder's lock mark
            try:
                with open(p, "rb") as f:
                    if any(os.pread(f.fileno(), 8, data_start + i * BLOCK_BYTES).strip(b"\0") for i in range(96)):
                        return True
            except FileNotFoundError:  # the folder was renamed into place between glob and open
                pass
        return False

    def kill_one_when_writing():
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            if writing():
                pids = quant_worker_pids()
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
            time.sleep(0.002)

    killer = threading.Thread(target=kill_one_when_writing)
    killer.start()
    out = tmp_path / "back.safetensors"
    decompress_archive(str(arch), str(out), pool=fp8ray.PoolSettings(num_workers=2))
    killer.join()
    assert killed, "the job ended before a worker could be killed"
    assert out.read_bytes() == expected


# Restores every task of a plan on one inline worker, in this fresh process, and prints
# what it held at most: Arrow's allocations (the parts read, and the metadata) and
# Python's and numpy's (tracemalloc), once the decode kernel is loaded (its loading
# allocates 16 MB of Python objects, whatever the file).
MEASURE = """
import json, sys, tracemalloc
import pyarrow as pa
pa.set_cpu_count(1)  # Parquet decoded on one thread: allocations in the same order in every run
pa.set_io_thread_count(1)
import fp8ray
from fp8ray.engine.worker import QuantWorker
from fp8ray.io import archive
from fp8ray.io.paths import resolve
from fp8ray.io.restore import RESTORE_COLUMNS, plan_restore

arch, out, ranged = sys.argv[1], sys.argv[2], sys.argv[3] == "ranged"
fs, path = resolve(arch)
manifest = archive.read_manifest(fs, path)
columns = archive.read_metadata_columns(fs, path, manifest, RESTORE_COLUMNS)
plan = plan_restore(manifest, columns, None, ranged)
for f in plan.shared:
    f.create_presized(out)
worker = QuantWorker(reuse_buffers=False, device="cpu")
fp8ray.decode(next(archive.iter_frames(archive.read_part(fs, path, manifest.parts[0], columns=["frame"]))))
tracemalloc.start()
for task in plan.tasks:
    worker.restore_files(arch, {i: manifest.parts[i] for i in task.parts}, task, out)
arrow = pa.default_memory_pool().max_memory()
print(json.dumps({"arrow": arrow, "numpy": tracemalloc.get_traced_memory()[1]}))
"""


def peak_holdings(arch: Path, out: Path, mode: str) -> dict[str, int]:
    """What a worker held at most restoring ``arch``: Arrow's bytes and tracemalloc's."""
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(fp8ray.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(arch), str(out), mode], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["ranged", "one writer"])
def test_a_workers_peak_memory_is_bounded_by_a_part_not_by_the_file(tmp_path, mode):
    """The same 1 MiB parts, a file 4 times as large: a worker's peak holdings stay
    within a few parts (counted allocations, not RSS: steady from run to run)."""
    part_bytes = 4 * BLOCK_BYTES
    peaks, held = {}, {}
    for blocks in (16, 64):
        arch = archive_of(write_source(tmp_path / f"kv{blocks}.safetensors", blocks), tmp_path / f"arch{blocks}", part_bytes)
        held[blocks] = peak_holdings(arch, tmp_path / f"out{blocks}", mode)
        peaks[blocks] = held[blocks]["arrow"] + held[blocks]["numpy"]
    frame_part = part_bytes // 2  # fp8: a byte per bf16 element, and little else
    # Under heavy load the larger file's peak was seen a part higher now and then (why is
    # not pinned down); holding every part, as before this change, is 12 parts more here.
    # A batch of a part's blocks is decoded together (small blocks in runs): its raw bytes
    # and its codes gathered, at most a part's worth, come on top.
    batch = part_bytes + frame_part
    assert peaks[64] <= 5 * frame_part + 2 * BLOCK_BYTES + batch, held  # holding the 16 parts would be 8 MiB
    assert peaks[64] - peaks[16] <= 2 * frame_part, held  # 4 times the file, at most 2 parts more


def test_a_disk_without_room_for_the_shared_file_fails_before_any_work(big_file, tmp_path, monkeypatch):
    """Its blocks are allocated as it is created: ENOSPC comes from the driver, named as
    the output's error, and nothing is left behind."""
    monkeypatch.setattr(fp8ray.io.safetensors, "_fallocate", failing_fallocate(errno.ENOSPC))
    arch, _ = big_file
    out = tmp_path / "back.safetensors"
    with pytest.raises(DestinationError, match=f"cannot write output .*back.safetensors: {os.strerror(errno.ENOSPC)}"):
        decompress_archive(str(arch), str(out), pool=INLINE)
    assert list(tmp_path.iterdir()) == []


def test_workers_off_this_machine_get_the_single_writer_plan(big_file, tmp_path, ray_session):
    """Workers that are not all on this machine cannot write into its files: decompress
    plans one writer per file instead, with the same output."""
    from fp8ray.engine.pool import QuantPool
    from fp8ray.io.restore import RestoreFile

    arch, expected = big_file
    with QuantPool(num_workers=2) as pool:
        assert pool.on_this_machine()  # the suite's Ray has one node, this one
    with QuantPool(num_workers=1, address="inline") as pool:
        assert pool.on_this_machine()

    def not_shared(*args, **kwargs):
        raise AssertionError("no file is shared by workers elsewhere")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(QuantPool, "on_this_machine", lambda self: False)
        mp.setattr(RestoreFile, "create_presized", not_shared)
        out = tmp_path / "back.safetensors"
        decompress_archive(str(arch), str(out), pool=fp8ray.PoolSettings(num_workers=2, address="inline"))
    assert out.read_bytes() == expected
