"""The CPU backend: splits a tensor into ranges and runs the numba kernels on a thread pool.

The kernels release the GIL, so plain Python threads run them in parallel; this keeps
the backend safe to call from many threads at once (numba's own parallel layer is not)
and lets each call say how many threads it may use (``threads``: a Ray actor with one
CPU wants one); ``FP8RAY_NUM_THREADS`` sets the process's default.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import BadInputError, InvalidOptionError
from . import checksum, kernels
from .formats import KERNEL_TYPES, SCALE_MASKS, Fp8Format, scale_candidates

# Elements per task: big enough to amortise a thread hand-off (~10 us), small enough
# to balance two to a few dozen cores.
CHUNK_ELEMENTS = 1 << 20

# One pool of helpers, as many as the largest ``threads`` a call has asked for, less one
# (the caller works too). A larger count replaces it: the old pool's threads end once no
# call holds it any more (a pool per count kept every count's threads for good).
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def num_threads() -> int:
    """Threads the CPU backend uses: ``FP8RAY_NUM_THREADS``, else the CPUs this process may use."""
    configured = os.environ.get("FP8RAY_NUM_THREADS")
    if configured:
        count = configured.strip()
        if not (count.isascii() and count.isdigit() and len(count) < 10 and int(count) > 0):
            raise InvalidOptionError(
                f"FP8RAY_NUM_THREADS must be a whole number of at least 1, got {configured!r}", field="FP8RAY_NUM_THREADS"
            )
        return int(count)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def thread_count(threads: int | None) -> int:
    """``threads`` as a call gives it (None: :func:`num_threads`), refused unless a
    positive whole number."""
    if threads is None:
        return num_threads()
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise BadInputError(f"threads must be a whole number of at least 1, or None for the default, got {threads!r}")
    return int(threads)


def _run(tasks: list, threads: int | None) -> list:
    """Run zero-argument callables on ``threads`` threads (default :func:`num_threads`):
    the calling thread and up to ``threads - 1`` of a pool, each taking the next task no
    one has taken, so that the caller works rather than waits. Returns their results in
    order; the first error any raised (or an interrupt) is raised once no task runs any
    more: none writes on into the caller's buffers after it returns.

    When the pool ran every task and the caller slept, a 12-task decode of 11.8M
    elements on 2 CPUs took 1.4 and 1.8 ms on alternate calls (median 1.8), now 1.25-1.45
    (median 1.33): three threads had shared two CPUs."""
    threads = thread_count(threads)
    if threads == 1 or len(tasks) <= 1:
        return [task() for task in tasks]
    pool = _helpers(threads - 1)
    results = [None] * len(tasks)
    claims = itertools.count()  # next() on it is atomic (under the GIL): each task is taken once
    errors: list[BaseException] = []

    def work() -> None:
        while not errors:
            i = next(claims)
            if i >= len(tasks):
                return
            try:
                results[i] = tasks[i]()
            except BaseException as error:  # noqa: BLE001 - raised in the caller, below
                errors.append(error)

    helpers = [pool.submit(work) for _ in range(min(threads, len(tasks)) - 1)]
    try:
        work()
    except BaseException as error:  # an interrupt between two tasks  # noqa: BLE001
        errors.append(error)
    _wait_for(helpers, errors)
    if errors:
        raise errors[0]
    return results


# Helper threads at most, whatever a call asks: threads past the CPUs only wait their
# turn, and a pool keeps its threads for the process's life (threads=256 once left 37).
MOST_HELPERS_PER_CPU = 4


def _helpers(count: int) -> ThreadPoolExecutor:
    """The pool, with room for ``count`` helpers (at most MOST_HELPERS_PER_CPU a CPU: a
    call's tasks are taken by whichever thread is free, so fewer only share them out
    differently). An outgrown pool's threads end once no call holds it any more (as the
    executor is collected)."""
    global _pool, _pool_size
    count = min(count, MOST_HELPERS_PER_CPU * max(num_threads(), os.cpu_count() or 1))
    with _pool_lock:
        if _pool is None or _pool_size < count:
            _pool, _pool_size = ThreadPoolExecutor(max_workers=count, thread_name_prefix="fp8ray-cpu"), count
        return _pool


def _wait_for(helpers: list, errors: list) -> None:
    """Wait for the helpers that have started; those still queued (behind another call's,
    or this task's own caller, in a nested call) are cancelled, as the caller has taken
    every task. An interrupt meanwhile is kept in ``errors``, which stops the helpers
    taking more, and the wait goes on until the tasks running have returned."""
    running = [helper for helper in helpers if not helper.cancel()]
    while True:
        try:
            futures.wait(running)
            return
        except BaseException as error:  # noqa: BLE001 - raised by the caller once all have stopped
            errors.append(error)


def _spans(count: int, per_task: int, threads: int | None) -> list[tuple[int, int]]:
    """``count`` items in spans of at most ``per_task``, in order, as many spans as a
    multiple of the thread count (where there are items enough), their sizes within one of
    each other: 3 spans on 2 threads would leave one thread idle for a third of the call
    (an LMCache chunk of 2.9M elements did)."""
    tasks = -(-count // max(1, per_task))
    threads = thread_count(threads)
    if tasks > 1:
        tasks = min(count, -(-tasks // threads) * threads)
    bounds = [i * count // tasks for i in range(tasks + 1)] if tasks else [0, 0]
    return list(zip(bounds, bounds[1:]))


def tensor_to_bytes(t) -> np.ndarray:
    """The raw little-endian bytes of a CPU tensor, as a uint8 array (a view where the
    tensor is contiguous; a conjugate or negative view's values, not its stored bits)."""
    import torch  # loaded already: the caller has a tensor

    flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # torch counts one element contiguous whatever its stride
        flat = flat.clone(memory_format=torch.contiguous_format)  # and a view of its bytes needs stride 1
    return flat.view(torch.uint8).numpy()


def kernel_array(t) -> np.ndarray:
    """A numpy view of a contiguous CPU bf16/fp16/fp32 tensor, its shape kept, holding its
    elements as the kernels take them (:data:`~fp8ray.codec.formats.KERNEL_TYPES`). Not of
    a negative view (``t.is_neg()``, as ``x.conj().imag`` is): its memory holds the values'
    negatives, so a reader resolves it first (``resolve_neg()``), a writer writes elsewhere."""
    import torch  # loaded already: the caller has a tensor

    from .formats import DTYPE_NAMES

    if t.is_neg():  # torch's own error ("negative bit set") would name no cause
        raise BadInputError("kernel_array of a negative view: resolve_neg() it to read, or write into another tensor")
    flat = t.detach().reshape(-1)  # a tensor that requires grad (a Parameter): encoding takes no gradient
    if t.dtype in (torch.bfloat16, torch.float16):
        flat = flat.view(torch.int16)  # numpy has no bfloat16: the bits, of the same size
    return flat.numpy().view(KERNEL_TYPES[DTYPE_NAMES[t.dtype]]).reshape(tuple(t.shape))


def quantize(
    x: np.ndarray,
    fmt: Fp8Format,
    scaling: str,
    block_size: int,
    codes: np.ndarray,
    scales: np.ndarray,
    scale_dtype: str = "float32",
    scale_choice: str = "amax",
    threads: int | None = None,
) -> int:
    """Fill ``codes`` (uint8, numel) and ``scales`` (fp32, values of ``scale_dtype``) for
    ``x``, a C-contiguous array of the tensor's shape holding its elements as the kernels
    take them (:func:`kernel_array`); ``scale_choice`` applies to token and block scaling.

    Returns the number of non-finite inputs (their codes are the format's NaN/inf codes).
    """
    tasks = _encode_tasks(x, fmt, scaling, block_size, codes, scales, scale_dtype, scale_choice, threads)
    return sum(_run([task for task, _ in tasks], threads))


def quantize_checksummed(
    x: np.ndarray,
    fmt: Fp8Format,
    scaling: str,
    block_size: int,
    codes: np.ndarray,
    scales: np.ndarray,
    scale_dtype: str = "float32",
    scale_choice: str = "amax",
    threads: int | None = None,
) -> tuple[int, int]:
    """:func:`quantize`, and the CRC-32C of ``codes``: each task takes that of the codes it
    has just written, still in cache, on its own thread, and the pieces are combined, so
    the frame's checksum needs no pass of its own over them. (Taken in the kernels' own
    loops, as the decode does, it was slower read back at once: the codes' narrowing
    stores had not left the store buffer. Eight chunks behind, it gained 15% on a
    none-scaled encode and nothing on groups, where the CRC had to follow four groups'
    interleaved chunks; a piece behind, one crc32 chain ran at a third of the speed of the
    library's three interleaved. Not kept.)"""
    tasks = _encode_tasks(x, fmt, scaling, block_size, codes, scales, scale_dtype, scale_choice, threads)
    done = _run([lambda t=t, a=a, b=b: _with_crc(t, codes[a:b]) for t, (a, b) in tasks], threads)
    return sum(bad for bad, _ in done), _combined([crc for _, crc in done], tasks)


def _with_crc(task, data: np.ndarray) -> tuple:
    """Run ``task``, then take the CRC-32C of ``data``, bytes it has just touched, on the same thread."""
    return task(), checksum.crc32c(data)


def _combined(crcs: list[int], tasks: list) -> int:
    """The CRC-32C of the tasks' ranges end to end, from each range's own."""
    return checksum.combine_all((crc, b - a) for crc, (_, (a, b)) in zip(crcs, tasks))


def _encode_tasks(x, fmt, scaling, block_size, codes, scales, scale_dtype, scale_choice, threads) -> list:
    """The tasks of :func:`quantize`, each with the range of ``codes`` it writes:
    ``(callable returning its count of non-finite inputs, (start, stop))``, the ranges in
    order and covering ``codes``. Scales that need a pass of their own (tensor, channel)
    are computed here."""
    src = x.reshape(-1)
    n = src.size
    tag = kernels.FORMAT_TAGS[fmt.name]
    fmax = np.float32(fmt.max)
    mask = np.int64(SCALE_MASKS[scale_dtype])
    shape = tuple(x.shape)
    if scaling in ("none", "tensor"):
        spans = _spans(n, CHUNK_ELEMENTS, threads)
        scale = np.float32(1.0)
        if scaling == "tensor":
            amax = max(_run([lambda s=s, e=e: kernels.amax_span(src, s, e) for s, e in spans], threads))
            scale = np.float32(kernels.scale_from_amax(np.float32(amax), fmax, mask))
            scales[0] = scale
        return [(lambda s=s, e=e: kernels.quantize_uniform(src, codes, s, e, scale, tag), (s, e)) for s, e in spans]
    if scaling == "channel":
        columns = shape[-1] if shape else 1
        rows = n // columns if columns else 0
        spans = _spans(rows, CHUNK_ELEMENTS // max(columns, 1), threads)
        partial = _run([lambda s=s, e=e: _column_amax(src, columns, s, e) for s, e in spans], threads)
        amax = np.maximum.reduce(partial) if len(partial) > 1 else partial[0]
        kernels.amax_to_scales(amax, fmax, mask, scales)
        return [
            (lambda s=s, e=e: kernels.quantize_columns(src, codes, scales, columns, s, e, tag), (s * columns, e * columns))
            for s, e in spans
        ]
    # token and block: contiguous groups, amax (and scale search) and cast fused per group.
    group = (shape[-1] if shape else 1) if scaling == "token" else block_size
    groups = scales.size
    spans = _spans(groups, CHUNK_ELEMENTS // max(group, 1), threads)
    candidates = scale_candidates(fmt, scale_choice)
    if len(candidates) == 1:
        tasks = [lambda s=s, e=e: kernels.quantize_groups(src, codes, scales, group, s, e, tag, mask) for s, e in spans]
    else:
        divisors = kernels.pad_candidates(candidates, fmt.max)
        tasks = [
            lambda s=s, e=e: kernels.quantize_groups_search(src, codes, scales, group, s, e, tag, mask, divisors)
            for s, e in spans
        ]
    return [(task, (s * group, min(e * group, n))) for task, (s, e) in zip(tasks, spans)]


def _column_amax(src: np.ndarray, columns: int, row_start: int, row_stop: int) -> np.ndarray:
    amax = np.zeros(columns, dtype=np.float32)
    kernels.amax_columns(src, columns, row_start, row_stop, amax)
    return amax


def dequantize(
    codes: np.ndarray,
    scales: np.ndarray,
    fmt: Fp8Format,
    scaling: str,
    shape: tuple[int, ...],
    block_size: int,
    out: np.ndarray,
    threads: int | None = None,
) -> None:
    """Decode ``codes`` with ``scales`` into ``out``, a C-contiguous array holding the
    elements as the kernels write them (:func:`kernel_array` of the target tensor)."""
    _run([task for task, _ in _decode_tasks(codes, scales, fmt, scaling, shape, block_size, out, threads)], threads)


def dequantize_checksummed(
    codes: np.ndarray,
    scales: np.ndarray,
    fmt: Fp8Format,
    scaling: str,
    shape: tuple[int, ...],
    block_size: int,
    out: np.ndarray,
    threads: int | None = None,
) -> int:
    """:func:`dequantize`, and the CRC-32C of ``codes``: each kernel takes that of the codes
    it reads, in its own loop (:data:`~fp8ray.codec.kernels.CRC_IN_KERNELS`; else each
    task, of the codes it has just read, still in cache), and the pieces are combined, so
    checking the frame needs no pass of its own."""
    tasks = _decode_tasks(codes, scales, fmt, scaling, shape, block_size, out, threads)
    if kernels.CRC_IN_KERNELS:  # each kernel returns the CRC-32C of the codes it read
        crcs = _run([task for task, _ in tasks], threads)
    else:
        crcs = [crc for _, crc in _run([lambda t=t, a=a, b=b: _with_crc(t, codes[a:b]) for t, (a, b) in tasks], threads)]
    return _combined(crcs, tasks)


def _decode_tasks(codes, scales, fmt, scaling, shape, block_size, out, threads) -> list:
    """The tasks of :func:`dequantize`, each with the range of ``codes`` it reads:
    ``(callable, (start, stop))``, the ranges in order and covering ``codes``."""
    dst = out.reshape(-1)  # a view: out is contiguous
    tag = kernels.FORMAT_TAGS[fmt.name]
    n = codes.size
    if scaling in ("none", "tensor"):
        # One scale: the arithmetic is cheaper than a 256-entry table (a gather per element).
        scale = np.float32(1.0) if scaling == "none" else scales[0]
        spans = _spans(n, CHUNK_ELEMENTS, threads)
        return [(lambda s=s, e=e: kernels.dequantize_uniform(codes, tag, scale, dst, s, e), (s, e)) for s, e in spans]
    if scaling == "channel":
        columns = shape[-1] if shape else 1
        rows = n // columns if columns else 0
        spans = _spans(rows, CHUNK_ELEMENTS // max(columns, 1), threads)
        return [
            (lambda s=s, e=e: kernels.dequantize_columns(codes, tag, scales, columns, dst, s, e), (s * columns, e * columns))
            for s, e in spans
        ]
    group = (shape[-1] if shape else 1) if scaling == "token" else block_size
    spans = _spans(scales.size, CHUNK_ELEMENTS // max(group, 1), threads)
    return [
        (lambda s=s, e=e: kernels.dequantize_groups(codes, tag, scales, group, dst, s, e), (s * group, min(e * group, n)))
        for s, e in spans
    ]


def crc32c(data: np.ndarray, threads: int | None = None) -> int:
    """The CRC-32C of a 1-D uint8 array, its pieces taken on ``threads`` threads and
    combined (the CUDA path's codes; the kernels here take theirs as they write them)."""
    spans = _spans(data.size, CHUNK_ELEMENTS, threads)
    crcs = _run([lambda start=start, stop=stop: checksum.crc32c(data[start:stop]) for start, stop in spans], threads)
    return checksum.combine_all(zip(crcs, (stop - start for start, stop in spans)))
