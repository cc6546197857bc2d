"""QuantPool's one scheduling loop, on both backends: calls are QuantWorker's own methods,
checked on the driver; order, window and per-worker load; settings checked at once."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch

import fp8ray
from fp8ray import CodecOptions, PoolSettings, QuantPool, QuantWorker
from fp8ray.codec.blocks import Block
from fp8ray.errors import InvalidOptionError, PoolStartError


def _batches(n: int):
    return [([Block.of(str(i), torch.full((2, 32), float(i)))], CodecOptions(scaling="tensor")) for i in range(n)]


@pytest.mark.parametrize("address", ["inline", None])
def test_a_wrong_call_fails_on_the_driver_before_anything_is_submitted(address, request):
    if address is None:
        request.getfixturevalue("ray_session")
    with QuantPool(num_workers=2, address=address) as pool:
        with pytest.raises(TypeError, match=r"QuantPool.map runs QuantWorker's methods"):
            next(pool.map(np.sum, [(1,)]))
        with pytest.raises(TypeError, match=r"QuantPool.map runs QuantWorker's methods"):
            next(pool.map("encode_batch", [(1,)]))  # a name is not a method
        with pytest.raises(TypeError, match=r"QuantWorker.encode_batch\(self, blocks.*missing a required argument: 'options'"):
            next(pool.map(QuantWorker.encode_batch, [([],)]))
        with pytest.raises(TypeError, match=r"each call of QuantWorker.decode_batch is a tuple of arguments, got list"):
            next(pool.map(QuantWorker.decode_batch, [[("k", b"")]]))
        # The pool is still usable: nothing was submitted.
        results = list(pool.map(QuantWorker.encode_batch, _batches(5)))
    assert [meta.key for [(_, meta)] in results] == ["0", "1", "2", "3", "4"]


def test_inline_calls_keep_order_and_no_worker_runs_two_at_once():
    """Inline, each worker object runs one call at a time, as an actor does: its buffers
    are never shared by two calls; the window bounds what is in flight."""
    active: dict[int, int] = {}
    most = {"per_worker": 0, "in_flight": 0}
    lock = threading.Lock()
    real = QuantWorker.encode_batch

    def watched(self, blocks, options):
        with lock:
            active[id(self)] = active.get(id(self), 0) + 1
            most["per_worker"] = max(most["per_worker"], active[id(self)])
            most["in_flight"] = max(most["in_flight"], sum(active.values()))
        try:
            threading.Event().wait(0.01)
            return real(self, blocks, options)
        finally:
            with lock:
                active[id(self)] -= 1

    watched.__name__ = "encode_batch"
    QuantWorker.encode_batch = watched
    try:
        with QuantPool(num_workers=3, address="inline", window=4) as pool:
            results = list(pool.map(QuantWorker.encode_batch, _batches(20)))
    finally:
        QuantWorker.encode_batch = real
    assert [meta.key for [(_, meta)] in results] == [str(i) for i in range(20)]
    assert most["per_worker"] == 1
    assert 1 < most["in_flight"] <= 3


def test_settings_are_checked_when_made_and_taken_by_every_operation(tmp_path):
    with pytest.raises(InvalidOptionError, match="num_workers must be a positive integer, got 0"):
        PoolSettings(num_workers=0)
    with pytest.raises(InvalidOptionError, match="cpus_per_worker must be a number above 0, got 0"):
        QuantPool(cpus_per_worker=0)
    with pytest.raises(InvalidOptionError, match="window must be a positive integer, got 0"):
        PoolSettings(window=0)
    for name, value, wanted in [
        ("gpus_per_worker", float("nan"), "a number at least 0"),
        ("gpus_per_worker", -0.5, "a number at least 0"),
        ("cpus_per_worker", float("inf"), "a number above 0"),
        ("start_timeout", -1, "a number above 0"),
        ("start_timeout", "60", "a number above 0"),
        ("max_attempts", 1.5, "a positive integer"),
        ("window", True, "a positive integer"),
        ("address", 5, "a string or None"),  # an AttributeError ('removeprefix') as the pool started
    ]:
        with pytest.raises(InvalidOptionError, match=rf"^{name} must be {wanted}, got {re.escape(repr(value))}$") as caught:
            PoolSettings(**{name: value})
        assert caught.value.field == name
    assert PoolSettings(num_workers=np.int64(3), gpus_per_worker=np.float64(0.5), start_timeout=1).num_workers == 3
    with pytest.raises(TypeError, match="pool must be a running QuantPool, PoolSettings or None, got int"):
        fp8ray.compress_archive(str(tmp_path / "none.safetensors"), str(tmp_path / "a"), pool=4)
    with pytest.raises(InvalidOptionError, match="unknown codec option 'workers'"):  # pool=PoolSettings(num_workers=4)
        fp8ray.compress_archive(str(tmp_path / "none.safetensors"), str(tmp_path / "a"), workers=4)
    with pytest.raises(TypeError, match=r"^QuantPool takes a PoolSettings, or its fields as keywords .*got dict$"):
        QuantPool({"num_workers": 2})  # dataclasses.replace's "should be called on dataclass instances"
    # Values an archive cannot be planned with: tracebacks from deep inside, or (0, -5, True, nan) one block a part.
    for name, value in [("part_bytes", 0), ("part_bytes", -5), ("part_bytes", True), ("part_bytes", float("nan"))]:
        with pytest.raises(InvalidOptionError, match=rf"^part_bytes must be a positive integer, got {re.escape(repr(value))}$"):
            fp8ray.compress_archive(str(tmp_path / "none.safetensors"), str(tmp_path / "a"), **{name: value})
    with pytest.raises(InvalidOptionError, match=r"^lossless must be a string such as 'zstd:3' or 'none', got None$"):
        fp8ray.compress_archive(str(tmp_path / "none.safetensors"), str(tmp_path / "a"), lossless=None)
    assert not (tmp_path / "a").exists()
    pool = QuantPool(PoolSettings(num_workers=3), address="inline")  # settings, then keywords over them
    assert (pool.settings.num_workers, pool.settings.address, pool.window) == (3, "inline", 6)
    with pytest.raises(RuntimeError, match="QuantPool is not running"):
        pool.worker_info()


def test_encode_many_and_decode_many_refuse_and_take_what_the_codec_does():
    """encode_many refuses what Fp8Codec.encode refuses, naming the tensor (a meta tensor
    gave torch's "Cannot copy out of meta tensor", a sparse one "unsupported memory
    format"); decode_many takes the frames fp8ray.decode takes (a CPU uint8 tensor, a
    strided memoryview: they were refused) and refuses a uint16 array (decoded as bytes
    before); a batch size must be an integer."""
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with QuantPool(num_workers=1, address="inline") as pool:
        for bad, pattern in (
            (torch.empty(3, device="meta"), "tensor 1: cannot encode a meta tensor"),
            (torch.eye(3).to_sparse(), "tensor 1: cannot encode a sparse_coo tensor"),
            (torch.ones(3, dtype=torch.complex128), "tensor 1: .*complex128"),
        ):
            with pytest.raises((TypeError, ValueError), match=pattern) as refused:
                pool.encode_many([x, bad])
            assert getattr(refused.value, "field", "1") == "1"  # fp8ray's own refusals name the tensor
        [frame] = pool.encode_many([x])
        doubled = np.repeat(np.asarray(frame), 2)  # every byte twice: [::2] is the frame, strided
        for given in (torch.from_numpy(np.array(frame)), memoryview(doubled)[::2], bytes(frame)):
            assert torch.equal(pool.decode_many([given])[0], fp8ray.decode(frame))
        with pytest.raises(TypeError, match="frame 0: a frame array must have dtype uint8, got uint16"):
            pool.decode_many([np.zeros(8, np.uint16)])
        for size in (1.5, "2", True, 0):
            with pytest.raises(InvalidOptionError, match=f"batch_size must be an integer of at least 1, got {size!r}"):
                pool.encode_many([x], batch_size=size)


def test_a_running_pool_cannot_be_entered_again():
    """A second ``with pool`` replaced the running backend (its workers never closed) and,
    on Ray, forgot that the pool had started its Ray, which then outlived the pool."""
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with QuantPool(num_workers=1, address="inline") as pool:
        backend = pool._backend
        with pytest.raises(PoolStartError, match=r"this QuantPool is running already: start it once \(with, or start\(\)\)"):
            with pool:
                pass
        assert pool._backend is backend and torch.equal(
            pool.decode_many(pool.encode_many([x]))[0], fp8ray.decode(fp8ray.Fp8Codec().encode(x))
        )
    assert pool._backend is None


def test_a_pool_started_and_closed_by_hand_is_the_pool_of_a_with_block():
    """Where a ``with`` block does not fit (a notebook): start() returns the running pool,
    close() stops it, a second close does nothing, and it can start again."""
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    expected = bytes(fp8ray.Fp8Codec().encode(x))
    pool = QuantPool(num_workers=2, address="inline")
    assert pool.start() is pool
    with pytest.raises(PoolStartError, match=r"running already: start it once"):
        pool.start()
    assert [bytes(f) for f in pool.encode_many([x])] == [expected]
    pool.close()
    with pytest.raises(PoolStartError, match=r"not running: use it as a context manager .*, or start\(\) it"):
        pool.encode_many([x])
    pool.close()
    pool.start()
    assert [bytes(f) for f in pool.encode_many([x])] == [expected]
    pool.close()
    assert pool._backend is None


def test_encode_many_and_decode_many_take_a_generator_as_a_list():
    """A one-pass iterable is taken once: the same frames and tensors as its list."""
    tensors = [torch.full((4, 64), float(i), dtype=torch.bfloat16) for i in range(3)]
    with QuantPool(num_workers=2, address="inline") as pool:
        frames = pool.encode_many(tensors)
        assert [bytes(f) for f in pool.encode_many(t for t in tensors)] == [bytes(f) for f in frames]
        back = pool.decode_many(f for f in frames)
    assert len(back) == 3 and all(torch.equal(b, fp8ray.decode(f)) for b, f in zip(back, frames))
