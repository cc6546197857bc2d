"""The examples in the engine's docstrings run as written (doctest), on the session's Ray."""

from __future__ import annotations

import doctest

import pytest

import fp8ray.engine.pool

pytestmark = pytest.mark.usefixtures("ray_session")


def test_quantpool_docstring_example_runs():
    result = doctest.testmod(fp8ray.engine.pool, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0
