"""``QuantPool``: the driver side. Starts ``QuantWorker`` actors and schedules shards on them.

>>> import torch
>>> tensors = [torch.randn(2, 16, 64, dtype=torch.bfloat16) for _ in range(3)]
>>> with QuantPool(num_workers=2) as pool:                  # joins Ray, or starts a local one
...     frames = pool.encode_many(tensors, scaling="token")  # in input order
...     restored = pool.decode_many(frames)
>>> [tuple(t.shape) for t in restored]
[(2, 16, 64), (2, 16, 64), (2, 16, 64)]

Scheduling keeps a bounded window of shards in flight (``ray.wait``), gathers results
in input order, replaces a worker that dies and resubmits its shards, and fails with
the block's key when a shard fails on its data, once the shards already running have
ended (so that nothing is written after the caller cleans up).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from ..codec import CodecOptions
from ..codec.formats import DTYPE_NAMES
from ..errors import PoolStartError, WorkerLostError
from ..io.blocks import bytes_to_tensor, dtype_name, tensor_to_bytes
from .worker import QuantWorker, WorkerInfo

# The address that runs the workers on this process's threads, without Ray; Ray is then
# never imported (a third of a second of a one-shot command), so it is imported where used.
INLINE = "inline"
# After a failure, how long map waits for the items already running to end: a worker
# cannot be interrupted mid-item, and one still writing a part or a file after the caller
# cleaned up would leave it behind.
SETTLE_SECONDS = 120.0


class QuantPool:
    """A pool of ``QuantWorker`` actors, used as a context manager.

    Args:
        num_workers: actors to start (spread across nodes).
        gpus_per_worker: GPUs each actor asks Ray for; fractions share a GPU.
        cpus_per_worker: CPUs each actor asks for, and the codec threads it runs.
        address: a cluster to join; ``None`` means ``RAY_ADDRESS`` if set, else an
            embedded local Ray (``"local"``). ``"inline"``: no Ray at all, the workers
            are ``QuantWorker`` objects run on threads of this process (the kernels,
            file I/O and Parquet release the GIL): no start-up cost, for local jobs;
            with ``gpus_per_worker > 0`` they all use this process's CUDA device.
        window: shards in flight at most (default two per worker); bounds the driver's memory.
        max_attempts: times a shard is tried when its worker dies.
        start_timeout: seconds to wait for the actors to start before failing (a
            cluster without the CPUs or GPUs asked for would otherwise wait forever).
    """

    def __init__(
        self,
        num_workers: int = 2,
        gpus_per_worker: float = 0,
        cpus_per_worker: float = 1,
        address: str | None = None,
        window: int | None = None,
        max_attempts: int = 3,
        start_timeout: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if gpus_per_worker < 0 or cpus_per_worker <= 0:
            raise ValueError(f"gpus_per_worker must be >= 0 and cpus_per_worker > 0, got {gpus_per_worker}, {cpus_per_worker}")
        self.num_workers = num_workers
        self.gpus_per_worker = gpus_per_worker
        self.cpus_per_worker = cpus_per_worker
        self.address = address
        self.window = window or 2 * num_workers
        self.max_attempts = max_attempts
        self.start_timeout = start_timeout
        self.workers: list = []
        self.replaced = 0
        self._owns_ray = False

    @property
    def inline(self) -> bool:
        return self.address == INLINE

    def __enter__(self) -> QuantPool:
        if self.inline:
            # Inline workers share this process's GPU when asked for one (Ray is not
            # there to hand out devices).
            device = "cuda" if self.gpus_per_worker > 0 else "cpu"
            if device == "cuda" and not torch.cuda.is_available():
                raise PoolStartError(f"gpus_per_worker={self.gpus_per_worker} with inline workers, but this torch sees no CUDA device")
            self._saved_threads = os.environ.get("FP8RAY_NUM_THREADS")
            threads = max(1, int(self.cpus_per_worker))
            self.workers = [QuantWorker(threads, reuse_buffers=False, device=device) for _ in range(self.num_workers)]
            self._threads = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="QuantWorker")
            return self
        import ray

        from .runtime import connect_ray

        embedded_cpus = max(int(self.num_workers * self.cpus_per_worker), os.cpu_count() or 1)
        self._owns_ray = connect_ray(self.address, embedded_cpus)
        try:  # an interrupt or failure while the workers start stops them (and the Ray started)
            self._actor_class = ray.remote(QuantWorker).options(
                num_cpus=self.cpus_per_worker,
                num_gpus=self.gpus_per_worker,
                scheduling_strategy="SPREAD",
            )
            for _ in range(self.num_workers):
                self.workers.append(self._new_worker())
            ready, _ = ray.wait([w.info.remote() for w in self.workers], num_returns=self.num_workers, timeout=self.start_timeout)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        if len(ready) < self.num_workers:
            self.__exit__(None, None, None)
            raise PoolStartError(
                f"only {len(ready)} of {self.num_workers} QuantWorkers started within {self.start_timeout:.0f} s: "
                f"the cluster lacks {self.cpus_per_worker} CPU(s) and {self.gpus_per_worker} GPU(s) per worker "
                f"(it has {ray.cluster_resources()})"
            )
        return self

    def __exit__(self, *exc) -> None:
        if self.inline:
            self._threads.shutdown(wait=True, cancel_futures=True)
            if self._saved_threads is None:  # QuantWorker set it for this process: put it back
                os.environ.pop("FP8RAY_NUM_THREADS", None)
            else:
                os.environ["FP8RAY_NUM_THREADS"] = self._saved_threads
            self.workers = []
            return
        import ray

        from .runtime import disconnect_ray

        try:
            for w in self.workers:
                ray.kill(w)
        finally:
            self.workers = []
            if self._owns_ray:
                self._owns_ray = False
                disconnect_ray()

    def _new_worker(self):
        return self._actor_class.remote(max(1, int(self.cpus_per_worker)))

    def worker_info(self) -> list[WorkerInfo]:
        if self.inline:
            return [w.info() for w in self.workers]
        import ray

        return ray.get([w.info.remote() for w in self.workers])

    def share(self, value):
        """``value`` as the workers should receive it when every item passes it: put in
        Ray's object store once (or as it is, inline)."""
        if self.inline:
            return value
        import ray

        return ray.put(value)

    def _map_inline(self, method: str, items: Iterator[tuple], on_result) -> Iterator[Any]:
        """:meth:`map` on this process's threads: the same window and order; each worker
        object runs one item at a time, and takes the next as soon as it is free."""
        free = list(range(self.num_workers))
        running: dict = {}  # future -> (input index, worker)
        done: dict[int, Any] = {}
        submitted = next_out = 0
        exhausted = False
        try:
            while True:
                while not exhausted and free and len(running) + len(done) < self.window:
                    item = next(items, None)
                    if item is None:
                        exhausted = True
                        break
                    w = free.pop()
                    running[self._threads.submit(getattr(self.workers[w], method), *item)] = (submitted, w)
                    submitted += 1
                if not running and not done:
                    return
                if next_out not in done:
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in finished:
                        index, w = running.pop(future)
                        free.append(w)
                        done[index] = future.result()  # the worker's own exception, if any
                        if on_result is not None:
                            on_result(done[index])
                while next_out in done:
                    yield done.pop(next_out)
                    next_out += 1
        finally:
            for future in running:
                future.cancel()
            wait(running, timeout=SETTLE_SECONDS)

    def map(self, method: str, items: Iterable[tuple], on_result: Callable[[Any], None] | None = None) -> Iterator[Any]:
        """Call ``QuantWorker.<method>(*item)`` for each item; yield results in input order.

        At most ``window`` items are in flight or waiting to be yielded, and each worker
        holds at most ``ceil(window / workers)`` of them. A worker that dies is
        replaced and its items resubmitted. An item failing on its data raises as soon
        as the items already running have ended (at most ``SETTLE_SECONDS``), so that
        nothing is written after the caller has cleaned up; queued items are dropped.
        """
        items = iter(items)
        if self.inline:
            yield from self._map_inline(method, items, on_result)
            return
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        per_worker = -(-self.window // self.num_workers)
        load = [0] * self.num_workers
        pending: dict[ray.ObjectRef, tuple[int, int, int, tuple]] = {}  # ref -> (index, worker, attempt, item)
        done: dict[int, Any] = {}
        submitted = next_out = 0
        exhausted = False

        def submit(index: int, item: tuple, attempt: int) -> None:
            w = min(range(self.num_workers), key=load.__getitem__)
            load[w] += 1
            pending[getattr(self.workers[w], method).remote(*item)] = (index, w, attempt, item)

        try:
            while True:
                while not exhausted and len(pending) + len(done) < self.window and min(load) < per_worker:
                    item = next(items, None)
                    if item is None:
                        exhausted = True
                        break
                    submit(submitted, item, 1)
                    submitted += 1
                if not pending:
                    break
                [ref], _ = ray.wait(list(pending), num_returns=1)
                index, w, attempt, item = pending.pop(ref)
                load[w] -= 1
                try:
                    done[index] = ray.get(ref)
                except RayActorError as exc:
                    if attempt >= self.max_attempts:
                        raise WorkerLostError(f"item {index} lost its worker {attempt} times; last: {exc}") from exc
                    self._replace_if_dead(w)
                    submit(index, item, attempt + 1)
                    continue
                except RayTaskError as exc:
                    raise _cause(exc) from None
                if on_result is not None:
                    on_result(done[index])
                while next_out in done:
                    yield done.pop(next_out)
                    next_out += 1
        finally:
            for ref in pending:  # the job failed or was abandoned: drop what is queued...
                try:
                    ray.cancel(ref, force=False)
                except (ValueError, TypeError):
                    pass
            # ...and let what is running end before the caller cleans up. A cancelled
            # ref resolves at once while its task runs on, so wait instead for a call
            # queued behind it on each busy actor (an actor runs one call at a time).
            busy = {w for _, w, _, _ in pending.values() if w < len(self.workers)}
            try:
                if busy:
                    ray.wait([self.workers[w].info.remote() for w in busy], num_returns=len(busy), timeout=SETTLE_SECONDS)
            except Exception:  # Ray gone or leaving: nothing left to wait for; keep the real error
                pass

    def _replace_if_dead(self, w: int) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            ray.get(self.workers[w].info.remote(), timeout=30)
        except (RayActorError, GetTimeoutError):
            ray.kill(self.workers[w])
            self.workers[w] = self._new_worker()
            self.replaced += 1

    def encode_many(
        self, tensors: list[torch.Tensor], batch_size: int | None = None, options: CodecOptions | None = None, **codec_options
    ) -> list[np.ndarray]:
        """Encode tensors on the workers, through the object store; frames in input order.
        Codec options as :class:`~fp8ray.codec.CodecOptions` (``options``, then keywords
        overriding it; the default mode if none). ``batch_size``: blocks per task
        (default: about :data:`BATCH_BYTES` of input each)."""
        options = CodecOptions.parse(codec_options, base=options)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dtype not in DTYPE_NAMES:
                raise TypeError(f"tensor {i}: expected a bfloat16, float16 or float32 torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        blocks = [(str(i), dtype_name(t), tuple(t.shape), tensor_to_bytes(t.cpu())) for i, t in enumerate(tensors)]
        batches = ((batch, options) for batch in _batches(blocks, batch_size, lambda b: b[3].size))
        return [f for batch in self.map("encode_batch", batches) for f, _ in batch]

    def decode_many(self, frames: list, batch_size: int | None = None) -> list[torch.Tensor]:
        """Decode frames on the workers; tensors in input order."""
        pairs = [(str(i), np.frombuffer(f, dtype=np.uint8)) for i, f in enumerate(frames)]
        batches = ((batch,) for batch in _batches(pairs, batch_size, lambda p: 2 * p[1].size))
        return [
            bytes_to_tensor(raw, meta.dtype, meta.shape).clone()
            for batch in self.map("decode_batch", batches)
            for raw, meta in batch
        ]


# Input bytes per task of encode_many/decode_many: enough to amortise a task's cost
# (milliseconds), small enough to keep every worker busy and the window's memory bounded.
BATCH_BYTES = 16 << 20


def _batches(items: list, batch_size: int | None, nbytes) -> Iterator[list]:
    """``items`` in order, ``batch_size`` at a time, or about BATCH_BYTES at a time."""
    if batch_size is not None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        yield from (items[i : i + batch_size] for i in range(0, len(items), batch_size))
        return
    batch: list = []
    size = 0
    for item in items:
        if batch and size + nbytes(item) > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes(item)
    if batch:
        yield batch


def _cause(exc) -> BaseException:
    """The exception a worker raised, as its own class (fp8ray's, with its message),
    rather than Ray's wrapper with the remote traceback in its text."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc.as_instanceof_cause()
