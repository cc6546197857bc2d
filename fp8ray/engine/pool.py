"""``QuantPool``: the driver side. Starts ``QuantWorker`` actors and schedules shards on them.

>>> import torch
>>> tensors = [torch.randn(2, 16, 64, dtype=torch.bfloat16) for _ in range(3)]
>>> with QuantPool(num_workers=2) as pool:                  # joins a running Ray, or runs inline
...     frames = pool.encode_many(tensors, scaling="token")  # in input order
...     restored = pool.decode_many(frames)
>>> [tuple(t.shape) for t in restored]
[(2, 16, 64), (2, 16, 64), (2, 16, 64)]

One scheduling loop (:meth:`QuantPool.map`) keeps a bounded window of calls in flight,
gathers results in input order, replaces a worker that dies and resubmits its calls, and
fails with the block's key when a call fails on its data, once the calls already running
have ended (so that nothing is written after the caller cleans up). Where the workers
run (Ray actors, or threads of this process) is :mod:`fp8ray.engine.backends`.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..codec import CodecOptions
from ..codec.blocks import Block, bytes_to_tensor
from ..codec.devices import cuda_available, is_tensor
from ..codec.fp8codec import is_array, source_tensor
from ..codec.frame import as_byte_array
from ..errors import BadInputError, InvalidOptionError, PoolStartError, WorkerLostError
from .address import INLINE, LOCAL, check_local_size, default_address, ray_connected
from .backends import SETTLE_SECONDS, InlineBackend, RayBackend, WorkerDied
from .worker import QuantWorker, WorkerInfo

# Inline, Ray is never imported (a third of a second of a one-shot command), so it is
# imported where used.


@dataclass(frozen=True)
class PoolSettings:
    """How to start a :class:`QuantPool`: what every engine operation (``compress_archive``,
    ``convert_store``...) takes as ``pool=`` when it is to start its own.

    Args:
        num_workers: workers to start (actors spread across nodes). On this machine
            alone (inline, or an embedded Ray) at most
            :data:`~fp8ray.engine.address.LOCAL_THREADS_PER_CPU` codec threads per CPU
            (workers times ``cpus_per_worker``, at least one each).
        gpus_per_worker: GPUs each actor asks Ray for; fractions share a GPU.
        cpus_per_worker: CPUs each actor asks for, and the codec threads it runs.
        address: a cluster to join; ``"local"``: an embedded Ray, started for the pool
            and removed with it (with the last pool of the process using it, where
            several are, or as the process exits); ``"inline"``: no Ray at all, the workers are
            ``QuantWorker`` objects run on threads of this process (the kernels, file
            I/O and Parquet release the GIL): no start-up cost, for local jobs; with
            ``gpus_per_worker > 0`` they all use this process's CUDA device. ``None``
            (the default) is chosen as the pool starts
            (:func:`~fp8ray.engine.address.default_address`): the Ray this process is
            already connected to, else ``RAY_ADDRESS``, else a cluster ``ray start``
            runs on this machine, else inline.
        window: calls in flight at most (default two per worker); bounds the driver's memory.
        max_attempts: times a call is tried when its worker dies.
        start_timeout: seconds to wait for the actors to start before failing (a
            cluster without the CPUs or GPUs asked for would otherwise wait forever).
    """

    num_workers: int = 2
    gpus_per_worker: float = 0
    cpus_per_worker: float = 1
    address: str | None = None
    window: int | None = None
    max_attempts: int = 3
    start_timeout: float = 120.0

    def __post_init__(self):
        whole = {"num_workers": self.num_workers, "max_attempts": self.max_attempts}
        if self.window is not None:
            whole["window"] = self.window
        for name, value in whole.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise InvalidOptionError(f"{name} must be a positive integer, got {value!r}", field=name)
        if self.address is not None and not isinstance(self.address, str):
            raise InvalidOptionError(f"address must be a string or None, got {self.address!r}", field="address")
        for name, above in (("gpus_per_worker", False), ("cpus_per_worker", True), ("start_timeout", True)):
            value = getattr(self, name)
            real = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            if not real or value < 0 or (above and value == 0):
                wanted = "above 0" if above else "at least 0"
                raise InvalidOptionError(f"{name} must be a number {wanted}, got {value!r}", field=name)

    @property
    def inline(self) -> bool:
        return self.address == INLINE


class QuantPool:
    """A pool of ``QuantWorker`` s, used as a context manager, or started and closed by
    hand where a ``with`` block does not fit (a notebook): ``pool = QuantPool(...).start()``,
    then ``pool.close()``.

    ``QuantPool(num_workers=4, address="inline")`` or ``QuantPool(settings)``: the fields
    of :class:`PoolSettings` as keywords, each overriding only itself.
    """

    def __init__(self, settings: PoolSettings | None = None, /, **fields):
        if settings is not None and not isinstance(settings, PoolSettings):
            raise TypeError(
                f"QuantPool takes a PoolSettings, or its fields as keywords (num_workers=2), got {type(settings).__name__}"
            )
        self.settings = replace(settings or PoolSettings(), **fields)
        self.num_workers = self.settings.num_workers
        self.window = self.settings.window or 2 * self.num_workers
        self.replaced = 0
        # The address the workers run at: the settings' until the pool starts, then the
        # one it chose where they named none.
        self.address = self.settings.address
        self._backend: InlineBackend | RayBackend | None = None
        self._owns_ray = False
        # One result ref of each by-reference call not yet known to have ended: closing
        # waits for them, as killing the actors would fail the refs handed out.
        self._by_reference_calls: list = []  # (first ref of a by-reference call, its worker)
        self._handed_out_refs = False  # whether encode_refs/decode_refs returned any

    @property
    def inline(self) -> bool:
        return self.address == INLINE

    def __enter__(self) -> QuantPool:
        if self._backend is not None:  # a second start would orphan the first's workers (and its Ray)
            raise PoolStartError(
                "this QuantPool is running already: start it once (with, or start()), and use it until it closes"
            )
        s = self.settings
        self.address = s.address or default_address()
        threads = max(1, int(s.cpus_per_worker))
        # A process each on Ray, whatever its CPUs; counted as the embedded Ray's CPUs are.
        local_threads = max(s.num_workers * threads, int(s.num_workers * s.cpus_per_worker))
        if self.inline:
            check_local_size(local_threads)
            # Inline workers share this process's GPU when asked for one (Ray is not
            # there to hand out devices).
            device = "cuda" if s.gpus_per_worker > 0 else "cpu"
            if device == "cuda" and not cuda_available():
                raise PoolStartError(
                    f"gpus_per_worker={s.gpus_per_worker} with inline workers, but this torch sees no CUDA device"
                )
            self._backend = InlineBackend(s.num_workers, threads, device)
            return self
        from .runtime import check_placeable, connect_ray, disconnect_ray, started_embedded

        # An embedded Ray it starts, or the one another pool of this process started.
        if started_embedded() or (self.address == LOCAL and not ray_connected()):
            check_local_size(local_threads)
        embedded_cpus = max(int(s.num_workers * s.cpus_per_worker), os.cpu_count() or 1)
        self._owns_ray = connect_ray(self.address, embedded_cpus, inline_possible=True)
        try:
            embedded = started_embedded()
            if embedded:  # a GPU it lacks: said at once, not after the start timeout (a cluster may grow)
                import ray

                check_placeable(s.num_workers, s.cpus_per_worker, s.gpus_per_worker, ray.cluster_resources())
            self._backend = RayBackend(
                s.num_workers, s.cpus_per_worker, s.gpus_per_worker, s.start_timeout, say_waiting=not embedded
            )
        except BaseException:
            if self._owns_ray:
                self._owns_ray = False
                disconnect_ray()
            raise
        return self

    def start(self) -> QuantPool:
        """Start the workers (what entering ``with`` does); returns the pool."""
        return self.__enter__()

    def close(self) -> None:
        """Stop the workers, as leaving ``with`` without an error does (waiting for the
        by-reference calls whose refs it handed out); a second call does nothing."""
        self.__exit__(None, None, None)

    def __exit__(self, exc_type, *exc) -> None:
        backend, self._backend = self._backend, None
        ends_ray = self._owns_ray and self._last_holder()  # its disconnect below ends the connection
        try:
            # An interrupt does not wait; where Ray ends below the refs end anyway.
            if backend is not None and not ends_ray and (exc_type is None or issubclass(exc_type, Exception)):
                self._wait_by_reference_calls()
            if backend is not None:
                backend.close()
        finally:
            if self._owns_ray:
                from .runtime import disconnect_ray

                self._owns_ray = False
                if self._handed_out_refs and ends_ray:
                    warnings.warn(
                        "fp8ray: this QuantPool connected to Ray itself and disconnects as it closes: the refs its "
                        "encode_refs/decode_refs returned end with the connection (ray.init first to keep them)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                disconnect_ray()

    @staticmethod
    def _last_holder() -> bool:
        from .runtime import holders

        return holders() == 1

    @property
    def _running(self) -> InlineBackend | RayBackend:
        if self._backend is None:
            raise PoolStartError(
                "QuantPool is not running: use it as a context manager (`with QuantPool(...) as pool:`), or start() it"
            )
        return self._backend

    def worker_info(self) -> list[WorkerInfo]:
        """Each worker's device, node and process; one found dead (killed while idle) is
        replaced first, as :meth:`map` replaces one that dies under a call."""
        self._replace_idle_dead()
        return self._running.info()

    def _replace_idle_dead(self) -> None:
        """Replace the workers that died with no call of this pool's running on them (a
        call's own failure tells :meth:`map` of one that dies under it)."""
        busy = set(self._by_reference_workers())
        idle = [w for w in range(self.num_workers) if w not in busy]
        if idle:
            self.replaced += self._running.replace_dead(idle)

    def on_this_machine(self) -> bool:
        """Whether every worker runs on this process's machine (inline, or Ray actors all
        on this node), so that they can write into the same local file."""
        if self.inline:
            return True
        import ray

        here = ray.get_runtime_context().get_node_id()
        return all(info.node_id == here for info in self.worker_info())

    def share(self, value):
        """``value`` as the workers should receive it when every call passes it: put in
        Ray's object store once (or as it is, inline)."""
        if self.inline:
            return value
        import ray

        return ray.put(value)

    def map(self, method: Callable, calls: Iterable[tuple], on_result: Callable[[Any], None] | None = None) -> Iterator[Any]:
        """Run ``method`` (a method of :class:`QuantWorker`, e.g. ``QuantWorker.encode_batch``)
        on the workers, once per tuple of arguments in ``calls``; yield the results in input
        order. Arguments that do not fit the method's signature raise ``TypeError`` here,
        before the call is submitted.

        At most ``window`` calls are in flight or waiting to be yielded, and each worker
        holds at most ``ceil(window / workers)`` of them. A worker that dies is replaced
        and its calls resubmitted (``max_attempts`` times). A call failing on its data
        raises the worker's own exception as soon as the calls already running have ended
        (at most ``backends.SETTLE_SECONDS``), so that nothing is written after the caller
        has cleaned up; queued calls are dropped. ``on_result`` sees each result as it
        arrives, in any order.
        """
        check = _signature_check(method)
        backend = self._running
        calls = iter(calls)
        workers = self.num_workers
        per_worker = -(-self.window // workers)
        load = [0] * workers
        running: dict[Any, tuple[int, int, int, tuple]] = {}  # call -> (index, worker, attempt, args)
        done: dict[int, Any] = {}
        submitted = next_out = 0
        exhausted = False

        def submit(index: int, args: tuple, attempt: int) -> None:
            w = min(range(workers), key=load.__getitem__)
            load[w] += 1
            running[backend.submit(w, method, args)] = (index, w, attempt, args)

        try:
            while True:
                while not exhausted and len(running) + len(done) < self.window and min(load) < per_worker:
                    args = next(calls, None)
                    if args is None:
                        exhausted = True
                        break
                    check(args)
                    submit(submitted, args, 1)
                    submitted += 1
                if not running:
                    return
                call = backend.wait_one(running)
                index, w, attempt, args = running.pop(call)
                load[w] -= 1
                try:
                    done[index] = backend.result(call)
                except WorkerDied as exc:
                    if attempt >= self.settings.max_attempts:
                        last = (str(exc).strip().splitlines() or [""])[0]  # Ray's text runs to many lines
                        raise WorkerLostError(
                            f"task {index} ({method.__name__}) lost its worker {attempt} times (killed, or out of memory?); "
                            f"last: {last}"
                        ) from exc
                    self.replaced += backend.replace_if_dead(w)
                    submit(index, args, attempt + 1)
                    continue
                if on_result is not None:
                    on_result(done[index])
                while next_out in done:
                    yield done.pop(next_out)
                    next_out += 1
        finally:
            # The job failed or was abandoned: drop what is queued, and let what is
            # running end before the caller cleans up.
            backend.settle({call: w for call, (_, w, _, _) in running.items()})

    def encode_many(
        self, tensors: Iterable, batch_size: int | None = None, options: CodecOptions | None = None, **codec_options
    ) -> list[np.ndarray]:
        """Encode tensors (or numpy arrays, as :meth:`Fp8Codec.encode` takes them) on the
        workers, through the object store; frames in input order.
        Codec options as :class:`~fp8ray.codec.CodecOptions` (``options``, then keywords
        overriding it; the default mode if none). ``batch_size``: blocks per task
        (default: about :data:`BATCH_BYTES` of input each)."""
        options = CodecOptions.parse(codec_options, base=options)
        tensors = list(tensors)  # taken once: a generator is iterated by the check, then the blocks
        for i, t in enumerate(tensors):
            if not (is_tensor(t) or is_array(t)):
                raise TypeError(f"tensor {i}: expected a torch.Tensor or numpy array, got {type(t).__name__}")
            try:
                # What Fp8Codec.encode refuses (a meta, sparse or nested tensor), refused alike; an array as a tensor
                tensors[i] = source_tensor(t)
            except BadInputError as exc:
                raise type(exc)(f"tensor {i}: {exc}", field=exc.field or str(i)) from None
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"tensor {i}: {exc}") from None
        blocks = [Block.of(str(i), t) for i, t in enumerate(tensors)]
        batches = ((batch, options) for batch in _batches(blocks, batch_size, lambda b: b.nbytes))
        return [f for batch in self.map(QuantWorker.encode_batch, batches) for f, _ in batch]

    def decode_many(self, frames: Iterable, batch_size: int | None = None) -> list:
        """Decode frames on the workers; tensors in input order. On Ray actors they are
        views of the results where the workers left them, in Ray's object store, not
        copies (as :meth:`encode_many`'s frames are): treat them as read-only (Ray's
        objects are immutable; torch cannot mark a tensor so), ``clone()`` one to change
        it in place; each keeps its call's results (about :data:`BATCH_BYTES` of blocks)
        in the store's memory while it lives."""
        pairs = []
        for i, f in enumerate(frames):
            try:
                pairs.append((str(i), as_byte_array(f)))  # what fp8ray.decode takes
            except TypeError as exc:
                raise TypeError(f"frame {i}: {exc}") from None
        batches = ((batch,) for batch in _batches(pairs, batch_size, lambda p: 2 * p[1].size))
        return [
            bytes_to_tensor(raw, meta.dtype, meta.shape)
            for batch in self.map(QuantWorker.decode_batch, batches)
            for raw, meta in batch
        ]

    def encode_refs(self, refs: Iterable, options: CodecOptions | None = None, **codec_options) -> list:
        """Encode blocks that are already in Ray's object store: ``refs`` are ``ObjectRef`` s
        of tensors, numpy arrays or :class:`~fp8ray.codec.blocks.Block` s (from upstream Ray tasks);
        returns an ``ObjectRef`` of each frame (a uint8 array), in order, at once. The
        driver never fetches the bytes: each worker pulls its inputs from the object store
        (a Block's bytes are read in place; a tensor, as Ray deserialises it: a copy) and
        each frame stays there, an object of its own, until someone ``ray.get`` s it.
        Blocks go to the workers several to a call (see :meth:`_by_reference`). Ray actors
        only (not ``address="inline"``). A block that fails, or a worker lost mid-way,
        fails the refs of its call (on ``ray.get``), the failing block's key in the message.
        On a Ray this process was connected to before the pool, the refs outlive the pool:
        closing it waits for the calls still running (at most ``backends.SETTLE_SECONDS``;
        a ``RuntimeWarning`` names those it gives up on), except on an interrupt. A pool
        that connected itself (an embedded Ray, or a cluster's address) disconnects as it
        closes, and the objects this driver owns, these refs among them, end with the
        connection (a ``RuntimeWarning`` says so): connect first (``ray.init``) to keep them."""
        options = CodecOptions.parse(codec_options, base=options)
        return self._by_reference(QuantWorker.encode_blocks, list(refs), lambda keys, batch: (options, keys, *batch))

    def decode_refs(self, refs: Iterable) -> list:
        """Decode frames that are already in Ray's object store (``ObjectRef`` s of frames,
        as :meth:`encode_refs` returns); returns an ``ObjectRef`` of each
        :class:`~fp8ray.codec.blocks.Block` (``block.tensor()`` views its bytes), in
        order, as :meth:`encode_refs` does."""
        return self._by_reference(QuantWorker.decode_frames, list(refs), lambda keys, batch: (keys, *batch))

    def _by_reference(self, method: Callable, refs: list, arguments: Callable[[list[str], list], tuple]) -> list:
        """Submit ``method`` on ``refs`` a batch at a time, ``arguments(keys, batch)`` its
        arguments (the refs themselves, which Ray resolves on the worker: never here);
        one ``ObjectRef`` per result, in order. The refs are cut into two calls per
        worker, of :data:`REFS_BATCH_BYTES` of inputs at most, each to the worker with the
        fewest bytes so far; a ref whose object is not made yet (an upstream task still
        running) goes in a call of its own, so that no block waits for another's task."""
        if self.inline:
            raise InvalidOptionError(
                "encode_refs and decode_refs take object-store refs: they need Ray workers, not inline ones "
                "(address='inline', or no address with no Ray running: give address='local' or a cluster's)",
                field="address",
            )
        backend = self._running
        if not refs:
            return []
        self._replace_idle_dead()  # else half of the refs would go to a worker killed since the last call
        check = _signature_check(method)
        sizes = _object_sizes(refs)
        known = sum(size for size in sizes if size is not None)
        target = min(REFS_BATCH_BYTES, max(1, known // (2 * self.num_workers)))
        items = [(str(i), ref, target if size is None else size) for i, (ref, size) in enumerate(zip(refs, sizes))]
        load = [0] * self.num_workers
        results = []
        for batch in _batches(items, None, lambda item: item[2], target):
            args = arguments([key for key, _, _ in batch], [ref for _, ref, _ in batch])
            check(args)
            w = min(range(self.num_workers), key=load.__getitem__)
            load[w] += sum(size for _, _, size in batch)
            calls = backend.submit_each(w, method, args, len(batch))
            self._by_reference_calls.append((calls[0], w))  # a call's results are made together
            results += calls
        self._handed_out_refs = True
        return results

    def _by_reference_workers(self) -> list[int]:
        """The workers of the by-reference calls still running (the list is kept to them)."""
        running = set(self._unfinished([call for call, _ in self._by_reference_calls], 0))
        self._by_reference_calls = [(call, w) for call, w in self._by_reference_calls if call in running]
        return [w for _, w in self._by_reference_calls]

    def _unfinished(self, refs: list, timeout: float) -> list:
        if not refs:  # and inline, where there are none, Ray is never imported
            return refs
        import ray

        _, unfinished = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
        return unfinished

    def _wait_by_reference_calls(self) -> None:
        """Let the by-reference calls still running end (at most ``SETTLE_SECONDS``) before
        the actors are killed: their refs stay readable after the pool closes. Those still
        running then fail (``ActorDiedError`` on ``ray.get``), said here."""
        calls, self._by_reference_calls = [call for call, _ in self._by_reference_calls], []
        if not calls:
            return
        try:
            left = self._unfinished(calls, SETTLE_SECONDS)
        except Exception:  # Ray gone or leaving: nothing left to wait for; keep the real error
            return
        if left:
            warnings.warn(
                f"fp8ray: QuantPool closed with {len(left)} encode_refs/decode_refs call(s) still running after "
                f"{SETTLE_SECONDS:.0f} s: their refs fail (ActorDiedError)",
                RuntimeWarning,
                stacklevel=3,
            )


@contextmanager
def use_pool(pool: QuantPool | PoolSettings | None) -> Iterator[QuantPool]:
    """What an engine operation runs on: the running pool given (left running: the
    caller's), or a new one started from ``pool``'s settings (default :class:`PoolSettings`)
    for the operation and stopped after it."""
    if isinstance(check_pool(pool), QuantPool):
        yield pool
        return
    with QuantPool(pool) as started:
        yield started


def check_pool(pool: QuantPool | PoolSettings | None) -> QuantPool | PoolSettings | None:
    """``pool`` as :func:`use_pool` takes it, checked: operations call this before any work."""
    if pool is not None and not isinstance(pool, (QuantPool, PoolSettings)):
        raise TypeError(f"pool must be a running QuantPool, PoolSettings or None, got {type(pool).__name__}")
    return pool


# Input bytes per task of encode_many/decode_many: enough to amortise a task's cost
# (milliseconds), small enough to keep every worker busy and the window's memory bounded.
BATCH_BYTES = 16 << 20
# Input bytes per call of encode_refs/decode_refs at most: their inputs are in the object
# store already (encode_many's window holds its own there), and each call costs Ray 1-6 ms
# on 2 busy cores whatever its size; a worker's results buffer holds a call's outputs.
REFS_BATCH_BYTES = 64 << 20


def _batches(items: list, batch_size: int | None, nbytes, batch_bytes: int = BATCH_BYTES) -> Iterator[list]:
    """``items`` in order, ``batch_size`` at a time, or about ``batch_bytes`` at a time."""
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise InvalidOptionError(f"batch_size must be an integer of at least 1, got {batch_size!r}", field="batch_size")
        yield from (items[i : i + batch_size] for i in range(0, len(items), batch_size))
        return
    batch: list = []
    size = 0
    for item in items:
        if batch and size + nbytes(item) > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes(item)
    if batch:
        yield batch


def _signature_check(method: Callable) -> Callable[[tuple], None]:
    """A check that a tuple of arguments fits ``method``, a ``QuantWorker`` method: run on
    the driver, so that a wrong call fails here rather than on a worker."""
    if getattr(QuantWorker, getattr(method, "__name__", ""), None) is not method:
        raise TypeError(f"QuantPool.map runs QuantWorker's methods (QuantWorker.encode_batch...), got {method!r}")
    signature = inspect.signature(method)
    name = method.__name__

    def check(args: tuple) -> None:
        if not isinstance(args, tuple):
            raise TypeError(f"QuantPool.map: each call of QuantWorker.{name} is a tuple of arguments, got {type(args).__name__}")
        try:
            signature.bind(None, *args)
        except TypeError as exc:
            raise TypeError(f"QuantWorker.{name}{signature}: {exc}") from None

    return check


def _object_sizes(refs: list) -> list[int | None]:
    """The size of each ref's object as Ray's owner records it (a lookup of metadata: no
    bytes move), or None where it is not known yet (its task still running)."""
    import ray
    from ray.experimental import get_object_locations

    for i, ref in enumerate(refs):
        if not isinstance(ref, ray.ObjectRef):
            raise InvalidOptionError(f"ref {i}: expected a Ray ObjectRef, got {type(ref).__name__}", field="refs")
    found = get_object_locations(refs)
    return [found.get(ref, {}).get("object_size") for ref in refs]
