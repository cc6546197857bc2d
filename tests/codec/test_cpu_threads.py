"""The CPU backend's task runner (cpu._run): the caller works beside the pool's helpers."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest
import torch

from fp8ray import Fp8Codec
from fp8ray.codec import cpu


def test_tasks_run_on_the_caller_and_its_helpers_and_results_come_in_order():
    ran_on = []

    def task(i):
        ran_on.append(threading.get_ident())
        time.sleep(0.02)  # long enough for the helper to start and take some
        return i * i

    results = cpu._run([lambda i=i: task(i) for i in range(8)], threads=2)
    assert results == [i * i for i in range(8)]
    assert threading.get_ident() in ran_on  # the caller worked
    assert len(set(ran_on)) == 2


def test_an_error_is_raised_once_no_task_is_running_and_no_task_starts_after_it():
    started, finished = set(), set()

    def task(i):
        started.add(i)
        if i == 0:
            raise ValueError("task 0 failed")
        time.sleep(0.05)
        finished.add(i)

    with pytest.raises(ValueError, match="task 0 failed"):
        cpu._run([lambda i=i: task(i) for i in range(8)], threads=2)
    assert started - {0} == finished  # nothing still running into the caller's buffers
    assert len(started) < 8  # the others stop taking tasks after the error


def test_many_callers_each_finish_their_own_tasks():
    """Callers from many threads at once (LMCache's workers, a Ray actor's threads) all
    finish: each works through its own tasks even while the helpers serve another."""
    outcomes = {}

    def call(k):
        outcomes[k] = cpu._run([lambda i=i: (k, i) for i in range(20)], threads=2)

    callers = [threading.Thread(target=call, args=(k,)) for k in range(8)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=60)
    assert not any(caller.is_alive() for caller in callers)
    assert outcomes == {k: [(k, i) for i in range(20)] for k in range(8)}


def test_a_task_that_runs_tasks_itself_finishes():
    """A nested call (a task that calls the runner with the same thread count) finishes:
    its caller takes every inner task, and its helpers still queued behind the outer
    call's are cancelled rather than waited for."""

    def inner():
        return sum(cpu._run([lambda i=i: i for i in range(4)], threads=8))

    done = []
    runner = threading.Thread(target=lambda: done.append(cpu._run([inner] * 4, threads=8)))
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive() and done == [[6, 6, 6, 6]]


def test_one_pool_whatever_the_task_count():
    before = threading.active_count()
    for count in range(2, 12):
        cpu._run([lambda: None] * count, threads=12)
    assert threading.active_count() - before <= 11


def helpers_alive() -> int:
    return sum(thread.name.startswith("fp8ray-cpu") for thread in threading.enumerate())


def test_calls_of_many_thread_counts_keep_only_the_largest_counts_helpers():
    """A pool per thread count kept every count's threads for the life of the process
    (an actor sized by the CPUs it has, a tuning loop: 1 + 2 + ... + 12 threads here)."""
    for threads in range(2, 14):
        cpu._run([lambda: time.sleep(0.01)] * threads, threads=threads)
    largest = max(12, getattr(cpu, "_pool_size", 0))  # another test's call may have asked for more
    deadline = time.monotonic() + 30  # the replaced pools' threads end once they are collected
    while helpers_alive() > largest and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert helpers_alive() <= largest


def test_a_call_asking_for_hundreds_of_threads_gets_at_most_four_helpers_a_cpu():
    """threads=256 on 2 CPUs left 37 idle helper threads for the life of the process."""
    x = torch.randn(4, 250_000)
    expected = bytes(Fp8Codec().encode(x, threads=1))
    assert bytes(Fp8Codec().encode(x, threads=256)) == expected
    most = cpu.MOST_HELPERS_PER_CPU * max(cpu.num_threads(), os.cpu_count() or 1)
    deadline = time.monotonic() + 30  # a replaced pool's threads end once it is collected
    while helpers_alive() > most and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert helpers_alive() <= most


def test_an_interrupt_while_the_caller_waits_is_raised_once_the_helpers_task_returns():
    """Ctrl-C as the caller waits for a helper: the interrupt is raised only after the
    task the helper runs has returned (it writes into the caller's buffers, which the
    caller frees as the interrupt unwinds: a decompress died of SIGSEGV so)."""
    both_started = threading.Barrier(2, timeout=30)
    finished, started = [], []
    timer = threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT))

    def task(i):
        started.append(i)
        both_started.wait()  # the caller's task and the helper's, one each
        if threading.current_thread() is not threading.main_thread():
            timer.start()  # the interrupt comes as the caller waits for this task
            time.sleep(0.5)
            finished.append(i)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            cpu._run([lambda i=i: task(i) for i in range(2)], threads=2)
        assert len(finished) == 1 and sorted(started) == [0, 1]  # the helper's task had returned
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
