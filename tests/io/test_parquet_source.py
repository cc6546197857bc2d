"""Raw-block Parquet sources: every malformed column refused before any work, naming the
file, the column, the row and its key; the file's schema (its metadata too) recorded."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fp8ray.errors import SourceError
from fp8ray.io.blocks import parquet_schema, scan_source

KEYS = ["k0", "k1", "k2"]


def columns(**over) -> dict:
    data = {
        "key": pa.array(KEYS),
        "dtype": pa.array(["bfloat16", "float16", "float32"]),
        "shape": pa.array([[2, 4], [3], [2]], pa.list_(pa.int64())),
        "data": pa.array([b"\0" * 16, b"\0" * 6, b"\0" * 8], pa.binary()),
    }
    return {**data, **over}


def write(tmp_path, name="src.parquet", row_group_size=None, **over):
    path = tmp_path / name
    pq.write_table(pa.table(columns(**over)), path, row_group_size=row_group_size)
    return str(path)


@pytest.mark.parametrize(
    "over, message",
    [
        ({"key": pa.array(["k0", None, "k2"])}, r"row 1: column 'key' is null; expected a string"),
        ({"dtype": pa.array(["bfloat16", None, "float32"])}, r"row 1 \(key 'k1'\): column 'dtype' is null; expected one of"),
        ({"dtype": pa.array(["bfloat16", "F16", "float32"])}, r"row 1 \(key 'k1'\): column 'dtype' is 'F16'; expected one of"),
        (
            {"shape": pa.array([[2, 4], None, [2]], pa.list_(pa.int64()))},
            r"row 1 \(key 'k1'\): column 'shape' is null; expected a list of integers",
        ),
        (
            {"shape": pa.array([[2, 4], [None], [2]], pa.list_(pa.int64()))},
            r"row 1 \(key 'k1'\): column 'shape' is \[None\]; expected a list of non-negative integers",
        ),
        (
            {"shape": pa.array([[2, 4], [3], [-2]], pa.list_(pa.int64()))},
            r"row 2 \(key 'k2'\): column 'shape' is \[-2\]; expected a list of non-negative integers",
        ),
        (
            {"data": pa.array([b"\0" * 16, None, b"\0" * 8], pa.binary())},
            r"row 1 \(key 'k1'\): column 'data' is null; expected the block's bytes",
        ),
        ({"shape": pa.array(["2,4", "3", "2"])}, r"column 'shape' is string; expected a list of integers"),
        (
            {"data": pa.array([[0] * 16, [0] * 6, [0] * 8], pa.list_(pa.uint8()))},
            r"column 'data' is list<.*uint8>; expected binary",
        ),
        ({"key": pa.array([1.0, 2.0, 3.0])}, r"column 'key' is double; expected a string or an integer$"),
    ],
)
def test_a_bad_column_is_refused_naming_the_file_row_and_key(tmp_path, over, message):
    path = write(tmp_path, **over)
    with pytest.raises(SourceError, match=rf"^{path}: {message}"):
        scan_source(path)


@pytest.mark.parametrize(
    "drop, add, message",
    [
        ("shape", {}, r"a raw-block Parquet source needs columns \['key', 'dtype', 'shape', 'data'\]; missing \['shape'\]$"),
        (None, {"extra": pa.array([1, 2, 3])}, r"columns \['extra'\] are not archived"),
    ],
    ids=["missing", "extra"],
)
def test_a_missing_or_extra_column_is_named_in_one_line(tmp_path, drop, add, message):
    table = pa.table({k: v for k, v in columns(**add).items() if k != drop})
    path = str(tmp_path / "src.parquet")
    pq.write_table(table, path)
    with pytest.raises(SourceError, match=rf"^{path}: {message}"):
        scan_source(path)


def test_a_null_in_a_later_row_group_is_found_by_its_row(tmp_path):
    """Nulls in ``data`` are found from the row groups' statistics, the row counted across groups."""
    n = 10
    over = {
        "key": pa.array([f"b{i}" for i in range(n)]),
        "dtype": pa.array(["float32"] * n),
        "shape": pa.array([[1]] * n, pa.list_(pa.int32())),
        "data": pa.array([b"\0" * 4] * 7 + [None] + [b"\0" * 4] * 2, pa.large_binary()),
    }
    path = write(tmp_path, row_group_size=3, **over)
    with pytest.raises(SourceError, match=rf"^{path}: row 7 \(key 'b7'\): column 'data' is null"):
        scan_source(path)


def test_a_directory_source_names_the_file_at_fault(tmp_path):
    (tmp_path / "src").mkdir()
    write(tmp_path, "src/a.parquet")
    bad = write(tmp_path, "src/b.parquet", key=pa.array(["k0", "k1", None]))
    with pytest.raises(SourceError, match=rf"^{bad}: row 2: column 'key' is null"):
        scan_source(str(tmp_path / "src"))


def test_dictionary_and_large_types_are_taken_and_the_schema_kept_with_its_metadata(tmp_path):
    schema = pa.schema(
        [
            ("key", pa.large_string()),
            ("dtype", pa.dictionary(pa.int32(), pa.string())),
            ("shape", pa.large_list(pa.uint8())),
            ("data", pa.large_binary()),
        ],
        metadata={b"owner": b"me"},
    )
    table = pa.table(columns(), schema=schema)
    pq.write_table(table, tmp_path / "src.parquet")
    layout, refs = scan_source(str(tmp_path / "src.parquet"))
    assert [(r.key, r.dtype, r.shape, r.offset) for r in refs] == [
        ("k0", "bfloat16", (2, 4), 0),
        ("k1", "float16", (3,), 1),
        ("k2", "float32", (2,), 2),
    ]
    kept = parquet_schema(layout.files[0].schema)
    assert kept.equals(pq.read_schema(tmp_path / "src.parquet"), check_metadata=True)
    assert kept.metadata == {b"owner": b"me"}


def test_a_written_raw_block_file_groups_rows_by_count_and_bytes(tmp_path):
    """Rows were written 64 to a row group whatever their size: a million tiny rows made
    15,625 groups and a 1.4 MB footer; now a group ends at GROUP_ROWS rows or GROUP_BYTES."""
    from fp8ray.io.blocks import RawBlockParquetWriter

    schema = pa.schema([("key", pa.string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("data", pa.binary())])
    tiny = tmp_path / "tiny.parquet"
    with RawBlockParquetWriter(str(tiny), schema) as writer:
        for i in range(5000):
            writer.write_block(f"k{i}", "uint8", (2,), b"ab")
    assert pq.ParquetFile(tiny).metadata.num_row_groups == 1 and pq.read_table(tiny).num_rows == 5000
    big = tmp_path / "big.parquet"
    block = bytes(RawBlockParquetWriter.GROUP_BYTES // 2)
    with RawBlockParquetWriter(str(big), schema) as writer:
        for i in range(5):
            writer.write_block(f"b{i}", "uint8", (len(block),), block)
    groups = pq.ParquetFile(big).metadata
    assert [groups.row_group(g).num_rows for g in range(groups.num_row_groups)] == [2, 2, 1]


@pytest.mark.parametrize("data, said", [(b"\0" * 20, "needs 16$"), (b"\0" * 12, r"needs 16 \(truncated\?\)$")])
def test_a_row_of_more_or_fewer_bytes_than_its_shape_is_refused_saying_which(tmp_path, data, said):
    """A row of too many bytes was called truncated too."""
    import fp8ray
    from fp8ray.engine.archives import compress_archive

    path = write(tmp_path, data=pa.array([data, b"\0" * 6, b"\0" * 8], pa.binary()))
    said = rf"key 'k0' has {len(data)} bytes, its shape \[2, 4\] bfloat16 {said}"
    with pytest.raises(SourceError, match=said):
        compress_archive(path, str(tmp_path / "arch"), pool=fp8ray.PoolSettings(num_workers=1, address="inline"))
