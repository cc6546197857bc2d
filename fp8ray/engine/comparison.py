"""``verify --against``: each decoded block compared with its source block, for its error
metrics (:mod:`fp8ray.codec.metrics`) and against the codec's derived bound
(:mod:`fp8ray.codec.bound`).

Small blocks of one layout (dtype, shape, scaling and block size) are compared a run at
a time: alone, a block of 4096 elements took about 25 torch ops of a few microseconds each
(0.8 ms a block, the archive's small blocks); a run takes those ops once. Each layout has
its run pending, so that blocks of two layouts in turn (an MLA model's K and V, say) still
form runs; together they hold at most :data:`RUN_ELEMENTS` elements. The sums of each
block are its own row's, as alone. A run in which any element is out of its bound (or
that cannot be compared whole) is compared again block by block, so that each block's
error names its own first element, as it would alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..codec import decode, frame
from ..codec.blocks import bytes_to_tensor, decode_rows_into
from ..codec.bound import CHECK_ELEMENTS, check_within_bound, element_scales
from ..codec.metrics import error_metrics, row_sums
from ..errors import MismatchError

# Elements of the runs pending together: a run's bound check in one piece (about ten
# float64 temporaries each).
RUN_ELEMENTS = CHECK_ELEMENTS
# Blocks of fewer elements only go in runs: torch splits the sum of a longer row across
# its threads (at::internal::GRAIN_SIZE), not the rows of a run, so a larger block's sums
# could differ from its sums alone in the last bit; and a block that large gains nothing.
RUN_BLOCK_ELEMENTS = 32768

COMPARE_ERRORS = (ValueError, TypeError, RuntimeError)  # what a block's comparison raises


@dataclass
class SourceBlock:
    """A block to compare: ``source`` its source's raw bytes, ``buf`` its frame."""

    row: int
    label: str
    source: np.ndarray
    buf: np.ndarray
    header: frame.FrameHeader


def _layout(block: SourceBlock) -> tuple:
    """What the blocks of a run share: their frames' layout and size (one row each of one
    array, decoded as one)."""
    h = block.header
    return h.dtype, tuple(h.shape), h.scaling, h.block_size, block.buf.size


class SourceComparison:
    """Blocks compared as they are added, in runs of one layout; :meth:`finish` compares
    what is left. Each block's metrics go to ``metrics`` (by label, in row order), and a
    block that does not check to ``failed(row, label, error)``."""

    def __init__(self, bound: dict, metrics: dict[str, dict], failed: Callable[[int, str, Exception], None], threads: int = 1):
        self._threads = threads  # the decode's
        self._bound = bound
        self._metrics = metrics
        self._failed = failed
        self._runs: dict[tuple, list[SourceBlock]] = {}  # by layout
        self._pending = 0  # elements in them
        self._compared: list[tuple[int, str, dict]] = []  # (row, label, metrics): in row order at the end

    def add(self, block: SourceBlock) -> None:
        numel = block.header.numel
        if numel >= RUN_BLOCK_ELEMENTS:  # alone
            self._compare([block])
            return
        if self._pending + numel > RUN_ELEMENTS:
            self._compare_pending()
        self._runs.setdefault(_layout(block), []).append(block)
        self._pending += numel

    def finish(self) -> None:
        """Compare the runs still pending, and give every block's metrics in row order."""
        self._compare_pending()
        for _, label, metrics in sorted(self._compared, key=lambda compared: compared[0]):
            self._metrics[label] = metrics
        self._compared = []

    def _compare_pending(self) -> None:
        runs, self._runs, self._pending = self._runs, {}, 0
        for run in runs.values():
            self._compare(run)

    def _compare(self, run: list[SourceBlock]) -> None:
        if len(run) > 1:
            try:
                if self._compare_run(run):
                    return
            except COMPARE_ERRORS:
                pass  # compared block by block below, each naming its own
        for block in run:
            try:
                self._compare_one(block)
            except COMPARE_ERRORS as exc:
                self._failed(block.row, block.label, exc)

    def _compare_one(self, block: SourceBlock) -> None:
        h = block.header
        x, y = bytes_to_tensor(block.source, h.dtype, h.shape), decode(block.buf)
        self._compared.append((block.row, block.label, error_metrics(x, y)))  # a stray block's too
        scales = torch.from_numpy(frame.scales_of(block.buf, h).copy())
        stray = check_within_bound(x, y, element_scales(scales, h.scaling, h.shape, h.block_size), self._bound)
        if stray is not None:
            raise MismatchError(f"{stray}: not the data this block was compressed from")

    def _compare_run(self, run: list[SourceBlock]) -> bool:
        """Compare a run of blocks of one layout as one: True where every element is
        within its bound (each block's metrics recorded), else False (nothing recorded)."""
        h = run[0].header
        x = torch.stack([bytes_to_tensor(b.source, h.dtype, h.shape).reshape(-1) for b in run])
        decoded = np.empty(len(run) * h.tensor_nbytes, np.uint8)
        rows = np.stack([b.buf for b in run])  # the frames as decompress decodes a part's: one call
        decode_rows_into([b.label for b in run], rows, decoded, h.dtype, tuple(h.shape), threads=self._threads)
        y = bytes_to_tensor(decoded, h.dtype, (len(run), h.numel))
        if h.scaling == "none":
            scale = torch.ones(x.shape, dtype=torch.float32)
        else:  # each block's scales, spread over its elements as element_scales spreads one block's
            scales = torch.from_numpy(np.stack([frame.scales_of(b.buf, b.header) for b in run]))
            spread = element_scales(torch.arange(scales.shape[1]), h.scaling, h.shape, h.block_size)
            scale = scales[:, spread]
        if check_within_bound(x.reshape(-1), y.reshape(-1), scale.reshape(-1), self._bound) is not None:
            return False
        for block, sums in zip(run, row_sums(x, y)):
            self._compared.append((block.row, block.label, sums.metrics()))
        return True
