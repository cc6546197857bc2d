"""The CPU backend's task runner (cpu._run): the caller works beside the pool's helpers."""

from __future__ import annotations

import threading
import time

import pytest

from fp8ray.codec import cpu


def test_tasks_run_on_the_caller_and_its_helpers_and_results_come_in_order():
    ran_on = []

    def task(i):
        ran_on.append(threading.get_ident())
        time.sleep(0.005)  # long enough for the helper to take some
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


def test_many_callers_share_the_helpers_without_waiting_on_each_other():
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
