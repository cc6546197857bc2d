"""``Fp8Decoder``: a Ray Data UDF from rows of archive parts (or of ``Fp8Encoder``) back
to raw-block rows."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from ..codec import frame
from ..codec.blocks import BlockSpec, decode_into
from ..errors import BadInputError, CorruptDataError, InvalidOptionError, MismatchError, block_error
from ..io import archive
from ..io import columns as arrow_columns
from . import batches
from .batches import RAW_FILE_SCHEMA, RAW_SCHEMA
from .runtime import check_threads, choose_device

COLUMNS = ("key", "frame")


class Fp8Decoder:
    """Decode fp8 frames to raw blocks, as a callable class for ``Dataset.map_batches``.

    Rows in: at least ``key`` and ``frame`` (``binary`` or ``large_binary``), as in an
    archive part (``ray.data.read_parquet(ARCHIVE_DIR)``) or ``Fp8Encoder``'s output;
    other columns are dropped. Rows out: ``key``, ``dtype``, ``shape``, ``data`` (the
    raw little-endian bytes, ``large_binary``), :data:`~fp8ray.data.RAW_SCHEMA`, as a
    ``pyarrow.Table`` whatever the ``batch_format``: the raw-block layout ``fp8ray
    compress`` reads. With ``with_file=True``, the rows' ``file`` column (archive parts
    and ``Fp8Encoder``'s output have one) comes first (:data:`~fp8ray.data.RAW_FILE_SCHEMA`),
    so blocks can be grouped by the file they came from. Each block is bit for bit
    :func:`fp8ray.decode` of its frame; frames describe themselves, so there are no options.

    >>> ds = ray.data.read_parquet("kv.fp8/", columns=["key", "dtype", "shape", "frame"])
    >>> blocks = ds.map_batches(Fp8Decoder, batch_format="pyarrow", num_cpus=1, compute=ActorPoolStrategy(size=2))

    Each frame's checksum is verified. When the rows also carry ``dtype`` and ``shape``
    (archive parts do) they size the output, and a frame that disagrees with them raises
    :class:`~fp8ray.errors.MismatchError` naming the key; without them the frame's own
    header is read first (one more pass of its checksum).

    Args:
        device: ``"cpu"``, ``"cuda"``, or ``None``: the GPU when Ray gave this actor one.
        threads: CPU kernel threads in this actor (match ``num_cpus``); ``None``: all CPUs.
        with_file: keep the ``file`` column (the batch must have one). Off by default:
            ``fp8ray compress`` refuses a raw-block source with columns it would not
            archive, so such output is for grouping, not for compressing again as it is.

    Raises (from a batch): :class:`~fp8ray.errors.CorruptFrameError` naming the key of a
    corrupt or truncated frame; :class:`~fp8ray.errors.BadInputError` naming the column
    or key of any other bad input.
    """

    def __init__(self, *, device: str | None = None, threads: int | None = None, with_file: bool = False):
        self.device = choose_device(device)
        if not isinstance(with_file, bool):  # "no" would be true
            raise InvalidOptionError(f"with_file must be True or False, got {with_file!r}", field="with_file")
        self.with_file = with_file
        self.threads = check_threads(threads)

    def __call__(self, batch) -> pa.Table:
        required = ("file", *COLUMNS) if self.with_file else COLUMNS
        table = batches.as_table(batch, required, "Fp8Decoder", optional=("dtype", "shape"))
        keys = batches.keys(table)
        files = batches.files(table) if self.with_file else None
        frames = [frame.as_byte_array(f) for f in batches.binary_values(table, "frame", keys)]
        if "dtype" in table.column_names and "shape" in table.column_names:
            dtypes = batches.dtypes(table, keys)
            shapes = batches.shapes(table, keys)
            for key, f, dtype, shape in zip(keys, frames, dtypes, shapes):
                # A frame holds one byte per element and more: a row claiming more
                # elements than that is refused before anything is allocated for it.
                if math.prod(shape) >= f.size:
                    _parse(key, f)  # a damaged frame is named as such first
                    raise MismatchError(
                        f"block {key!r}: columns 'dtype' and 'shape' say {list(shape)} {dtype}, more elements than "
                        f"its {f.size}-byte frame can hold",
                        field=key,
                    )
        else:
            headers = [_parse(key, f) for key, f in zip(keys, frames)]
            dtypes = [h.dtype for h in headers]
            shapes = [h.shape for h in headers]
        specs = [BlockSpec(key, dtype, tuple(shape)) for key, dtype, shape in zip(keys, dtypes, shapes)]
        sizes = [spec.nbytes for spec in specs]
        # Blocks are decoded end to end into one buffer that becomes the data column.
        out = np.empty(sum(sizes), dtype=np.uint8)
        try:
            decode_into(list(zip(keys, frames)), out, specs, device=self.device, threads=self.threads)
        except CorruptDataError:
            raise  # named by its key
        except BadInputError as exc:  # a sound frame that disagrees with its row's columns?
            for key, f, spec in zip(keys, frames, specs):
                held = _parse(key, f)
                if (held.dtype, held.shape) != (spec.dtype, spec.shape):
                    raise MismatchError(
                        f"block {key!r}: columns 'dtype' and 'shape' say {list(spec.shape)} {spec.dtype}, "
                        f"its frame holds {list(held.shape)} {held.dtype}",
                        field=key,
                    ) from exc
            raise
        columns = {"key": keys, "dtype": dtypes, "shape": [list(s) for s in shapes], "data": archive.frame_column(out, sizes)}
        if files is None:
            return arrow_columns.table(columns, RAW_SCHEMA)
        return arrow_columns.table({"file": files, **columns}, RAW_FILE_SCHEMA)


def _parse(key: str, f: np.ndarray) -> frame.FrameHeader:
    try:
        return frame.parse(f)
    except CorruptDataError as exc:
        raise block_error(key, exc) from exc
