"""Ray Data batches as Arrow tables, and their columns read without copying the bytes.

``map_batches`` hands a UDF a ``pyarrow.Table``, a pandas ``DataFrame`` or a dict of
numpy arrays, depending on ``batch_format``. Everything here turns the batch into an
Arrow table once (no copy for ``"pyarrow"``, little for pandas' Arrow-backed columns),
so the encoder and decoder have one code path, and reads the large binary columns
(``data``, ``frame``) as memoryviews of Arrow's own buffer. Bad input raises
:class:`~fp8ray.errors.BadInputError` naming the column (``field``) and the row or key.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from ..codec.formats import DTYPE_ITEMSIZES
from ..errors import BadInputError
from ..io.columns import binary_buffers

# What Fp8Decoder returns: the raw-block layout fp8ray reads as a source. ``data`` is
# large_binary (64-bit offsets) so that a batch may hold more than 2 GiB of blocks.
RAW_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("dtype", pa.string()),
        ("shape", pa.list_(pa.int64())),
        ("data", pa.large_binary()),
    ]
)
# Fp8Decoder's output when its rows name their source file: that column first, as in a part.
RAW_FILE_SCHEMA = pa.schema([pa.field("file", pa.string()), *RAW_SCHEMA])


def as_table(batch, columns: tuple[str, ...], who: str, optional: tuple[str, ...] = ()) -> pa.Table:
    """The ``columns`` of a batch, and those of ``optional`` it has, as an Arrow table
    (other columns are dropped).

    Takes what ``map_batches`` passes for each ``batch_format``: an Arrow table
    (``"pyarrow"``, used as it is), a pandas DataFrame (``"pandas"``) or a mapping of
    column names to numpy arrays or lists (``"numpy"``)."""
    pandas = sys.modules.get("pandas")  # a DataFrame exists only if pandas was imported
    if isinstance(batch, pa.Table):
        present = batch.column_names
    elif pandas is not None and isinstance(batch, pandas.DataFrame):
        present = list(batch.columns)
    elif isinstance(batch, Mapping):
        present = list(batch)
    else:
        raise TypeError(f"{who} takes a pyarrow.Table, a pandas DataFrame or a dict of numpy arrays, got {type(batch).__name__}")
    missing = [name for name in columns if name not in present]
    if missing:
        raise BadInputError(
            f"{who} needs columns {list(columns)}; the batch lacks {missing} (it has {present})", field=missing[0]
        )
    columns = (*columns, *(name for name in optional if name in present))
    if isinstance(batch, pa.Table):
        return batch.select(list(columns))
    if isinstance(batch, Mapping):
        return pa.table({name: _arrow_column(name, batch[name], who) for name in columns})
    try:
        return pa.Table.from_pandas(batch[list(columns)], preserve_index=False)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise BadInputError(f"{who}: a pandas batch's columns {list(columns)} do not convert to Arrow: {exc}") from exc


def _arrow_column(name: str, values, who: str) -> pa.Array:
    """One column of a ``"numpy"`` batch as an Arrow array. Ray Data gives string, binary
    and list columns as object arrays; a 2-D array (shapes built by hand) is taken row
    by row."""
    if isinstance(values, np.ndarray) and (values.dtype == object or values.ndim > 1):
        values = list(values)
    try:
        return pa.array(values)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise BadInputError(f"{who}: column {name!r} does not convert to Arrow: {exc}", field=name) from exc


def keys(table: pa.Table) -> list[str]:
    """The ``key`` column: one string per row; integer keys (which a raw-block Parquet
    source may hold, as ``fp8ray compress`` takes them) as their decimal strings."""
    column = table.column("key")
    kind = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
    if pa.types.is_integer(kind):
        table = table.set_column(table.column_names.index("key"), "key", column.cast(pa.string()))
    return _strings(table, "key")


def files(table: pa.Table) -> list[str] | None:
    """The ``file`` column (the source file a block came from, as in archive parts), or
    ``None`` when the batch has none."""
    return _strings(table, "file") if "file" in table.column_names else None


def _strings(table: pa.Table, name: str) -> list[str]:
    values = table.column(name).to_pylist()
    for row, value in enumerate(values):
        if not isinstance(value, str):
            raise BadInputError(f"column {name!r}: row {row} holds {value!r}, expected a string", field=name)
    return values


def dtypes(table: pa.Table, row_keys: list[str]) -> list[str]:
    """The ``dtype`` column: one of fp8ray's source dtype names per row."""
    values = table.column("dtype").to_pylist()
    for key, dtype in zip(row_keys, values):
        if dtype not in DTYPE_ITEMSIZES:
            raise BadInputError(
                f"block {key!r}: column 'dtype' holds {dtype!r}; expected one of {sorted(DTYPE_ITEMSIZES)}", field=key
            )
    return values


def shapes(table: pa.Table, row_keys: list[str]) -> list[tuple[int, ...]]:
    """The ``shape`` column: a list of non-negative integers per row (``[]`` for 0-d)."""
    out = []
    for key, shape in zip(row_keys, table.column("shape").to_pylist()):
        try:
            dims = tuple(_dimension(d) for d in shape)
        except (TypeError, ValueError):
            raise BadInputError(
                f"block {key!r}: column 'shape' holds {shape!r}; expected a list of non-negative integers", field=key
            ) from None
        out.append(dims)
    return out


def _dimension(d) -> int:
    if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d < 0:
        raise BadInputError(repr(d))  # the caller names the block and the column
    return int(d)


def binary_values(table: pa.Table, name: str, row_keys: list[str]) -> list[memoryview]:
    """A ``binary`` or ``large_binary`` column's values as memoryviews of Arrow's buffer
    (read-only, no copy). A null value raises, naming its key."""
    column = table.column(name)
    if not len(column):  # an empty pandas or numpy batch's column converts to Arrow's null type
        return []
    if pa.types.is_fixed_size_binary(column.type):  # as compress takes it (blocks of one size)
        column = column.cast(pa.large_binary())
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        raise BadInputError(f"column {name!r} must be binary, large_binary or fixed_size_binary, not {column.type}", field=name)
    values: list[memoryview] = []
    for chunk in column.chunks:
        if chunk.null_count:
            row = len(values) + int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False))[0])
            raise BadInputError(f"block {row_keys[row]!r}: column {name!r} is null", field=row_keys[row])
        data, offsets = binary_buffers(chunk)
        view = memoryview(data)
        values.extend(view[offsets[i] : offsets[i + 1]] for i in range(len(chunk)))
    return values
