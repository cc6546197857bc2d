"""Where a :class:`~fp8ray.engine.pool.QuantPool`'s workers run: Ray actors, or objects on
this process's threads. The pool's one scheduling loop drives either through the same
five calls (submit, wait for one, take its result, replace a dead worker, settle).

A worker runs one call at a time and queues the rest, as a Ray actor does: inline, each
worker object has a thread of its own.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from ..errors import PoolStartError, WorkerLostError
from .worker import QuantWorker, WorkerInfo

# After a failure, how long the pool waits for the calls already running to end: a worker
# cannot be interrupted mid-call, and one still writing a part or a file after the caller
# cleaned up would leave it behind.
SETTLE_SECONDS = 120.0
# How often a pool waiting for results looks whether a replacement worker has started:
# one the cluster cannot place (its node gone, no other with room) would be waited on
# for ever.
REPLACEMENT_CHECK_SECONDS = 5.0
# How long the pool waits for its workers before saying what it waits for: one the
# cluster cannot place (no node with room yet) would otherwise hold the command silently
# for the whole start timeout.
START_NOTICE_SECONDS = 10.0

log = logging.getLogger("fp8ray")


class WorkerDied(Exception):
    """A call's worker died under it (a Ray actor lost): the call may be tried again."""


class InlineBackend:
    """``QuantWorker`` objects on threads of this process, one thread each, without Ray
    (the kernels, file I/O and Parquet release the GIL)."""

    def __init__(self, num_workers: int, threads: int, device: str):
        self.workers = [QuantWorker(threads, reuse_buffers=False, device=device) for _ in range(num_workers)]
        self._threads = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="QuantWorker") for _ in self.workers]

    def submit(self, worker: int, method: Callable, args: tuple) -> Future:
        return self._threads[worker].submit(method, self.workers[worker], *args)

    def wait_one(self, running: Collection[Future]) -> Future:
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        return next(iter(finished))

    def result(self, call: Future) -> Any:
        return call.result()  # the worker's own exception, if any; an object cannot die

    def replace_if_dead(self, worker: int) -> bool:
        return False

    def replace_dead(self, workers: Collection[int]) -> int:
        return 0  # threads of this process do not die

    def settle(self, running: dict[Future, int]) -> None:
        for call in running:
            call.cancel()
        wait(running, timeout=SETTLE_SECONDS)

    def info(self) -> list[WorkerInfo]:
        return [w.info() for w in self.workers]

    def close(self) -> None:
        for executor in self._threads:
            executor.shutdown(wait=True, cancel_futures=True)
        self.workers = []


@functools.cache
def _remote_worker():
    """``QuantWorker`` as a Ray actor class, made once per process: Ray keeps every actor
    class that made actors until the process ends (about 136 KB in the driver and as much
    in the GCS), so a class per pool grew a long-lived service with each pool. Ray exports
    it again to each new session (an embedded Ray started anew)."""
    import ray

    return ray.remote(QuantWorker)


class RayBackend:
    """``QuantWorker`` Ray actors, spread across the cluster's nodes. Ray must be
    connected (:func:`fp8ray.engine.runtime.connect_ray`)."""

    def __init__(self, num_workers: int, cpus: float, gpus: float, start_timeout: float, say_waiting: bool = True):
        """``say_waiting``: say what the pool waits for once START_NOTICE_SECONDS have gone
        (on a cluster that may not place the workers yet; not on a Ray checked to hold
        them, whose actors are only slow to start)."""
        import ray

        self._ray = ray
        self._actor_class = _remote_worker().options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy="SPREAD")
        self._threads = max(1, int(cpus))
        self._needs = (cpus, gpus)
        self._start_timeout = start_timeout
        self._starting: dict[int, tuple[Any, float]] = {}  # replaced worker -> (its info ref, start deadline)
        self.workers: list = []
        try:  # an interrupt or failure while the workers start stops those started
            for _ in range(num_workers):
                self.workers.append(self._actor_class.remote(self._threads))
            started = [w.info.remote() for w in self.workers]
            first = min(start_timeout, START_NOTICE_SECONDS) if say_waiting else start_timeout
            ready, _ = ray.wait(started, num_returns=num_workers, timeout=first)
            if len(ready) < num_workers and first < start_timeout:
                log.warning(
                    "fp8ray: %d of %d QuantWorkers started in %.0f s; waiting up to %.0f s in all (start_timeout, "
                    "--start-timeout): %s",
                    len(ready),
                    num_workers,
                    first,
                    start_timeout,
                    self._needs_message(),
                )
                ready, _ = ray.wait(started, num_returns=num_workers, timeout=start_timeout - first)
        except BaseException:
            self.close()
            raise
        if len(ready) < num_workers:
            needs = self._needs_message()
            self.close()
            raise PoolStartError(f"only {len(ready)} of {num_workers} QuantWorkers started within {start_timeout:.0f} s: {needs}")

    def _needs_message(self) -> str:
        have = self._ray.cluster_resources()
        cpus, gpus = self._needs
        return (
            f"each needs {cpus:g} CPU(s) and {gpus:g} GPU(s), and the cluster has {have.get('CPU', 0):g} CPU(s) and "
            f"{have.get('GPU', 0):g} GPU(s) in all (other actors, another QuantPool's, may hold some)"
        )

    def submit(self, worker: int, method: Callable, args: tuple):
        # The actor's method of the same function: `method` is QuantWorker's own.
        return getattr(self._actor(worker), method.__name__).remote(*args)

    def submit_each(self, worker: int, method: Callable, args: tuple, results: int) -> list:
        """Submit a call whose result is a sequence of ``results`` values: one ObjectRef
        of each (Ray's ``num_returns``), usable before the call has run."""
        refs = getattr(self._actor(worker), method.__name__).options(num_returns=results).remote(*args)
        return [refs] if results == 1 else refs

    def wait_one(self, running: Collection):
        while True:
            ready, _ = self._ray.wait(list(running), num_returns=1, timeout=REPLACEMENT_CHECK_SECONDS)
            if ready:
                return ready[0]
            self._check_replacements()

    def _forget_started(self) -> None:
        """Drop the replaced workers that have started from those awaited."""
        for worker, (ref, _) in list(self._starting.items()):
            started, _ = self._ray.wait([ref], timeout=0)
            if started:
                del self._starting[worker]

    def _check_replacements(self) -> None:
        """Raise :class:`WorkerLostError` if a replaced worker has not started within the
        start timeout: the calls queued on it would wait for ever."""
        self._forget_started()
        for _, deadline in self._starting.values():
            if time.monotonic() > deadline:
                raise WorkerLostError(
                    f"a QuantWorker died and the one replacing it did not start within {self._start_timeout:.0f} s "
                    f"(its node gone, and no other with room?): {self._needs_message()}"
                )

    def result(self, ref) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return self._ray.get(ref)
        except RayActorError as exc:
            raise WorkerDied(str(exc)) from exc
        except RayTaskError as exc:
            raise worker_exception(exc) from None

    def replace_if_dead(self, worker: int) -> bool:
        """Replace the worker if it no longer answers; returns whether it was replaced."""
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            self._ray.get(self._actor(worker).info.remote(), timeout=30)
            return False
        except (RayActorError, GetTimeoutError):
            self._replace(worker)
            return True

    def replace_dead(self, workers: Collection[int]) -> int:
        """Replace those of ``workers`` (idle ones: a busy one's answer waits for its calls)
        that are dead, asking them all at once; returns how many were replaced. One that
        does not answer within 30 s is left as it is."""
        from ray.exceptions import RayActorError

        pings = {self.workers[w].info.remote(): w for w in workers}
        answered, _ = self._ray.wait(list(pings), num_returns=len(pings), timeout=30)
        replaced = 0
        for ref in answered:
            try:
                self._ray.get(ref)
            except RayActorError:
                self._replace(pings[ref])
                replaced += 1
        return replaced

    def _replace(self, worker: int) -> None:
        """A new actor in place of worker ``worker`` (killed first: it may only be stuck)."""
        self._ray.kill(self.workers[worker])
        self.workers[worker] = self._actor_class.remote(self._threads)
        self._starting[worker] = (self.workers[worker].info.remote(), time.monotonic() + self._start_timeout)

    def settle(self, running: dict[Any, int]) -> None:
        """Drop the calls still queued, and let those running end."""
        for ref in running:
            try:
                self._ray.cancel(ref, force=False)
            except (ValueError, TypeError):
                pass
        # A cancelled ref resolves at once while its call runs on, so wait instead for a
        # call queued behind it on each busy actor (an actor runs one call at a time); a
        # replacement not started yet runs none of its calls: nothing to wait for there.
        try:
            self._forget_started()
            busy = {w for w in running.values() if w < len(self.workers) and w not in self._starting}
            if busy:
                self._ray.wait([self.workers[w].info.remote() for w in busy], num_returns=len(busy), timeout=SETTLE_SECONDS)
        except Exception:  # Ray gone or leaving: nothing left to wait for; keep the real error
            pass

    def info(self) -> list[WorkerInfo]:
        return self._ray.get([w.info.remote() for w in self.workers])

    def _actor(self, worker: int):
        """Worker ``worker``'s actor; a pool closed under a call (from another thread) says so."""
        if not self.workers:
            raise PoolStartError("the QuantPool was closed while a call of it ran")
        return self.workers[worker]

    def close(self) -> None:
        try:
            for w in self.workers:
                self._ray.kill(w)
        finally:
            self.workers = []


def worker_exception(exc) -> BaseException:
    """The exception a worker raised (a ``RayTaskError``'s cause), as its own class
    (fp8ray's, with its message), rather than Ray's wrapper with the remote traceback
    in its text."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, Exception) else exc.as_instanceof_cause()
