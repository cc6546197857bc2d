"""A stop drains the Python handle's calls as it drains HTTP requests: counted in flight
while answered, refused (503) once the service is stopping. (The drain itself, over real
HTTP and a real SIGTERM: tests/serve/test_serve.py.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from fp8ray.engine.worker import BlockMeta
from fp8ray.errors import RequestError
from fp8ray.serve.deployment import Fp8Service


def replica_answering(seen: list[int]):
    """The replica class's own methods, without Serve: its worker call records how many
    requests the replica counts in flight while the call runs."""
    cls = Fp8Service.func_or_class.__mro__[1]  # the class as written, not Serve's ASGI wrapper of it
    replica = cls.__new__(cls)
    replica._in_flight, replica._draining = 0, False

    async def call(method, items, *extra):
        seen.append(replica._in_flight)
        if method.__name__ == "encode_batch":
            return [(np.frombuffer(b"frame", np.uint8), None)]
        return [(np.zeros(8, np.uint8), BlockMeta("frame", "float32", (2,), "cpu", 8, 8))]

    replica._call = call
    return replica


def test_handle_calls_are_counted_in_flight_and_refused_once_stopping():
    seen: list[int] = []
    replica = replica_answering(seen)
    assert asyncio.run(replica.encode(torch.ones(4))) == b"frame"
    assert torch.equal(asyncio.run(replica.decode(b"\0" * 8)), torch.zeros(2))
    assert seen == [1, 1] and replica._in_flight == 0  # the drain waited for neither
    replica._draining = True
    for call in (replica.encode(torch.ones(4)), replica.decode(b"\0" * 8)):
        with pytest.raises(RequestError, match="the service is stopping") as refused:
            asyncio.run(call)
        assert refused.value.status == 503
    assert seen == [1, 1]  # no worker was called
