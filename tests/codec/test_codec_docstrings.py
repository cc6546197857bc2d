"""The examples in the codec's docstrings run as written (doctest)."""

from __future__ import annotations

import doctest

import pytest

import fp8ray.codec.fp8codec
import fp8ray.eval.eval_model


@pytest.mark.parametrize("module", [fp8ray.codec.fp8codec, fp8ray.eval.eval_model])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 1 and result.failed == 0
