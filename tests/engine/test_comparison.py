"""verify --against's comparison, in runs of blocks of one layout: each block's metrics
and errors are exactly what it gets compared alone, and its metrics come in row order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _util import tensor_bytes

import fp8ray.engine.comparison as comparison
from fp8ray import Fp8Codec
from fp8ray.codec import CodecOptions, frame
from fp8ray.codec.bound import bound_constants
from fp8ray.engine.comparison import SourceBlock, SourceComparison


def blocks_of(options: CodecOptions, tensors: list[torch.Tensor], sources: list[torch.Tensor] | None = None):
    """A SourceBlock of each tensor, encoded in ``options``, compared with ``sources`` (else itself)."""
    codec = Fp8Codec(options=options)
    out = []
    for row, (t, s) in enumerate(zip(tensors, sources or tensors)):
        buf = frame.as_byte_array(bytes(codec.encode(t)))
        out.append(SourceBlock(row, f"b{row}", np.frombuffer(tensor_bytes(s), np.uint8), buf, frame.parse(buf)))
    return out


def spy_runs(monkeypatch) -> list[int]:
    """The sizes of the runs compared whole, each checked to have been (not fallen back)."""
    runs: list[int] = []
    whole = comparison.SourceComparison._compare_run

    def compare_run(self, run):
        ok = whole(self, run)
        runs.append(len(run) if ok else -len(run))
        return ok

    monkeypatch.setattr(comparison.SourceComparison, "_compare_run", compare_run)
    return runs


def compare(blocks, options: CodecOptions, run: bool):
    """(metrics, failures) of ``blocks`` compared as runs (``run``) or each alone."""
    metrics, failures = {}, []
    bound = bound_constants(options.fmt, options.scaling)
    c = SourceComparison(bound, metrics, lambda row, label, exc: failures.append((row, label, str(exc))))
    for block in blocks:
        c.add(block)
        if not run:
            c.finish()
    c.finish()
    return metrics, failures


MODES = ["", "e4m3fn:tensor", "e4m3fn:channel", "e4m3fn:token", "e4m3fn:none", "e5m2:block:block_size=16:scale_choice=amax"]


@pytest.mark.parametrize("mode", MODES)
def test_a_run_gives_each_block_its_metrics_alone(mode, monkeypatch):
    options = CodecOptions.from_mode(mode) if mode else CodecOptions()
    g = torch.Generator().manual_seed(1)
    shapes = [(2, 8, 40)] * 5 + [(3, 33)] * 3 + [(2, 8, 40)] * 2  # two layouts: two runs
    scale = [10.0 ** int(e) for e in torch.randint(-6, 4, (len(shapes),), generator=g)]  # the bound's subnormal terms too
    tensors = [(torch.randn(s, generator=g) * k).bfloat16() for s, k in zip(shapes, scale)]
    runs = spy_runs(monkeypatch)
    together, failures = compare(blocks_of(options, tensors), options, run=True)
    assert not failures and runs == [7, 3]
    alone, _ = compare(blocks_of(options, tensors), options, run=False)
    assert together == alone and list(together) == [f"b{i}" for i in range(10)]


def test_layouts_in_turn_each_form_a_run(monkeypatch):
    """An MLA model's K and V, say: blocks of two shapes one after the other."""
    options = CodecOptions()
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn((4, 64) if row % 2 else (2, 96), generator=g).bfloat16() for row in range(12)]
    runs = spy_runs(monkeypatch)
    together, failures = compare(blocks_of(options, tensors), options, run=True)
    assert not failures and runs == [6, 6]
    alone, _ = compare(blocks_of(options, tensors), options, run=False)
    assert together == alone and list(together) == [f"b{i}" for i in range(12)]


def test_a_stray_block_in_a_run_is_named_as_alone_and_the_others_measured():
    options = CodecOptions()
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(4, 64, generator=g).bfloat16() for _ in range(6)]
    sources = list(tensors)
    sources[3] = tensors[3] * 2  # not the data block 3 was compressed from
    metrics, failures = compare(blocks_of(options, tensors, sources), options, run=True)
    alone_metrics, alone_failures = compare(blocks_of(options, tensors, sources), options, run=False)
    assert failures == alone_failures and [(row, label) for row, label, _ in failures] == [(3, "b3")]
    assert "not the data this block was compressed from" in failures[0][2]
    assert metrics == alone_metrics and set(metrics) == {f"b{i}" for i in range(6)}  # the stray one's too


def test_runs_stop_at_their_element_budget(monkeypatch):
    """Pending runs hold at most RUN_ELEMENTS together, whatever their layouts."""
    monkeypatch.setattr(comparison, "RUN_ELEMENTS", 3 * 256)
    runs = spy_runs(monkeypatch)
    tensors = [torch.randn(4, 64).bfloat16() for _ in range(7)]
    _, failures = compare(blocks_of(CodecOptions(), tensors), CodecOptions(), run=True)
    assert not failures and runs == [3, 3]  # and the last alone
    runs.clear()
    monkeypatch.setattr(comparison, "RUN_ELEMENTS", 4 * 256)
    tensors = [torch.randn((4, 64) if row % 2 else (2, 128)).bfloat16() for row in range(8)]
    _, failures = compare(blocks_of(CodecOptions(), tensors), CodecOptions(), run=True)
    assert not failures and runs == [2] * 4  # two of each layout at a time


def test_a_large_block_is_compared_alone_whatever_its_neighbours(monkeypatch):
    """torch splits one long row's sum across threads, not a run's rows: a block of
    RUN_BLOCK_ELEMENTS or more is compared alone, so its metrics are those of verify ever."""
    runs = spy_runs(monkeypatch)
    tensors = [torch.randn(8, 4096).bfloat16() for _ in range(3)]  # 32768 elements each
    assert tensors[0].numel() == comparison.RUN_BLOCK_ELEMENTS
    metrics, failures = compare(blocks_of(CodecOptions(), tensors), CodecOptions(), run=True)
    assert not failures and runs == [] and len(metrics) == 3
