"""Arrow tables from columns of Python lists, built on their buffers.

``pa.array`` of a list (and so ``pa.table`` of a dict of lists) first asks whether
pandas could read the list, which imports pandas: 0.14 s of a one-shot command's start,
for the columns fp8ray writes, whose layout is simple enough to build here (strings,
bytes, integers and lists of them, none of them null); other types go to ``pa.array``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..errors import MismatchError

_OFFSETS = {pa.string(): np.int32, pa.binary(): np.int32, pa.large_string(): np.int64, pa.large_binary(): np.int64}
INT32_OFFSETS_MAX = 2**31 - 1  # past it, a string or binary column takes several chunks


def binary_buffers(chunk: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A ``binary`` or ``large_binary`` array's values without a copy: Arrow's data buffer
    as uint8, and the ``len(chunk) + 1`` offsets of its values into it."""
    _, offsets, data = chunk.buffers()
    offsets = np.frombuffer(offsets, dtype=_OFFSETS[chunk.type])[chunk.offset : chunk.offset + len(chunk) + 1]
    data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(0, np.uint8)  # every value empty
    return data, offsets


def table(columns: dict, schema: pa.Schema) -> pa.Table:
    """The table of ``schema`` holding ``columns`` (by name: lists of values, or Arrow
    arrays of the field's type); what ``pa.table(columns, schema=schema)`` gives."""
    if set(columns) != set(schema.names):
        raise MismatchError(f"columns {sorted(columns)} do not match the schema's {sorted(schema.names)}")
    return pa.Table.from_arrays([column(columns[field.name], field.type) for field in schema], schema=schema)


def column(values, arrow_type: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """``values`` (a list, or an Arrow array of that type) as an Arrow array of ``arrow_type``
    (chunked, as pyarrow makes it, where a string or binary column passes 2 GiB)."""
    if isinstance(values, pa.Array):
        if values.type != arrow_type:
            raise TypeError(f"an Arrow array of {values.type} where {arrow_type} is expected")
        return values
    if pa.types.is_integer(arrow_type):
        # Not arrow_type.to_pandas_dtype(): before pyarrow 26 it imports pandas, which
        # fp8ray does not depend on ("No module named 'pandas'" from a compress).
        kind = "i" if pa.types.is_signed_integer(arrow_type) else "u"
        dtype = np.dtype(f"{kind}{arrow_type.bit_width // 8}")
        return _integers(np.asarray(values, dtype=dtype), arrow_type)  # a value out of range raises
    if arrow_type in _OFFSETS:
        text = arrow_type in (pa.string(), pa.large_string())
        items = [value.encode() if text else memoryview(value).cast("B") for value in values]
        offsets = _offsets(items, np.int64)
        if _OFFSETS[arrow_type] == np.int32 and offsets[-1] > INT32_OFFSETS_MAX:
            return pa.array(values, type=arrow_type)  # pyarrow splits it into chunks
        data = pa.py_buffer(b"".join(items))
        return pa.Array.from_buffers(arrow_type, len(items), [None, pa.py_buffer(offsets.astype(_OFFSETS[arrow_type])), data])
    if pa.types.is_list(arrow_type):
        inner = column([item for value in values for item in value], arrow_type.value_type)
        if isinstance(inner, pa.ChunkedArray):  # items past 2 GiB: pyarrow's way
            return pa.array(values, type=arrow_type)
        return pa.ListArray.from_arrays(_integers(_offsets(values, np.int32), pa.int32()), inner, type=arrow_type)
    return pa.array(values, type=arrow_type)  # any other type (a user's Parquet schema): pyarrow's way


def _integers(data: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    """An Arrow array over a NumPy array of ``arrow_type``'s integers, without a copy."""
    return pa.Array.from_buffers(arrow_type, data.size, [None, pa.py_buffer(data)])


def _offsets(items: list, dtype) -> np.ndarray:
    """Where each item starts, and the end of the last: the running sums of their lengths."""
    offsets = np.zeros(len(items) + 1, dtype=dtype)
    np.cumsum(np.fromiter(map(len, items), dtype=dtype, count=len(items)), out=offsets[1:])
    return offsets
