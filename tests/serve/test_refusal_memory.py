"""A refused request's body is freed when its answer is: the exceptions that carry a
worker's error to the replica form no reference cycle (which only a garbage collection
frees; a burst of failing 96 MiB requests held one body each until one ran). The
replica's own methods, driven without Serve or a running Ray."""

from __future__ import annotations

import gc
import itertools
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
from ray.exceptions import RayTaskError

from fp8ray.engine.worker import QuantWorker
from fp8ray.errors import NonFiniteError
from fp8ray.serve import deployment

SERVICE = deployment.Fp8Service.func_or_class


class _FailingWorker:
    """A QuantWorker handle whose every call fails on its data, as Ray reports it."""

    def __getattr__(self, method: str):
        async def fail(*args):
            raise RayTaskError(method, "Traceback: ...", NonFiniteError("1 non-finite value(s)"))

        return SimpleNamespace(remote=fail)


def _replica() -> SimpleNamespace:
    """The state :meth:`Fp8Service._call` reads."""
    return SimpleNamespace(
        _next=itertools.count(), num_workers=2, _worker=lambda index: _FailingWorker(), _handles={}, _record=lambda **_: None
    )


def _refused(coroutine) -> None:
    """Run a coroutine that finishes without waiting, expecting the worker's error; the
    error is dropped here, as the replica drops it once answered."""
    try:
        coroutine.send(None)
    except NonFiniteError:
        return
    pytest.fail("the worker's error was not raised")


@pytest.fixture
def no_collection():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_a_worker_error_leaves_no_cycle_holding_the_body(no_collection):
    body = np.zeros(1 << 16, np.uint8)
    alive = weakref.ref(body)
    _refused(SERVICE._call(_replica(), QuantWorker.encode_batch, [body]))
    del body
    assert alive() is None


def test_a_batched_requests_error_raised_leaves_no_cycle_holding_the_body(no_collection):
    """A batch hands each request its own error (:meth:`Fp8Service._batch`), whose
    traceback holds the frames that saw the body; raising it must not add a cycle."""
    body = np.zeros(1 << 16, np.uint8)
    alive = weakref.ref(body)

    def worker(data):
        raise NonFiniteError("1 non-finite value(s)")

    try:
        worker(body)
    except NonFiniteError as exc:
        answer = exc
    try:
        deployment._answer_of(answer)
    except NonFiniteError:
        pass
    del answer, body
    assert alive() is None
