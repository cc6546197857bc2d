"""The Ray engine on a real local Ray: QuantPool, QuantWorker, archives, reliability."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from _util import quant_worker_pids
from safetensors.torch import load_file
from safetensors.torch import save_file as save_file_torch

import fp8ray
from fp8ray import Fp8Codec
from fp8ray.engine.archives import compress_archive, decompress_archive, verify_archive
from fp8ray.engine.pool import QuantPool
from fp8ray.errors import ArchiveExistsError, CorruptArchiveError, PoolStartError, SourceError
from fp8ray.io.archive import read_manifest
from fp8ray.io.paths import resolve

pytestmark = pytest.mark.usefixtures("ray_session")
REPO = Path(__file__).resolve().parents[2]
PART = 200_000  # bytes of input per part: several parts from the small sample


def part_bytes(directory: Path) -> dict[str, str]:
    """Each part's SHA-256: equal digests are equal bytes, and a failure prints briefly."""
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("part-*.parquet"))}


def test_encode_many_and_decode_many_keep_order_and_bytes():
    tensors = [torch.randn(3, 17, 64, dtype=dt) for dt in (torch.bfloat16, torch.float16, torch.float32)] * 7
    codec = Fp8Codec("e4m3fn", "token")
    with QuantPool(num_workers=2) as pool:
        frames = pool.encode_many(tensors, batch_size=2, fp8="e4m3fn", scaling="token")
        assert [bytes(f) for f in frames] == [bytes(codec.encode(t)) for t in tensors]
        back = pool.decode_many(frames, batch_size=3)
        assert all(torch.equal(b, fp8ray.decode(f)) for b, f in zip(back, frames))
        info = pool.worker_info()
    assert {i.device for i in info} == {"cpu"} and len({i.pid for i in info}) == 2


def test_the_pool_stores_tensors_fp8_does_not_encode_and_gives_them_back():
    tensors = [
        torch.arange(40) * 7,
        torch.randn(4, 64, dtype=torch.bfloat16),
        torch.tensor([[True, False]]),
        torch.randn(5).double(),
    ]
    with QuantPool(num_workers=2) as pool:
        frames = pool.encode_many(tensors, batch_size=1)
        assert [bytes(f) for f in frames] == [bytes(Fp8Codec().encode(t)) for t in tensors]
        back = pool.decode_many(frames, batch_size=2)
    assert [b.dtype for b in back] == [t.dtype for t in tensors]
    assert all(torch.equal(b, t) for b, t in zip(back, tensors) if t.dtype != torch.bfloat16)


def test_numpy_arrays_are_encoded_as_the_codec_encodes_them():
    """Fp8Codec.encode takes numpy arrays (read-only ones too); encode_many refused them."""
    data = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float16)
    arrays = [data, np.frombuffer(data.tobytes(), np.float16).reshape(6, 64), data[:, ::2], np.arange(7, dtype=np.int32)]
    with QuantPool(num_workers=2) as pool:
        frames = pool.encode_many(arrays, batch_size=1)
    assert [bytes(f) for f in frames] == [bytes(Fp8Codec().encode(a)) for a in arrays]
    with (
        QuantPool(num_workers=1, address="inline") as pool,
        pytest.raises(TypeError, match=r"^tensor 1: expected a torch.Tensor or numpy"),
    ):
        pool.encode_many([data, [1.0, 2.0]])


def test_bad_block_fails_with_its_key():
    tensors = [torch.ones(4, 8), torch.tensor([[1.0, float("nan")]])]
    with QuantPool(num_workers=1) as pool, pytest.raises(ValueError, match=r"block '1': 1 non-finite value"):
        pool.encode_many(tensors, batch_size=1)


def test_compress_verify_decompress_round_trip(kv_source, tmp_path):
    src, tensors = kv_source
    arch = tmp_path / "arch"
    report = compress_archive(str(src), str(arch), scaling="token", part_bytes=PART)
    assert report.blocks == 12 and report.parts > 1
    assert report.archive_bytes < report.raw_bytes * 0.6
    manifest = read_manifest(*resolve(str(arch)))
    assert manifest.blocks == 12 and manifest.codec["scaling"] == "token"
    assert sorted(os.listdir(arch)) == ["_manifest.json", *sorted(p.name for p in manifest.parts)]
    # Readable without fp8ray, and every frame is the codec's own encoding of its block.
    table = pq.read_table(arch)
    assert table.num_rows == 12 and table.schema.field("frame").type == "large_binary"
    codec = Fp8Codec("e4m3fn", "token")
    for key, f in zip(table.column("key").to_pylist(), table.column("frame").to_pylist()):
        assert f == bytes(codec.encode(tensors[key]))

    verified = verify_archive(str(arch), against=str(src))
    assert verified.ok, verified.errors
    assert set(verified.metrics) == set(tensors)
    assert all(0 < m["rel_fro"] < 0.05 and m["snr_db"] > 25 for m in verified.metrics.values())

    out = tmp_path / "out.safetensors"
    decompress_archive(str(arch), str(out))
    back = load_file(str(out))
    assert set(back) == set(tensors)
    for key, t in tensors.items():
        assert back[key].dtype == t.dtype and back[key].shape == t.shape
        assert torch.equal(back[key], fp8ray.decode(codec.encode(t)))


def test_inline_workers_run_verifys_torch_ops_on_their_own_threads(kv_source, tmp_path, monkeypatch):
    """Inline workers are threads of one process, where each torch op took every core's
    OpenMP threads: two workers spun four threads on two cores (verify --against of small
    blocks 2-5x slower under load). Each worker's ops use its own CPUs; the caller's
    setting is left as it was."""
    import fp8ray.codec.metrics as metrics
    import fp8ray.engine.comparison as comparison

    src, _ = kv_source
    arch = tmp_path / "arch"
    compress_archive(str(src), str(arch), part_bytes=PART, pool=fp8ray.PoolSettings(address="inline"))
    seen = []
    measure = metrics.row_sums
    spy = lambda x, y: (seen.append((torch.get_num_threads(), len(x))), measure(x, y))[1]  # noqa: E731
    monkeypatch.setattr(metrics, "row_sums", spy)  # a block's sums alone
    monkeypatch.setattr(comparison, "row_sums", spy)  # a run's
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what an idle machine of 2 cores or more gives each thread
    try:
        verified = verify_archive(str(arch), against=str(src), pool=fp8ray.PoolSettings(num_workers=2, address="inline"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert verified.ok and sum(rows for _, rows in seen) == 12 and {threads for threads, _ in seen} == {1}, seen


def test_scale_options_round_trip_through_an_archive(kv_source, tmp_path):
    """bfloat16 scales and the scale search reach the workers, the frames and the manifest."""
    src, tensors = kv_source
    arch = tmp_path / "arch"
    options = {"scaling": "block", "block_size": 32, "scale_dtype": "bfloat16", "scale_choice": "mse"}
    compress_archive(str(src), str(arch), part_bytes=PART, **options)
    assert read_manifest(*resolve(str(arch))).codec == {"fp8": "e4m3fn", "nonfinite": "error", **options}
    codec = Fp8Codec("e4m3fn", **options)
    table = pq.read_table(arch)
    for key, f in zip(table.column("key").to_pylist(), table.column("frame").to_pylist()):
        assert f == bytes(codec.encode(tensors[key]))
    decompress_archive(str(arch), str(tmp_path / "out.safetensors"))
    back = load_file(str(tmp_path / "out.safetensors"))
    for key, t in tensors.items():
        assert torch.equal(back[key], fp8ray.decode(codec.encode(t)))


def test_parts_are_identical_whatever_the_number_of_workers(kv_source, tmp_path):
    src, _ = kv_source
    compress_archive(str(src), str(tmp_path / "one"), part_bytes=PART, pool=fp8ray.PoolSettings(num_workers=1))
    compress_archive(str(src), str(tmp_path / "two"), part_bytes=PART, pool=fp8ray.PoolSettings(num_workers=2))
    one, two = part_bytes(tmp_path / "one"), part_bytes(tmp_path / "two")
    assert len(one) > 1 and one == two
    assert (tmp_path / "one/_manifest.json").read_bytes() == (tmp_path / "two/_manifest.json").read_bytes()


def test_raw_block_parquet_source(tmp_path):
    import pyarrow as pa

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((2, 8, 64)).astype(np.float32) for _ in range(5)]
    table = pa.table(
        {
            "key": [f"b{i}" for i in range(5)],
            "dtype": ["float32"] * 5,
            "shape": [list(a.shape) for a in arrays],
            "data": [a.tobytes() for a in arrays],
        }
    )
    pq.write_table(table, tmp_path / "raw.parquet", row_group_size=2)  # shards read only their row groups
    compress_archive(str(tmp_path / "raw.parquet"), str(tmp_path / "small-parts"), scaling="channel", part_bytes=1)
    compress_archive(str(tmp_path / "raw.parquet"), str(tmp_path / "arch"), scaling="channel")
    assert len(list((tmp_path / "small-parts").glob("part-*.parquet"))) == 5  # one block per part
    assert pq.read_table(tmp_path / "small-parts").column("frame") == pq.read_table(tmp_path / "arch").column("frame")
    decompress_archive(str(tmp_path / "arch"), str(tmp_path / "out.safetensors"), single_file=True)
    back = load_file(str(tmp_path / "out.safetensors"))
    codec = Fp8Codec("e4m3fn", "channel")
    for i, a in enumerate(arrays):
        assert torch.equal(back[f"b{i}"], fp8ray.decode(codec.encode(torch.from_numpy(a))))


def test_flipped_byte_is_named_by_verify_and_refused_by_decompress(kv_source, tmp_path):
    src, _ = kv_source
    arch = tmp_path / "arch"
    compress_archive(str(src), str(arch), part_bytes=PART, lossless="none")  # frames stored as they are, to damage one
    part = sorted(arch.glob("part-*.parquet"))[1]
    original = part.read_bytes()
    table = pq.read_table(part)
    victim_key = table.column("key")[1].as_py()
    victim = table.column("frame")[1].as_py()
    at = original.index(victim) + len(victim) // 2  # inside block 1's frame
    damaged = bytearray(original)
    damaged[at] ^= 0x10
    part.write_bytes(bytes(damaged))
    report = verify_archive(str(arch))
    assert not report.ok
    assert any(f"block {victim_key!r} in {part.name}" in e and "checksum" in e for e in report.errors), report.errors
    with pytest.raises(CorruptArchiveError, match=part.name):
        decompress_archive(str(arch), str(tmp_path / "out.safetensors"))
    assert not (tmp_path / "out.safetensors").exists()
    # Damage outside every frame (the Parquet footer's magic): the part is named.
    outside = bytearray(original)
    outside[-2] ^= 0x01
    part.write_bytes(bytes(outside))
    report = verify_archive(str(arch))
    assert not report.ok and any(part.name in e for e in report.errors), report.errors


def test_the_lossless_stage_is_recorded_as_one_spelling(kv_source, tmp_path):
    """'zstd:03' was recorded as given: the same stage under two names."""
    from fp8ray.io.archive import canonical_lossless

    spellings = {"zstd:03": "zstd:3", "zstd:3": "zstd:3", "zstd": "zstd", "none": "none", "lz4": "lz4"}
    assert {s: canonical_lossless(s) for s in spellings} == spellings
    src, _ = kv_source
    inline = fp8ray.PoolSettings(address="inline")
    compress_archive(str(src), str(tmp_path / "arch"), part_bytes=PART, lossless="zstd:03", pool=inline)
    assert read_manifest(*resolve(str(tmp_path / "arch"))).lossless == "zstd:3"


def test_a_flipped_byte_in_a_compressed_part_is_caught(kv_source, tmp_path):
    """With the lossless stage (zstd by default) the frames are not in the file as they
    are: damage anywhere is caught by the part's CRC-32C, and decompress leaves nothing."""
    src, _ = kv_source
    arch = tmp_path / "arch"
    compress_archive(str(src), str(arch), part_bytes=PART)
    assert read_manifest(*resolve(str(arch))).lossless == "zstd:3"
    assert pq.ParquetFile(sorted(arch.glob("part-*.parquet"))[0]).metadata.row_group(0).column(9).compression == "ZSTD"
    part = sorted(arch.glob("part-*.parquet"))[0]
    damaged = bytearray(part.read_bytes())
    damaged[len(damaged) // 3] ^= 0x04  # inside the compressed frames
    part.write_bytes(bytes(damaged))
    report = verify_archive(str(arch))
    assert not report.ok and any(part.name in e for e in report.errors), report.errors
    with pytest.raises(CorruptArchiveError, match=part.name):
        decompress_archive(str(arch), str(tmp_path / "out.safetensors"))
    assert not (tmp_path / "out.safetensors").exists()


def test_destination_and_source_errors(kv_source, tmp_path):
    src, _ = kv_source
    with pytest.raises(SourceError, match="does not exist"):
        compress_archive(str(tmp_path / "missing.safetensors"), str(tmp_path / "a"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SourceError, match="unknown format"):
        compress_archive(str(tmp_path / "notes.txt"), str(tmp_path / "a"))
    compress_archive(str(src), str(tmp_path / "a"))
    with pytest.raises(ArchiveExistsError, match="already holds an archive"):
        compress_archive(str(src), str(tmp_path / "a"))
    compress_archive(str(src), str(tmp_path / "a"), overwrite=True, scaling="block")
    assert read_manifest(*resolve(str(tmp_path / "a"))).codec["scaling"] == "block"
    with pytest.raises(CorruptArchiveError, match="no _manifest.json"):
        verify_archive(str(tmp_path))
    with pytest.raises(ValueError, match="unknown scaling"):
        compress_archive(str(src), str(tmp_path / "b"), scaling="row")


@pytest.fixture(scope="module")
def long_source(tmp_path_factory):
    """120 bf16 chunks of ~98 KB: 60 parts of two chunks, a job long enough to interrupt."""
    from safetensors.torch import save_file

    from fp8ray.eval.sample import sample_kv_chunk

    tensors = {f"chunk{i:03d}": sample_kv_chunk(layers=2, tokens=64, seed=i) for i in range(120)}
    path = tmp_path_factory.mktemp("long") / "kv.safetensors"
    save_file(tensors, str(path))
    return path


LONG_PART = 200_000


def test_sigkill_of_a_worker_mid_job_gives_identical_output(long_source, tmp_path):
    """One QuantWorker SIGKILLed once the job is under way: it is replaced, the shards it
    held are resubmitted, and the archive is byte-identical to an undisturbed run."""
    import threading

    compress_archive(str(long_source), str(tmp_path / "clean"), part_bytes=LONG_PART)
    faulty = tmp_path / "faulty"
    killed: list[int] = []

    def kill_one_when_started():
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            if faulty.exists() and any(faulty.glob("_part-*.json")):
                pids = quant_worker_pids()
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
            time.sleep(0.005)

    killer = threading.Thread(target=kill_one_when_started)
    killer.start()
    report = compress_archive(str(long_source), str(faulty), part_bytes=LONG_PART)
    killer.join()
    assert killed, "the job ended before a worker could be killed"
    assert report.workers_replaced >= 1
    assert part_bytes(faulty) == part_bytes(tmp_path / "clean")
    assert (faulty / "_manifest.json").read_bytes() == (tmp_path / "clean/_manifest.json").read_bytes()


def test_a_replacement_worker_the_cluster_cannot_place_fails_the_call_not_hangs(ray_session, monkeypatch):
    """A node died and no other had room: the replacement actor stayed pending and the
    pool waited on it for ever, silent (and a Ctrl-C then waited 120 s more in settle)."""
    from fp8ray.engine import backends
    from fp8ray.engine.worker import QuantWorker
    from fp8ray.errors import WorkerLostError

    ray = ray_session
    monkeypatch.setattr(backends, "REPLACEMENT_CHECK_SECONDS", 0.2, raising=False)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with QuantPool(num_workers=1, cpus_per_worker=0.5) as pool:
        backend = pool._backend
        backend._start_timeout = 2.0
        # Its replacement asks for what no node has, as one for a lost node's place may.
        backend._actor_class = ray.remote(QuantWorker).options(num_cpus=0.5, resources={"fp8ray-test-absent": 1})
        ray.kill(backend.workers[0])
        raised = []

        def call() -> None:
            try:
                pool.encode_many([x])
            except WorkerLostError as exc:
                raised.append(str(exc))

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(timeout=120)  # the old pool never returned: a bound for the test, not a speed
        assert not caller.is_alive(), "the pool waits for ever on a replacement that cannot start"
    [said] = raised
    assert re.search(r"the one replacing it did not start within 2 s .*each needs 0.5 CPU", said), said


@pytest.mark.slow
def test_driver_killed_then_resume_is_byte_identical(long_source, tmp_path):
    """The CLI driver SIGKILLed after some parts: no manifest; a plain rerun refuses; the
    same command with --resume reuses the finished parts and ends byte-identical."""
    import psutil

    compress_archive(str(long_source), str(tmp_path / "clean"), part_bytes=LONG_PART)
    arch = tmp_path / "resumed"
    args = ["compress", str(long_source), str(arch), "--workers", "1", "--part-mb", str(LONG_PART / 2**20)]
    cmd = [sys.executable, "-c", "import sys; from fp8ray.cli import main; sys.exit(main(sys.argv[1:]))", *args]
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(arch.glob("_part-*.json"))) < 3 and driver.poll() is None:
        time.sleep(0.005)
    started = [driver.pid] + [c.pid for c in psutil.Process(driver.pid).children(recursive=True)]
    for pid in started:  # the driver and the Ray it started, nothing else
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    driver.wait()
    assert not (arch / "_manifest.json").exists(), "the driver finished before it could be killed"
    finished = len(list(arch.glob("_part-*.json")))
    assert finished >= 3
    with pytest.raises(ArchiveExistsError, match="--resume"):
        compress_archive(str(long_source), str(arch), part_bytes=LONG_PART)
    report = compress_archive(str(long_source), str(arch), part_bytes=LONG_PART, resume=True)
    assert report.parts_reused >= finished - 1  # a part renamed just before the kill may lack its sidecar
    assert part_bytes(arch) == part_bytes(tmp_path / "clean")
    assert sorted(os.listdir(arch)) == sorted(os.listdir(tmp_path / "clean"))
    assert (arch / "_manifest.json").read_bytes() == (tmp_path / "clean/_manifest.json").read_bytes()


def test_inline_workers_write_the_same_archive_and_output(kv_source, tmp_path):
    """address="inline": QuantWorker objects on this process's threads, no Ray: the same
    parts, manifest and restored file as Ray's actors write, and errors as their own class."""
    src, _ = kv_source
    compress_archive(str(src), str(tmp_path / "ray"), part_bytes=PART, pool=fp8ray.PoolSettings(num_workers=2))
    compress_archive(
        str(src), str(tmp_path / "inline"), part_bytes=PART, pool=fp8ray.PoolSettings(num_workers=2, address="inline")
    )
    assert part_bytes(tmp_path / "inline") == part_bytes(tmp_path / "ray")
    assert (tmp_path / "inline/_manifest.json").read_bytes() == (tmp_path / "ray/_manifest.json").read_bytes()
    assert verify_archive(str(tmp_path / "inline"), against=str(src), pool=fp8ray.PoolSettings(address="inline")).ok
    decompress_archive(str(tmp_path / "ray"), str(tmp_path / "a.safetensors"))
    decompress_archive(str(tmp_path / "inline"), str(tmp_path / "b.safetensors"), pool=fp8ray.PoolSettings(address="inline"))
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    threads = os.environ.get("FP8RAY_NUM_THREADS")
    tensors = [torch.ones(4, 8), torch.tensor([[1.0, float("nan")]])]
    with (
        QuantPool(num_workers=2, address="inline") as pool,
        pytest.raises(fp8ray.NonFiniteError, match=r"block '1': 1 non-finite"),
    ):
        pool.encode_many(tensors, batch_size=1)
    assert os.environ.get("FP8RAY_NUM_THREADS") == threads  # the workers' thread setting is not left behind


def test_inline_workers_take_the_gpu_asked_for(kv_source, tmp_path):
    """Inline, gpus_per_worker puts every worker on this process's CUDA device, or fails
    at start naming what is missing; it is never silently the CPU."""
    if not torch.cuda.is_available():
        with pytest.raises(PoolStartError, match="inline workers, but this torch sees no CUDA device"):
            QuantPool(num_workers=1, gpus_per_worker=1, address="inline").__enter__()
        with pytest.raises(ValueError, match=r"device must be one of \['cpu', 'cuda'\] or None, got 'gpu'"):
            fp8ray.QuantWorker(device="gpu")
        return
    src, _ = kv_source
    with QuantPool(num_workers=2, gpus_per_worker=0.5, address="inline") as pool:
        assert {info.device for info in pool.worker_info()} == {"cuda"}
        report = compress_archive(str(src), str(tmp_path / "gpu"), part_bytes=PART, pool=pool)
    assert report.devices == ["cuda"]
    compress_archive(str(src), str(tmp_path / "cpu"), part_bytes=PART, pool=fp8ray.PoolSettings(address="inline"))
    assert part_bytes(tmp_path / "gpu") == part_bytes(tmp_path / "cpu")


def test_empty_tensors_and_inline_results_that_are_their_own(tmp_path):
    """Empty blocks round-trip through the object store and verify; inline workers hand
    out results that later batches do not overwrite."""
    tensors = [torch.zeros(0, 4, dtype=torch.bfloat16), torch.full((3, 8), 1.0), torch.full((3, 8), 2.0), torch.full((3, 8), 3.0)]
    for address in (None, "inline"):
        with QuantPool(num_workers=2, address=address) as pool:
            back = pool.decode_many(
                pool.encode_many(tensors, batch_size=1, scale_choice="amax", scale_dtype="float32"), batch_size=1
            )
        assert [t.shape for t in back] == [t.shape for t in tensors]
        assert [float(t.max()) for t in back[1:]] == [1.0, 2.0, 3.0], address
    from safetensors.torch import save_file

    save_file({"empty": torch.zeros(0, 4, dtype=torch.bfloat16), "full": torch.ones(4, 4)}, str(tmp_path / "kv.safetensors"))
    compress_archive(str(tmp_path / "kv.safetensors"), str(tmp_path / "arch"))
    assert verify_archive(str(tmp_path / "arch"), against=str(tmp_path / "kv.safetensors")).ok


@pytest.mark.parametrize("address", [None, "inline"])
def test_a_failed_compress_waits_for_running_parts_before_cleaning_up(tmp_path, address):
    """A part that fails ends the run while another worker is still writing its part:
    the run returns only once that part has ended, so the clean-up that follows leaves
    the (existing, empty) destination as it was found, even on a pool that outlives it."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"bad": torch.tensor([[1.0, float("nan")]])}, str(src / "a.safetensors"))  # part 0: fails at once
    save_file({"big": torch.randn(32, 1 << 20, dtype=torch.bfloat16)}, str(src / "b.safetensors"))  # part 1: slow
    dst = tmp_path / "dst"
    dst.mkdir()
    with QuantPool(num_workers=2, address=address) as pool:
        with pytest.raises(fp8ray.NonFiniteError):
            compress_archive(str(src), str(dst), part_bytes=1 << 20, pool=pool)
        pool.worker_info()  # on actors, this call waits behind anything still running
        inside = sorted(os.listdir(dst))
    assert inside == [] and sorted(os.listdir(dst)) == []  # on leaving, inline threads are joined


@pytest.mark.parametrize("fp8", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("scaling", ["none", "tensor", "token", "block"])
def test_verify_against_a_source_holding_kept_non_finite_values(tmp_path, fp8, scaling):
    """NaN and infinities kept (nonfinite="keep") are held to decode non-finite, and left
    out of the error sums: verify --against passes, and its report has no NaN."""
    import json

    x = torch.randn(4, 64)
    x[1, 3], x[2, 5], x[3, 7] = float("nan"), float("inf"), float("-inf")
    src = str(tmp_path / "nf.safetensors")
    save_file_torch({"a": x.to(torch.bfloat16), "b": torch.randn(4, 64).to(torch.bfloat16)}, src)
    inline = fp8ray.PoolSettings(address="inline")
    compress_archive(src, str(tmp_path / "a"), nonfinite="keep", fp8=fp8, scaling=scaling, pool=inline)
    report = verify_archive(str(tmp_path / "a"), against=src, pool=inline)
    assert report.ok, report.errors
    assert 0 < report.metrics["a"]["rel_fro"] < 0.1
    json.dumps(report.as_dict(), allow_nan=False)  # strict JSON: raises on a NaN or an infinity


def test_verify_against_names_a_block_of_another_dtype_or_shape(tmp_path):
    x = torch.randn(4, 64)
    save_file_torch({"k": x.to(torch.bfloat16), "v": x.to(torch.bfloat16)}, str(tmp_path / "bf16.safetensors"))
    save_file_torch({"k": x.half(), "v": x.to(torch.bfloat16).reshape(64, 4)}, str(tmp_path / "other.safetensors"))
    inline = fp8ray.PoolSettings(address="inline")
    compress_archive(str(tmp_path / "bf16.safetensors"), str(tmp_path / "a"), pool=inline)
    report = verify_archive(str(tmp_path / "a"), against=str(tmp_path / "other.safetensors"), pool=inline)
    assert not report.ok and len(report.errors) == 2
    assert "block 'k' in part-00000.parquet: the source holds [4, 64] float16, the archive [4, 64] bfloat16" in report.errors[0]
    assert "block 'v' in part-00000.parquet: the source holds [64, 4] bfloat16, the archive [4, 64] bfloat16" in report.errors[1]


@pytest.mark.parametrize(
    "edit, message",
    [
        (  # the total kept equal to the parts' sum, as a manifest edited with care would
            lambda m: (m["parts"][0].update(blocks=m["parts"][0]["blocks"] + 1), m.update(blocks=m["blocks"] + 1)),
            "the manifest records 3 blocks in part-00000",
        ),
        (  # what a reader of one block checks (a file name outside the output: refused on reading the manifest)
            lambda m: m["parts"][0].update(first_key=m["parts"][0]["last_key"]),
            "is damaged: its keys run from 'k0' to",
        ),
    ],
    ids=["part-blocks", "first-key"],
)
def test_verify_fails_a_manifest_that_get_or_decompress_would_refuse(tmp_path, edit, message):
    import json

    src = str(tmp_path / "kv.safetensors")
    save_file_torch({f"k{i}": torch.randn(4, 64).to(torch.bfloat16) for i in range(4)}, src)
    inline = fp8ray.PoolSettings(address="inline")
    compress_archive(src, str(tmp_path / "a"), pool=inline, part_bytes=1024)
    path = tmp_path / "a" / "_manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    report = verify_archive(str(tmp_path / "a"), pool=inline)
    assert not report.ok and any(message in e for e in report.errors), report.errors


def test_decompress_refuses_a_part_whose_entry_counts_other_blocks(tmp_path):
    """A hand-edited part entry's ``blocks`` (not covered by the part's CRC) passed
    decompress; verify named it."""
    import json

    src = str(tmp_path / "kv.safetensors")
    save_file_torch({f"k{i}": torch.randn(4, 64).to(torch.bfloat16) for i in range(4)}, src)
    inline = fp8ray.PoolSettings(address="inline")
    compress_archive(src, str(tmp_path / "a"), pool=inline)
    path = tmp_path / "a" / "_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["parts"][0]["blocks"] -= 1
    manifest["blocks"] -= 1  # the total kept equal to the parts' sum (else refused as it is read)
    path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptArchiveError, match=r"part part-00000.parquet of .* is damaged: it holds 4 blocks, its entry 3$"):
        decompress_archive(str(tmp_path / "a"), str(tmp_path / "out.safetensors"), pool=inline)
    assert not (tmp_path / "out.safetensors").exists()


def test_archive_functions_take_pathlib_paths(tmp_path):
    """compress_archive, verify_archive and decompress_archive take ``pathlib.Path`` s as
    their strings; another type is refused naming the argument."""
    src = tmp_path / "kv.safetensors"
    save_file_torch({"layer0.k": torch.randn(4, 64).to(torch.bfloat16)}, str(src))
    inline = fp8ray.PoolSettings(address="inline")
    assert compress_archive(src, tmp_path / "kv.fp8", pool=inline).blocks == 1
    assert verify_archive(tmp_path / "kv.fp8", against=src, pool=inline).ok
    decompress_archive(tmp_path / "kv.fp8", tmp_path / "out.safetensors", pool=inline)
    assert (tmp_path / "out.safetensors").exists()
    with pytest.raises(TypeError, match=r"^destination must be a path or URI \(a str or os.PathLike\), got int$"):
        compress_archive(src, 3, pool=inline)


def test_verify_finds_frames_in_other_options_than_the_manifest_records(tmp_path):
    """A manifest edited to other codec options (here token scaling over block-scaled
    frames) would have decompress --lmcache-form print a serde that misses every chunk:
    verify names each frame whose options differ."""
    import json

    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    save_file_torch({f"layer{i}.k": torch.randn(4, 64).to(torch.bfloat16) for i in range(3)}, str(src))
    inline = fp8ray.PoolSettings(address="inline")
    compress_archive(str(src), str(arch), pool=inline)
    assert verify_archive(str(arch), pool=inline).ok
    path = arch / "_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["codec"]["scaling"] = "token"
    path.write_text(json.dumps(manifest))
    report = verify_archive(str(arch), pool=inline)
    assert not report.ok and len(report.errors) == 3, report.errors
    assert report.errors[0] == (
        "block 'layer0.k' in part-00000.parquet: the frame is in e4m3fn, block 32, bfloat16 scales, "
        "the manifest records e4m3fn, token, bfloat16 scales"
    )
