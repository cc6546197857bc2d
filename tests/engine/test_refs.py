"""QuantPool.encode_refs / decode_refs: blocks and frames that stay in Ray's object store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
import pytest
import torch

from fp8ray import CodecOptions, Fp8Codec, QuantPool, decode
from fp8ray.codec.blocks import Block
from fp8ray.engine.backends import RayBackend
from fp8ray.errors import BlockError, InvalidOptionError

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
        # A numpy array (Ray hands it over read-only) is encoded as Fp8Codec.encode takes it;
        # one it cannot take is refused by its key, the reason named.
        array = np.linspace(-3, 3, 512, dtype=np.float32).reshape(8, 64)
        frame, swapped = pool.encode_refs([ray.put(array), ray.put(array.astype(">f4"))])
        assert ray.get(frame).tobytes() == bytes(Fp8Codec().encode(array))
        with pytest.raises(TypeError, match=r"block '1': array dtype >f4 is not in this machine's byte order"):
            ray.get(swapped)
        # A block fp8ray refuses keeps its class and names its key in ``field`` (the service's JSON).
        [sparse] = pool.encode_refs([ray.put(torch.eye(3).to_sparse())])
        with pytest.raises(BlockError, match=r"block '0': cannot encode a sparse_coo tensor") as refused:
            ray.get(sparse)
        assert refused.value.cause.field == "0"


def test_refs_need_ray_workers():
    with QuantPool(num_workers=1, address="inline") as pool, pytest.raises(InvalidOptionError, match="need Ray workers"):
        pool.encode_refs([np.zeros(4)])


def test_batched_refs_of_mixed_sizes_keep_order_and_the_codec_bits(ray_session, monkeypatch):
    """Refs of Blocks and tensors, tiny (inlined by Ray) to several MiB, go several to a
    call; each frame is the local codec's, bit for bit, in input order; the driver calls
    ray.get on none of them."""
    ray = ray_session
    g = torch.Generator().manual_seed(7)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    rows = (1, 3, 2048, 5, 9000, 64, 2, 4096, 7, 300)  # [rows, 128]: 256 B to 4.4 MiB
    tensors = [(torch.randn(r, 128, generator=g) * (i + 1)).to(dtypes[i % 3]) for i, r in enumerate(rows)]
    inputs = [ray.put(Block.of(f"blk{i}", t) if i % 2 else t) for i, t in enumerate(tensors)]
    calls = []  # the number of refs in each call: a quarter of the 11 MiB each at most, two calls per worker
    submit_each = RayBackend.submit_each
    monkeypatch.setattr(
        RayBackend, "submit_each", lambda self, w, m, args, n: calls.append(n) or submit_each(self, w, m, args, n)
    )
    real_get, fetched = ray.get, []  # every ref the driver ray.get s (the pool asks its workers' info: not data)

    def recording_get(refs, *args, **kwargs):
        fetched.extend(refs if isinstance(refs, list) else [refs])
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(ray, "get", recording_get)
    options = CodecOptions(scaling="token", scale_choice="amax")
    with QuantPool(num_workers=2, cpus_per_worker=0.5) as pool:
        frames = pool.encode_refs(inputs, options)
        blocks = pool.decode_refs(frames)
        assert pool.encode_refs([]) == [] and pool.decode_refs([]) == []
        ray.wait(blocks, num_returns=len(blocks), fetch_local=False)  # before the workers stop
    assert not set(fetched) & {*inputs, *frames, *blocks}, "the driver fetched what it was only to pass on"
    assert sum(calls) == 2 * len(inputs) and len(calls) < 2 * len(inputs) and max(calls) > 1, calls
    monkeypatch.setattr(ray, "get", real_get)
    codec = Fp8Codec(options=options)
    for i, (t, frame, block) in enumerate(zip(tensors, real_get(frames), real_get(blocks), strict=True)):
        assert frame.tobytes() == bytes(codec.encode(t)), i
        assert (block.key, block.shape) == (str(i), tuple(t.shape))  # a frame carries no key: named by its place
        assert torch.equal(block.tensor(), decode(frame)), i


def test_a_bad_block_fails_the_refs_of_its_call_naming_it(ray_session):
    ray = ray_session
    tensors = [torch.full((2, 128), float(i), dtype=torch.float16) for i in range(4)]
    tensors[2][1, 5] = float("nan")
    inputs = [ray.put(t) for t in tensors]  # of one size: one worker's two calls take two each
    with QuantPool(num_workers=1, cpus_per_worker=0.5) as pool:
        frames = pool.encode_refs(inputs, scale_choice="amax")
        assert ray.get(frames[0]).tobytes() == bytes(Fp8Codec(scale_choice="amax").encode(torch.full((2, 128), 0.0).half()))
        with pytest.raises(ValueError, match=r"block '2': 1 non-finite value"):
            ray.get(frames[2])
        # Block 3 shares block 2's call where Ray knew both sizes (the usual case), and
        # fails with it; where it did not yet know one, each went alone. Never a wrong frame.
        try:
            assert ray.get(frames[3]).tobytes() == bytes(Fp8Codec(scale_choice="amax").encode(tensors[3]))
        except ValueError as exc:
            assert "block '2': 1 non-finite value" in str(exc)
        with pytest.raises(InvalidOptionError, match="ref 1: expected a Ray ObjectRef, got Tensor"):
            pool.encode_refs([inputs[0], torch.zeros(4)])


def test_a_worker_lost_fails_the_refs_it_held(ray_session, tmp_path):
    """Refs whose calls wait on their worker fail on ray.get once it dies: none is lost silently."""
    ray = ray_session
    go = tmp_path / "go"

    @ray.remote(num_cpus=0)
    def upstream(i: int) -> Block:  # still running when the refs are handed to the pool
        while not go.exists():
            time.sleep(0.05)
        return Block.of(f"b{i}", torch.full((4, 64), float(i)))

    with QuantPool(num_workers=1, cpus_per_worker=0.5) as pool:
        [pid] = [info.pid for info in pool.worker_info()]
        frames = pool.encode_refs([upstream.remote(i) for i in range(3)])
        os.kill(pid, 9)
        go.touch()
        for frame in frames:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(frame, timeout=60)


def test_a_worker_killed_while_idle_is_replaced_before_the_next_call(ray_session):
    """Only map's calls replaced a dead worker: every later encode_refs sent half its refs
    to the dead one (ActorDiedError), and worker_info (which decompress asks) raised Ray's
    own error."""
    ray = ray_session
    block = Block.of("b", torch.full((4, 64), 1.5))
    expected = bytes(Fp8Codec().encode(block.tensor()))
    with QuantPool(num_workers=2, cpus_per_worker=0.5) as pool:
        pids = [info.pid for info in pool.worker_info()]
        os.kill(pids[0], 9)
        psutil.wait_procs([psutil.Process(pids[0])], timeout=30)
        frames = pool.encode_refs([ray.put(block) for _ in range(4)])
        assert [bytes(ray.get(f, timeout=60)) for f in frames] == [expected] * 4 and pool.replaced == 1
        os.kill(pool.worker_info()[1].pid, 9)  # worker_info replaces one found dead, too
        time.sleep(1)
        assert len({info.pid for info in pool.worker_info()} - set(pids)) == 2 and pool.replaced == 2


def test_a_task_that_keeps_losing_its_worker_says_so_in_one_line(ray_session):
    """The refusal carried Ray's whole ActorDiedError text (9 lines from fp8ray compress)."""
    from fp8ray.errors import WorkerLostError

    with QuantPool(num_workers=1, cpus_per_worker=0.5, max_attempts=1) as pool:
        pid = pool.worker_info()[0].pid
        os.kill(pid, 9)
        psutil.wait_procs([psutil.Process(pid)], timeout=30)
        with pytest.raises(WorkerLostError) as info:
            pool.encode_many([torch.ones(4, 64)])
    assert "\n" not in str(info.value) and str(info.value).startswith("task 0 (encode_batch) lost its worker 1 times")


def test_a_pool_that_connected_itself_says_its_refs_end_with_it():
    """The README said refs outlive a pool that joined a cluster itself; they end with its
    connection (the driver owns them), so closing it says so."""
    script = (
        "import ray, torch, fp8ray\n"
        "with fp8ray.QuantPool(num_workers=1, cpus_per_worker=0.5, address='local') as pool:\n"
        "    frames = pool.encode_refs([ray.put(torch.ones(4, 64))])\n"
        "    print(len(ray.get(frames[0])))\n"
    )
    ray_tmp = tempfile.mkdtemp(prefix="frf", dir="/tmp")  # short: Ray's socket paths are limited
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(Fp8Codec().encoded_size((4, 64), torch.float32))
    assert "RuntimeWarning: fp8ray: this QuantPool connected to Ray itself and disconnects as it closes" in done.stderr


def test_refs_handed_out_stay_readable_after_the_pool_closes(ray_session, tmp_path, monkeypatch):
    """Closing the pool waits for the by-reference calls still running, then kills the
    actors: their refs read as the codec's; a call still running when the wait ends fails
    its refs, and the close says so."""
    ray = ray_session
    go = tmp_path / "go"

    @ray.remote(num_cpus=0)
    def upstream(i: int) -> torch.Tensor:  # still running when the pool closes
        while not go.exists():
            time.sleep(0.05)
        return torch.full((4, 64), float(i + 1))

    with QuantPool(num_workers=2, cpus_per_worker=0.5) as pool:
        frames = pool.encode_refs([upstream.remote(i) for i in range(4)], scale_choice="amax")
        blocks = pool.decode_refs(frames)
        go.touch()
    codec = Fp8Codec(scale_choice="amax")
    for i, (frame, block) in enumerate(zip(frames, blocks)):
        expected = bytes(codec.encode(torch.full((4, 64), float(i + 1))))
        assert ray.get(frame, timeout=60).tobytes() == expected
        assert torch.equal(ray.get(block, timeout=60).tensor(), decode(expected))

    go.unlink()
    monkeypatch.setattr("fp8ray.engine.pool.SETTLE_SECONDS", 0.5)
    with pytest.warns(RuntimeWarning, match=r"QuantPool closed with 1 encode_refs/decode_refs call\(s\) still running"):
        with QuantPool(num_workers=1, cpus_per_worker=0.5) as pool:
            [late] = pool.encode_refs([upstream.remote(0)])
    go.touch()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(late, timeout=60)


def test_a_pool_started_by_hand_on_ray_closes_its_actors_as_a_with_block_does(ray_session):
    """close() waits for the calls of the refs it handed out, then ends the actors."""
    ray = ray_session
    x = torch.randn(64, 256).to(torch.bfloat16)
    pool = QuantPool(num_workers=1, cpus_per_worker=0.5).start()
    [frame] = pool.encode_refs([ray.put(x)])
    [actor] = pool._backend.workers
    pool.close()
    assert ray.get(frame).tobytes() == bytes(Fp8Codec().encode(x))  # waited for, still there
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.info.remote(), timeout=60)
    pool.close()


def test_pools_one_after_another_share_one_actor_class(ray_session):
    """Each pool made its own Ray actor class, which Ray keeps until the process ends:
    about 136 KB in the driver and as much in the GCS per pool, for good."""
    import gc

    from fp8ray.engine.worker import QuantWorker

    def actor_classes() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, type) and o is not QuantWorker and issubclass(o, QuantWorker))

    x = torch.randn(64, 64)
    counts = []
    for _ in range(3):
        with QuantPool(num_workers=1, cpus_per_worker=0.5) as pool:
            assert bytes(pool.encode_many([x])[0]) == bytes(Fp8Codec().encode(x))
        counts.append(actor_classes())
    assert counts == [counts[0]] * 3, counts  # one class (and Ray's modified copy of it), not one more a pool
