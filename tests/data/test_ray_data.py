"""fp8ray.data on a real local Ray with Ray Data: Fp8Encoder and Fp8Decoder in
``map_batches``, against the codec bit for bit; and their errors, called directly."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.data as ray_data
import torch
from _util import kv_like

import fp8ray
from fp8ray import CodecOptions, Fp8Codec
from fp8ray.data import RAW_FILE_SCHEMA, RAW_SCHEMA, Fp8Decoder, Fp8Encoder
from fp8ray.errors import BadInputError, CorruptFrameError, InvalidOptionError, MismatchError, NonFiniteError
from fp8ray.io import archive
from fp8ray.io.blocks import list_blocks, read_blocks

REPO = Path(__file__).resolve().parents[2]
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# On 2 CPUs an actor with a whole CPU per actor can leave none for the read tasks:
# half a CPU and one actor per map.
ACTORS = {"num_cpus": 0.5, "compute": ray_data.ActorPoolStrategy(size=1)}
MODE = {"fp8": "e5m2", "scaling": "channel", "scale_dtype": "float32"}


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def raw_table(blocks: dict[str, torch.Tensor]) -> pa.Table:
    return pa.table(
        {
            "key": list(blocks),
            "dtype": [DTYPE_NAMES[t.dtype] for t in blocks.values()],
            "shape": [list(t.shape) for t in blocks.values()],
            "data": [raw(t) for t in blocks.values()],
        }
    )


def sample_blocks() -> dict[str, torch.Tensor]:
    """Blocks of every dtype and of odd sizes (so that in a batch's one buffer most
    blocks start unaligned), a 0-d and an empty one."""
    shapes = [(2, 3, 16, 24), (5, 7), (1, 33), (3, 1, 65), (128,), (4, 9, 3)]
    blocks = {}
    for i, shape in enumerate(shapes * 2):
        dtype = (torch.bfloat16, torch.float16, torch.float32)[i % 3]
        blocks[f"b{i:02d}"] = kv_like(shape, dtype, seed=i)
    blocks["scalar"] = torch.tensor(-3.25, dtype=torch.float16)
    blocks["empty"] = torch.empty(0, 8, dtype=torch.bfloat16)
    return blocks


@pytest.fixture(scope="module")
def raw_source(tmp_path_factory):
    """A raw-block Parquet dataset of two files, small row groups."""
    blocks = sample_blocks()
    table = raw_table(blocks)
    directory = tmp_path_factory.mktemp("raw")
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), directory / "a.parquet", row_group_size=3)
    pq.write_table(table.slice(half), directory / "b.parquet", row_group_size=3)
    return directory, blocks


def by_key(rows: list[dict]) -> dict[str, dict]:
    keyed = {row["key"]: row for row in rows}
    assert len(keyed) == len(rows), "a key came back twice"
    return keyed


def check_frames(rows: dict[str, dict], blocks: dict[str, torch.Tensor], options: CodecOptions) -> None:
    """Each row is its block's frame by Fp8Codec, bit for bit, with the part columns."""
    codec = Fp8Codec(options=options)
    assert set(rows) == set(blocks)
    for key, t in blocks.items():
        row = rows[key]
        frame = bytes(codec.encode(t))
        assert row["frame"] == frame, key
        assert (row["dtype"], list(row["shape"])) == (DTYPE_NAMES[t.dtype], list(t.shape))
        assert (row["fp8"], row["scaling"]) == (options.fp8, options.scaling)
        assert row["block_size"] == (options.block_size if options.scaling == "block" else 0)
        assert (row["raw_bytes"], row["frame_bytes"]) == (t.numel() * t.element_size(), len(frame))


def check_blocks(rows: dict[str, dict], frames: dict[str, bytes]) -> None:
    """Each row is fp8ray.decode of its frame, bit for bit."""
    assert set(rows) == set(frames)
    for key, frame in frames.items():
        expected = fp8ray.decode(frame)
        row = rows[key]
        assert (row["dtype"], list(row["shape"])) == (DTYPE_NAMES[expected.dtype], list(expected.shape)), key
        assert row["data"] == raw(expected), key


# --- through Ray Data ----------------------------------------------------------------


@pytest.mark.slow  # a pipeline of two actor pools, each starting a process
def test_encoder_and_decoder_take_pandas_and_numpy_batches(ray_session, raw_source):
    directory, blocks = raw_source
    ds = ray_data.read_parquet(str(directory))
    encoded = ds.map_batches(Fp8Encoder, fn_constructor_kwargs=MODE, batch_format="pandas", batch_size=5, **ACTORS)
    decoded = encoded.map_batches(Fp8Decoder, batch_format="numpy", batch_size=3, **ACTORS)
    codec = Fp8Codec(**MODE)
    check_blocks(by_key(decoded.take_all()), {key: bytes(codec.encode(t)) for key, t in blocks.items()})


@pytest.mark.slow  # compress_archive's workers, then a pipeline
def test_decoder_reads_an_archive_written_by_compress_archive(ray_session, kv_source, tmp_path):
    src, tensors = kv_source
    arch = tmp_path / "arch"
    fp8ray.compress_archive(str(src), str(arch), part_bytes=200_000, pool=fp8ray.PoolSettings(num_workers=1))
    assert (arch / "_manifest.json").exists() and len(list(arch.glob("part-*.parquet"))) > 1
    ds = ray_data.read_parquet(str(arch)).map_batches(Fp8Decoder, batch_format="pyarrow", batch_size=5, **ACTORS)
    rows = by_key(ds.take_all())
    table = pq.read_table(arch, columns=["key", "frame"])  # the archive's own frames
    frames = dict(zip(table.column("key").to_pylist(), table.column("frame").to_pylist()))
    assert set(frames) == set(tensors)
    check_blocks(rows, frames)


@pytest.mark.slow  # two pipelines
def test_encode_a_parquet_dataset_write_it_and_decode_it_back(ray_session, raw_source, tmp_path):
    directory, blocks = raw_source
    ray_data.read_parquet(str(directory)).map_batches(
        Fp8Encoder, fn_constructor_kwargs=MODE, batch_format="pyarrow", batch_size=4, **ACTORS
    ).write_parquet(str(tmp_path / "frames"))
    written = pq.read_table(tmp_path / "frames")
    assert written.schema.field("frame").type == pa.large_binary()
    check_frames(by_key(written.to_pylist()), blocks, CodecOptions(**MODE))

    ray_data.read_parquet(str(tmp_path / "frames")).map_batches(
        Fp8Decoder, batch_format="pyarrow", batch_size=4, **ACTORS
    ).write_parquet(str(tmp_path / "restored"))
    restored = pq.read_table(tmp_path / "restored")
    assert restored.schema.equals(RAW_SCHEMA, check_metadata=False)
    frames = dict(zip(written.column("key").to_pylist(), written.column("frame").to_pylist()))
    check_blocks(by_key(restored.to_pylist()), frames)
    # What the decoder writes is a raw-block Parquet source fp8ray itself reads.
    refs = list_blocks(str(tmp_path / "restored"))
    assert {r.key: data.tobytes() for r, data in zip(refs, read_blocks(refs))} == {
        key: raw(fp8ray.decode(frame)) for key, frame in frames.items()
    }


def damaged_dataset() -> ray_data.Dataset:
    frames = {f"k{i}": bytearray(Fp8Codec().encode(kv_like((8, 32), seed=i))) for i in range(4)}
    frames["k2"][40] ^= 0x01  # a code byte: only the checksum can tell
    table = pa.table({"key": list(frames), "frame": pa.array([bytes(f) for f in frames.values()], pa.large_binary())})
    return ray_data.from_arrow(table).map_batches(Fp8Decoder, batch_format="pyarrow", **ACTORS)


def test_corrupt_frame_in_a_pipeline_names_its_key(ray_session):
    # Ray Data wraps a UDF's exception; fp8ray's class and message are in its text.
    with pytest.raises(Exception, match=r"CorruptFrameError: block 'k2': frame checksum mismatch"):
        damaged_dataset().take_all()


def test_raise_original_map_exception_gives_fp8rays_class(ray_session):
    context = ray_data.DataContext.get_current()
    before = context.raise_original_map_exception
    context.raise_original_map_exception = True
    try:
        with pytest.raises(CorruptFrameError, match=r"block 'k2': frame checksum mismatch"):
            damaged_dataset().take_all()
    finally:
        context.raise_original_map_exception = before


@pytest.mark.slow  # two pipelines and compress_archive
def test_docs_example_runs(ray_session, tmp_path, monkeypatch, capsys):
    text = (REPO / "docs/RAY_DATA.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its mkdtemp lands in tmp_path
    exec(compile(example, "docs/RAY_DATA.md", "exec"), {"__name__": "__main__"})
    (work,) = tmp_path.glob("fp8ray-ray-data-*")
    assert capsys.readouterr().out.strip() == f"8 blocks back, bit for bit, in {work}"
    assert (work / "kv.fp8/_manifest.json").exists() and list((work / "kv_frames").glob("*.parquet"))


# --- called directly: batches, columns and errors ------------------------------------


def test_direct_call_matches_the_codec_on_chunked_sliced_and_binary_columns():
    blocks = sample_blocks()
    table = raw_table(blocks)
    # Several chunks, one starting at an offset into its buffers, and 32-bit offsets.
    chunked = pa.concat_tables([table.slice(0, 5), table.slice(5, 4), table.slice(9)])
    assert chunked.column("data").num_chunks == 3 and chunked.column("data").type == pa.binary()
    out = Fp8Encoder(**MODE)(chunked)
    assert out.schema.equals(archive.SCHEMA)
    check_frames(by_key(out.to_pylist()), blocks, CodecOptions(**MODE))
    assert Fp8Encoder(**MODE)(table.combine_chunks()).equals(out)

    frames = dict(zip(out.column("key").to_pylist(), out.column("frame").to_pylist()))
    decoded = Fp8Decoder()(out)  # sized from the dtype and shape columns
    assert decoded.schema.equals(RAW_SCHEMA)
    check_blocks(by_key(decoded.to_pylist()), frames)
    only_frames = pa.table({"key": out.column("key"), "frame": out.column("frame").cast(pa.binary())})
    assert Fp8Decoder()(only_frames.slice(3)).equals(decoded.slice(3))  # sized from the frames' headers


def test_the_encoder_takes_integer_keys_and_fixed_size_data_as_compress_does():
    """A raw-block Parquet source may hold integer keys and fixed_size_binary data
    (fp8ray compress takes both): the encoder refused them, against RAY_DATA.md's "the
    layout fp8ray compress reads from Parquet"."""
    x = [torch.randn(2, 4).bfloat16() for _ in range(3)]
    data = [t.view(torch.uint8).numpy().tobytes() for t in x]
    table = pa.table(
        {
            "key": pa.array([7, 8, 9], pa.int64()),
            "dtype": ["bfloat16"] * 3,
            "shape": [[2, 4]] * 3,
            "data": pa.array(data, pa.binary(16)),
        }
    )
    out = Fp8Encoder(**MODE)(table)
    assert out.column("key").to_pylist() == ["7", "8", "9"]
    codec = Fp8Codec(**MODE)
    assert out.column("frame").to_pylist() == [bytes(codec.encode(t)) for t in x]


def test_rows_of_dtypes_fp8_does_not_encode_go_through_in_stored_frames():
    """Positions and masks beside the cache (consecutive small ones of one shape among
    them, which encode and decode one at a time, not as a run): each row's frame is the
    codec's, marked stored, and decodes to the row's own bytes."""
    blocks = {f"pos{i}": torch.arange(64) * (i + 1) for i in range(5)}
    blocks |= {"mask": torch.tensor([[True, False]] * 3), "rope": torch.rand(7).double(), "k": kv_like((4, 32), seed=1)}
    table = pa.table(
        {
            "key": list(blocks),
            "dtype": [str(t.dtype).removeprefix("torch.") for t in blocks.values()],
            "shape": [list(t.shape) for t in blocks.values()],
            "data": [raw(t) for t in blocks.values()],
        }
    )
    out = Fp8Encoder()(table)
    assert out.column("frame").to_pylist() == [bytes(Fp8Codec().encode(t)) for t in blocks.values()]
    assert out.column("fp8").to_pylist() == ["stored"] * 7 + ["e4m3fn"]
    back = Fp8Decoder()(out)
    assert back.column("data").to_pylist()[:7] == table.column("data").to_pylist()[:7]
    assert back.column("dtype").to_pylist() == table.column("dtype").to_pylist()


def test_the_file_column_goes_through_both_ways():
    """Blocks that name their source file keep it through encode and decode, so a
    pipeline can group them by file; keys may repeat across files, as in a directory."""
    blocks = sample_blocks()
    table = raw_table(blocks)
    names = [f"req-{row % 3}.safetensors" for row in range(table.num_rows)]
    with_files = table.add_column(0, "file", pa.array(names))
    out = Fp8Encoder(**MODE)(with_files)
    assert out.column("file").to_pylist() == names
    assert out.drop_columns(["file"]).equals(Fp8Encoder(**MODE)(table).drop_columns(["file"]))
    back = Fp8Decoder(with_file=True)(out)
    assert back.schema.equals(RAW_FILE_SCHEMA) and back.column("file").to_pylist() == names
    assert back.drop_columns(["file"]).equals(Fp8Decoder()(out))  # without it, the raw-block layout
    with pytest.raises(BadInputError, match=r"lacks \['file'\]"):
        Fp8Decoder(with_file=True)(out.drop_columns(["file"]))
    with pytest.raises(BadInputError, match=r"column 'file': row 0 holds 7") as info:
        Fp8Encoder()(table.add_column(0, "file", pa.array([7] * table.num_rows)))
    assert info.value.field == "file"


def test_empty_batch():
    empty = raw_table({}).cast(
        pa.schema([("key", pa.string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("data", pa.binary())])
    )
    out = Fp8Encoder()(empty)
    assert out.num_rows == 0 and out.schema.equals(archive.SCHEMA)
    back = Fp8Decoder()(out)
    assert back.num_rows == 0 and back.schema.equals(RAW_SCHEMA)


def test_options_and_constructor_arguments():
    assert Fp8Encoder(options=CodecOptions(scaling="token"), scale_dtype="float32").options == CodecOptions(
        scaling="token", scale_dtype="float32"
    )
    assert Fp8Encoder().options == CodecOptions()
    check_frames(by_key(Fp8Encoder()(raw_table(sample_blocks())).to_pylist()), sample_blocks(), CodecOptions())
    with pytest.raises(InvalidOptionError, match="scaling") as info:
        Fp8Encoder(scaling="row")
    assert info.value.field == "scaling"
    with pytest.raises(InvalidOptionError, match="device"):
        Fp8Decoder(device="tpu")
    with pytest.raises(InvalidOptionError, match="threads"):
        Fp8Encoder(threads=0)
    assert Fp8Encoder(threads=np.int64(2)).threads == 2  # as Fp8Codec.encode takes it
    with pytest.raises(InvalidOptionError, match=r"with_file must be True or False, got 'no'"):
        Fp8Decoder(with_file="no")  # a non-empty string would have been true
    if not torch.cuda.is_available():
        with pytest.raises(InvalidOptionError, match="no CUDA device"):
            Fp8Encoder(device="cuda")


def bad(table: pa.Table, column: str, row: int, value) -> pa.Table:
    values = table.column(column).to_pylist()
    values[row] = value
    return table.set_column(table.schema.get_field_index(column), column, pa.array(values, table.schema.field(column).type))


@pytest.mark.parametrize(
    "change, error, message, field",
    [
        (
            lambda t: t.drop_columns(["data"]),
            BadInputError,
            r"needs columns \['key', 'dtype', 'shape', 'data'\]; the batch lacks \['data'\]",
            "data",
        ),
        (lambda t: bad(t, "dtype", 1, "complex128"), BadInputError, r"block 'b01': column 'dtype' holds 'complex128'", "b01"),
        (lambda t: bad(t, "dtype", 1, None), BadInputError, r"block 'b01': column 'dtype' holds None", "b01"),
        (
            lambda t: bad(t, "shape", 2, [1, 34]),
            BadInputError,
            r"block 'b02': column 'data' holds 132 bytes, its shape \[1, 34\] float32 needs 136",
            "b02",
        ),
        (lambda t: bad(t, "shape", 2, [-1, 33]), BadInputError, r"block 'b02': column 'shape' holds \[-1, 33\]", "b02"),
        (lambda t: bad(t, "shape", 2, None), BadInputError, r"block 'b02': column 'shape' holds None", "b02"),
        (
            lambda t: bad(t, "data", 3, b"\0" * 7),
            BadInputError,
            r"block 'b03': column 'data' holds 7 bytes, its shape \[3, 1, 65\] bfloat16 needs 390",
            "b03",
        ),
        (lambda t: bad(t, "data", 3, None), BadInputError, r"block 'b03': column 'data' is null", "b03"),
        (lambda t: bad(t, "key", 0, None), BadInputError, r"column 'key': row 0 holds None", "key"),
        (
            lambda t: t.set_column(3, "data", pa.array(["x"] * t.num_rows)),
            BadInputError,
            r"column 'data' must be binary, large_binary or fixed_size_binary, not string",
            "data",
        ),
    ],
    ids=[
        "missing-column",
        "unknown-dtype",
        "null-dtype",
        "shape-vs-data",
        "negative-dim",
        "null-shape",
        "short-data",
        "null-data",
        "null-key",
        "data-not-binary",
    ],
)
def test_encoder_refuses_bad_rows_naming_column_or_key(change, error, message, field):
    with pytest.raises(error, match=message) as info:
        Fp8Encoder()(change(raw_table(sample_blocks())))
    assert info.value.field == field


def test_encoder_refuses_non_finite_values_naming_the_key():
    blocks = {"fine": torch.ones(4, 8), "nan": torch.tensor([[1.0, float("nan")], [2.0, 3.0]])}
    with pytest.raises(NonFiniteError, match=r"block 'nan': 1 non-finite value"):
        Fp8Encoder()(raw_table(blocks))
    kept = Fp8Encoder(nonfinite="keep")(raw_table(blocks))
    assert kept.column("frame")[1].as_py() == bytes(Fp8Codec(nonfinite="keep").encode(blocks["nan"]))


def test_encoder_rejects_what_is_not_a_batch():
    with pytest.raises(TypeError, match="pyarrow.Table, a pandas DataFrame or a dict"):
        Fp8Encoder()([{"key": "a"}])


@pytest.fixture(scope="module")
def encoded() -> pa.Table:
    return Fp8Encoder(scaling="block", block_size=16)(raw_table(sample_blocks()))


@pytest.mark.parametrize("columns", [archive.SCHEMA.names, ["key", "frame"]], ids=["all-columns", "key-and-frame"])
def test_every_flipped_byte_of_a_frame_raises_corrupt_frame_error_naming_its_key(encoded, columns):
    frame = bytearray(encoded.column("frame")[4].as_py())
    decoder = Fp8Decoder()
    for at in range(len(frame)):
        damaged = bytearray(frame)
        damaged[at] ^= 0x20
        table = bad(encoded, "frame", 4, bytes(damaged)).select(columns)
        with pytest.raises(CorruptFrameError, match=r"^block 'b04': "):
            decoder(table)


@pytest.mark.parametrize("columns", [archive.SCHEMA.names, ["key", "frame"]], ids=["all-columns", "key-and-frame"])
def test_truncated_frame_raises_corrupt_frame_error(encoded, columns):
    frame = encoded.column("frame")[1].as_py()
    for size in (0, 10, len(frame) - 1):
        with pytest.raises(CorruptFrameError, match=r"^block 'b01': frame truncated"):
            Fp8Decoder()(bad(encoded, "frame", 1, frame[:size]).select(columns))


@pytest.mark.parametrize(
    "column, value, message",
    [
        (
            "dtype",
            "float16",
            r"block 'b00': columns 'dtype' and 'shape' say \[2, 3, 16, 24\] float16, its frame holds \[2, 3, 16, 24\] bfloat16",
        ),
        (
            "shape",
            [3, 2, 16, 24],
            r"block 'b00': columns 'dtype' and 'shape' say \[3, 2, 16, 24\] bfloat16, its frame holds \[2, 3, 16, 24\] bfloat16",
        ),
        (
            "shape",
            [2**40, 2**20],
            r"block 'b00': columns 'dtype' and 'shape' say \[1099511627776, 1048576\] bfloat16, "
            r"more elements than its \d+-byte frame",
        ),
    ],
    ids=["dtype", "shape", "huge-shape"],
)
def test_frame_contradicting_its_row_raises_mismatch_error(encoded, column, value, message):
    with pytest.raises(MismatchError, match=message) as info:
        Fp8Decoder()(bad(encoded, column, 0, value))
    assert info.value.field == "b00"


def test_decoder_refuses_missing_columns_and_null_frames(encoded):
    with pytest.raises(BadInputError, match=r"Fp8Decoder needs columns \['key', 'frame'\]; the batch lacks \['frame'\]"):
        Fp8Decoder()(encoded.drop_columns(["frame"]))
    with pytest.raises(BadInputError, match=r"block 'b05': column 'frame' is null"):
        Fp8Decoder()(bad(encoded, "frame", 5, None))


def test_numpy_and_pandas_batches_directly():
    blocks = sample_blocks()
    table = raw_table(blocks)
    expected = Fp8Encoder()(table)
    as_numpy = {name: np.array(table.column(name).to_pylist() + [None], dtype=object)[:-1] for name in table.column_names}
    assert Fp8Encoder()(as_numpy).equals(expected)
    assert Fp8Encoder()(table.to_pandas()).equals(expected)
    with pytest.raises(BadInputError, match="the batch lacks"):
        Fp8Encoder()({"key": np.array(["a"], dtype=object)})


def test_an_empty_pandas_or_numpy_batch_gives_an_empty_table():
    """An empty pandas or numpy batch's columns convert to Arrow's null type: still no rows,
    not a refusal (an empty Arrow batch already gave an empty table)."""
    import pandas as pd

    empty_numpy = {name: np.array([], dtype=object) for name in ("key", "dtype", "shape", "data")}
    for batch in (pd.DataFrame({name: [] for name in ("key", "dtype", "shape", "data")}), empty_numpy):
        frames = Fp8Encoder()(batch)
        assert frames.num_rows == 0 and frames.schema.field("frame").type == pa.large_binary()
        assert Fp8Decoder()(frames).num_rows == 0
