"""fp8ray.io.columns: the Arrow tables fp8ray writes, built without ``pa.array`` of a list
(which imports pandas), equal to what pyarrow builds itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from fp8ray.data.batches import RAW_FILE_SCHEMA, RAW_SCHEMA
from fp8ray.errors import MismatchError
from fp8ray.io import archive, columns

REPO = Path(__file__).resolve().parents[2]


def value_of(arrow_type: pa.DataType, rng: np.random.Generator):
    """A random value of a column type fp8ray writes: unicode and empty strings, empty
    and long byte strings, integers at the type's ends, empty and 0-d shapes."""
    if pa.types.is_integer(arrow_type):
        info = np.iinfo(arrow_type.to_pandas_dtype())
        return int(rng.choice([info.min, -1, 0, 1, info.max]))
    if arrow_type in (pa.string(), pa.large_string()):
        return "".join(rng.choice(list("aZ0/_é鍵 "), size=int(rng.integers(0, 12))))
    if arrow_type in (pa.binary(), pa.large_binary()):
        return rng.integers(0, 256, size=int(rng.choice([0, 1, 3000])), dtype=np.uint8).tobytes()
    return [value_of(arrow_type.value_type, rng) for _ in range(int(rng.integers(0, 5)))]


def rows_for(schema: pa.Schema, n: int, rng: np.random.Generator) -> dict[str, list]:
    return {field.name: [value_of(field.type, rng) for _ in range(n)] for field in schema}


@pytest.mark.parametrize("schema", [archive.SCHEMA, RAW_SCHEMA, RAW_FILE_SCHEMA], ids=["part", "raw", "raw+file"])
@pytest.mark.parametrize("n", [0, 1, 7])
def test_a_table_equals_pyarrows_own(schema, n):
    rows = rows_for(schema, n, np.random.default_rng(n))
    built = columns.table(rows, schema)
    built.validate(full=True)
    assert built.equals(pa.table(rows, schema=schema))
    assert built.schema == schema


def test_an_arrow_array_is_taken_as_it_is_and_checked():
    frames = pa.array([b"ab", b""], type=pa.large_binary())
    assert columns.column(frames, pa.large_binary()) is frames
    with pytest.raises(TypeError, match="large_binary"):
        columns.column(frames, pa.binary())


def test_a_users_column_types_come_out_as_pyarrow_makes_them():
    """A user's raw-block Parquet may hold shapes as lists of int32 or large lists (those
    go to pa.array), and other types."""
    shapes = [[2, 3], [], [4]]
    for arrow_type in (pa.large_list(pa.int32()), pa.list_(pa.int32()), pa.list_(pa.string())):
        values = shapes if arrow_type != pa.list_(pa.string()) else [["a", "é"], [], ["c"]]
        assert columns.column(values, arrow_type).equals(pa.array(values, type=arrow_type))


@pytest.mark.parametrize("arrow_type", [pa.binary(), pa.string(), pa.list_(pa.binary())])
def test_a_column_past_32_bit_offsets_goes_to_pyarrow(monkeypatch, arrow_type):
    """Past 2 GiB a string or binary column needs chunks; built here its int32 offsets
    would wrap (the limit lowered so that the test needs no gigabytes)."""
    monkeypatch.setattr(columns, "INT32_OFFSETS_MAX", 5)
    values = (
        [[b"abc", b"def"]]
        if arrow_type == pa.list_(pa.binary())
        else (["abc", "def"] if arrow_type == pa.string() else [b"abc", b"def"])
    )
    calls = []
    monkeypatch.setattr(
        columns.pa, "array", lambda v, **kw: calls.append(kw["type"]) or pa.chunked_array([pa.lib.array(v, **kw)])
    )
    built = columns.column(values, arrow_type)
    assert calls[-1] == arrow_type and isinstance(built, pa.ChunkedArray)  # a list: its items first
    assert built.to_pylist() == values


def test_bad_columns_are_named():
    schema = pa.schema([("key", pa.string()), ("size", pa.int32())])
    with pytest.raises(MismatchError, match="'extra'"):
        columns.table({"key": [], "size": [], "extra": []}, schema)
    with pytest.raises(MismatchError, match="'size'"):
        columns.table({"key": []}, schema)
    with pytest.raises(OverflowError):
        columns.table({"key": ["a"], "size": [2**31]}, schema)


@pytest.mark.parametrize("pandas", ["installed", "not installed"])
def test_a_one_shot_compress_and_decompress_import_no_pandas(tmp_path, pandas):
    """pandas costs 0.14 s of a one-shot command's start (issue 18 item 5), and fp8ray does
    not depend on it: without pandas (pyarrow before 26 imported it for
    ``to_pandas_dtype``: "No module named 'pandas'") they run all the same. (With pyarrow
    26 and later, as here, that case passes whatever fp8ray does; it guards older ones.)"""
    code = f"""
import sys
if {pandas == "not installed"}:
    sys.modules["pandas"] = None  # an import of it raises ImportError
import torch
from fp8ray import PoolSettings
from fp8ray.engine.archives import compress_archive, decompress_archive
from fp8ray.io.safetensors import SafetensorsWriter
x = torch.randn(4, 64).bfloat16()
with SafetensorsWriter({str(tmp_path / "a.safetensors")!r}, [("k", "bfloat16", (4, 64))]) as w:
    w.write(x.view(torch.uint8).numpy().reshape(-1))
pool = PoolSettings(num_workers=1, address="inline")
compress_archive({str(tmp_path / "a.safetensors")!r}, {str(tmp_path / "arch")!r}, pool=pool)
decompress_archive({str(tmp_path / "arch")!r}, {str(tmp_path / "out")!r}, pool=pool)
print(sys.modules.get("pandas") is not None)
"""
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out").is_file()  # a one-file source comes back as that file
    assert result.stdout.split()[-1] == "False"
