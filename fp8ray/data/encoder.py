"""``Fp8Encoder``: a Ray Data UDF from raw-block rows to rows of an archive part."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..codec import CodecOptions, Fp8Codec
from ..codec.blocks import Block, encode_into, frame_sizes, frames_buffer
from ..errors import BadInputError
from ..io import archive
from ..io import columns as arrow_columns
from ..io.blocks import BlockRef
from . import batches
from .runtime import check_threads, choose_device

COLUMNS = ("key", "dtype", "shape", "data")


class Fp8Encoder:
    """Encode raw blocks to fp8 frames, as a callable class for ``Dataset.map_batches``.

    Rows in: ``key`` (string), ``dtype`` (``"bfloat16"``, ``"float16"`` or ``"float32"``,
    encoded in fp8, or a dtype a stored frame holds as it is: ``"int64"``, ``"bool"``, ...),
    ``shape`` (list of ints) and ``data`` (the block's raw little-endian bytes), the
    raw-block layout fp8ray reads as a source, and optionally ``file`` (the name of the
    source file the block belongs to); other columns are dropped. Rows out: the archive
    part schema :data:`fp8ray.io.archive.SCHEMA` (file, empty when not given; key, dtype,
    shape, fp8, scaling, block_size, raw_bytes, frame_bytes, frame), as a ``pyarrow.Table`` whatever the
    ``batch_format``. Each frame is exactly ``Fp8Codec(options).encode`` of its block.

    >>> ds = ray.data.read_parquet("raw/")   # key, dtype, shape, data
    >>> frames = ds.map_batches(Fp8Encoder, fn_constructor_kwargs={"scaling": "token"},
    ...                         batch_format="pyarrow", num_cpus=1, compute=ActorPoolStrategy(size=2))

    Args:
        options: a :class:`~fp8ray.codec.CodecOptions` (default: the default mode).
        device: ``"cpu"``, ``"cuda"``, or ``None``: the GPU when Ray gave this actor one.
        threads: CPU kernel threads in this actor (match ``num_cpus``); ``None``: all CPUs.
        **codec_options: any field of ``CodecOptions`` (``scaling="token"``), each
            overriding only itself, as for ``fp8ray compress``.

    Raises (from a batch): :class:`~fp8ray.errors.BadInputError` naming the column or
    the key (a missing column, an unknown dtype, a shape whose size is not the data's);
    :class:`~fp8ray.errors.NonFiniteError` naming the key, under ``nonfinite="error"``.
    """

    def __init__(
        self, options: CodecOptions | None = None, *, device: str | None = None, threads: int | None = None, **codec_options
    ):
        self.options = CodecOptions.parse(codec_options, base=options)
        self.codec = Fp8Codec(options=self.options)
        self.device = choose_device(device)
        self.threads = check_threads(threads)

    def __call__(self, batch) -> pa.Table:
        table = batches.as_table(batch, COLUMNS, "Fp8Encoder", optional=("file",))
        keys = batches.keys(table)
        files = batches.files(table) or [""] * len(keys)
        dtypes = batches.dtypes(table, keys)
        shapes = batches.shapes(table, keys)
        data = batches.binary_values(table, "data", keys)
        # part_rows reads only a ref's key, dtype, shape and file; the row index stands
        # in for where the bytes lie.
        refs = [
            BlockRef(key, dtype, shape, "batch", "", row, file)
            for row, (key, dtype, shape, file) in enumerate(zip(keys, dtypes, shapes, files))
        ]
        for ref, value in zip(refs, data):
            if len(value) != ref.nbytes:
                raise BadInputError(
                    f"block {ref.key!r}: column 'data' holds {len(value)} bytes, its shape {list(ref.shape)} "
                    f"{ref.dtype} needs {ref.nbytes}",
                    field=ref.key,
                )
        blocks = [Block(ref.key, ref.dtype, ref.shape, np.frombuffer(value, dtype=np.uint8)) for ref, value in zip(refs, data)]
        # Frames are encoded end to end into one buffer that becomes the Arrow column
        # as it is, as a worker writes a part.
        sizes = frame_sizes(self.codec, blocks)
        frames = frames_buffer(blocks, sizes)
        encode_into(self.codec, blocks, frames, sizes, device=self.device, threads=self.threads)
        rows = archive.part_rows(refs, self.options, sizes, archive.frame_column(frames, sizes))
        return arrow_columns.table(rows, archive.SCHEMA)
