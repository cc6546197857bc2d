"""One block out of an archive (fp8ray.open_archive): the same tensor decompress gives,
reading little more than that block's frames, locally and on S3; a missing block and a
damaged part named in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from _util import moto_s3
from safetensors.torch import load_file, save_file

import fp8ray
from fp8ray.bench.readcount import CountingHandler
from fp8ray.codec.blocks import dtype_name, tensor_to_bytes
from fp8ray.engine.archives import compress_archive, decompress_archive
from fp8ray.engine.pool import PoolSettings
from fp8ray.errors import BadInputError, CorruptArchiveError
from fp8ray.io import archive
from fp8ray.io.paths import resolve
from fp8ray.io.reader import _keys_in_footer

INLINE = {"pool": PoolSettings(num_workers=1, address="inline")}
DATA = Path(__file__).parent / "data"
FILES = ["a.safetensors", "deep/b.safetensors", "deep/c.safetensors"]
BLOCK = (2, 2, 64, 256)  # 64 Ki elements: 128 KiB of bf16, a frame of about 66 KiB


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    """A three-file source (the same keys in each file), its archive (parts of about
    four blocks, each large block a row group of its own) and what decompress gives back."""
    root = tmp_path_factory.mktemp("reader")
    g = torch.Generator().manual_seed(7)
    for i, name in enumerate(FILES):
        (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"layer{j}.kv": torch.randn(BLOCK, generator=g).to(torch.bfloat16) for j in range(8)}
        tensors[f"only{i}"] = torch.randn(3, 50, generator=g).to(torch.float16)
        save_file(tensors, str(root / "src" / name), metadata={"file": str(i)})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(archive, "ROW_GROUP_BYTES", 100_000)  # the row groups a 1 MiB bound gives 1 MiB blocks, scaled down
        compress_archive(str(root / "src"), str(root / "arch"), part_bytes=600_000, lossless="none", **INLINE)
    decompress_archive(str(root / "arch"), str(root / "out"), **INLINE)
    restored = {name: load_file(root / "out" / name) for name in FILES}
    return root / "arch", restored


def test_every_block_read_alone_equals_decompress(multi):
    arch, restored = multi
    reader = fp8ray.open_archive(str(arch))
    assert reader.files() == FILES and len(reader.manifest.parts) > 2
    for name in FILES:
        assert reader.keys(name) == list(restored[name]) and reader.metadata(name) == {"file": str(FILES.index(name))}
        for key, tensor in restored[name].items():
            block = reader.get(key, name)
            assert block.dtype == tensor.dtype and torch.equal(block, tensor), (name, key)
            assert reader.nbytes(key, name) == tensor.nbytes, (name, key)
    assert reader.get("only1").equal(restored["deep/b.safetensors"]["only1"])  # a key in one file needs no file
    assert reader.keys() == [k for name in FILES for k in restored[name]]


def test_a_block_read_as_bytes_is_the_tensors_bytes_and_named_as_get_names_it(multi, tmp_path):
    """``block()``: the same tensor as ``get()``, as its raw bytes, dtype name and shape;
    a damaged frame and a missing key refused in the same words."""
    arch, restored = multi
    reader = fp8ray.open_archive(str(arch))
    for name, key in [("a.safetensors", "layer0.kv"), ("deep/c.safetensors", "layer7.kv"), ("deep/b.safetensors", "only1")]:
        block, tensor = reader.block(key, name), restored[name][key]
        assert (block.key, block.dtype, block.shape) == (key, dtype_name(tensor), tuple(tensor.shape))
        assert block.data.tobytes() == tensor_to_bytes(tensor).tobytes(), (name, key)
    with pytest.raises(BadInputError, match=r"^no block 'layer9.kv' in file 'deep/c.safetensors' of archive"):
        reader.block("layer9.kv", "deep/c.safetensors")
    shutil.copytree(arch, tmp_path / "arch")
    part = tmp_path / "arch" / "part-00000.parquet"
    frame = pq.read_table(part, columns=["frame"]).column("frame")[1].as_py()  # a.safetensors:layer1.kv
    data = bytearray(part.read_bytes())
    data[data.find(frame[1000:1100]) + 50] ^= 0x10
    part.write_bytes(bytes(data))
    damaged = fp8ray.open_archive(str(tmp_path / "arch"))
    with pytest.raises(CorruptArchiveError, match=r"^block 'a.safetensors:layer1.kv' in part part-00000.parquet .* is damaged"):
        damaged.block("layer1.kv", "a.safetensors")


def test_one_block_reads_little_more_than_its_frame(multi):
    """The goal scaled down (row groups of 100 KB where archives have 1 MiB): one block
    reads its part's footer, its part's file and key columns and its own frame."""
    arch, _ = multi
    counting = CountingHandler()
    reader = fp8ray.open_archive(str(arch), filesystem=pafs.PyFileSystem(counting))
    manifest_bytes = counting.read[0]
    reader.get("layer2.kv", "deep/b.safetensors")
    first = counting.read[0] - manifest_bytes
    frame = fp8ray.Fp8Codec(options=reader.manifest.options).encoded_size(BLOCK, torch.bfloat16)
    footer_and_keys = 64 << 10  # pyarrow reads a footer 64 KiB at a time
    assert first <= frame + footer_and_keys + (16 << 10), (first, frame)
    assert first * 8 < reader.manifest.archive_bytes
    before = counting.read[0]  # the part's footer and keys are kept: another block reads its frame
    reader.get("layer3.kv", "deep/b.safetensors")
    assert counting.read[0] - before <= frame * 1.1, (counting.read[0] - before, frame)


def test_archives_written_before_read_by_block():
    """Version 2 parts of 64-row groups, and a version 1 archive (no file column, one file "")."""
    names = ("req0.safetensors", "tenant_b/req1.safetensors")
    sources = {k: v for name in names for k, v in load_file(DATA / "v2_source" / name).items()}
    v2 = fp8ray.open_archive(str(DATA / "v2_archive"))
    assert v2.files() == list(names) and v2.metadata("req0.safetensors") == {"request": "0"}
    assert torch.equal(v2.get("x", "tenant_b/req1.safetensors"), sources["x"])
    v1 = fp8ray.open_archive(str(DATA / "v1_archive"))
    assert v1.files() == [""] and v1.keys() == list(sources)
    assert all(torch.equal(v1.get(key), tensor) for key, tensor in sources.items())


def test_a_missing_block_names_the_key_and_file(multi):
    arch, _ = multi
    reader = fp8ray.open_archive(str(arch))
    with pytest.raises(BadInputError, match=r"^no block 'layer9.kv' in file 'deep/c.safetensors' of archive .*arch$"):
        reader.get("layer9.kv", "deep/c.safetensors")
    with pytest.raises(BadInputError, match=r"holds no file 'deep/d.safetensors'"):
        reader.get("layer0.kv", "deep/d.safetensors")
    with pytest.raises(BadInputError, match=r"^key 'layer0.kv' is in 3 files of archive .*: name the file$"):
        reader.get("layer0.kv")
    with pytest.raises(BadInputError, match=r"^no block 'nope' in any file of archive"):
        reader.get("nope")


def test_blocks_read_from_s3(multi):
    """The same archive on S3 (moto): blocks read alone equal those decompress gave."""
    arch, restored = multi
    with moto_s3("archives") as uri:
        fs, path = resolve(uri("kv.fp8"))
        pafs.copy_files(str(arch), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
        reader = fp8ray.open_archive(uri("kv.fp8"))
        assert reader.files() == FILES
        for name, key in [("a.safetensors", "layer0.kv"), ("deep/c.safetensors", "layer7.kv"), ("deep/b.safetensors", "only1")]:
            assert torch.equal(reader.get(key, name), restored[name][key]), (name, key)
        with pytest.raises(BadInputError, match=r"no block 'nope' in file 'a.safetensors' of archive s3://\*\*\*@archives/"):
            reader.get("nope", "a.safetensors")


def test_a_damaged_part_names_the_block_in_one_line(multi, tmp_path):
    arch, restored = multi
    shutil.copytree(arch, tmp_path / "arch")
    part = tmp_path / "arch" / "part-00000.parquet"
    frame = pq.read_table(part, columns=["frame"]).column("frame")[1].as_py()  # a.safetensors:layer1.kv
    data = bytearray(part.read_bytes())
    at = data.find(frame[1000:1100]) + 50
    data[at] ^= 0x10
    part.write_bytes(bytes(data))
    reader = fp8ray.open_archive(str(tmp_path / "arch"))
    with pytest.raises(CorruptArchiveError) as caught:
        reader.get("layer1.kv", "a.safetensors")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("block 'a.safetensors:layer1.kv' in part part-00000.parquet of "), message
    assert "is damaged" in message
    assert torch.equal(reader.get("layer0.kv", "a.safetensors"), restored["a.safetensors"]["layer0.kv"])  # its neighbours read
    part.unlink()
    with pytest.raises(CorruptArchiveError, match=r"^block 'a.safetensors:layer0.kv': part part-00000.parquet is missing"):
        fp8ray.open_archive(str(tmp_path / "arch")).get("layer0.kv", "a.safetensors")


def test_keys_come_from_the_footer_where_each_row_group_holds_one_block(multi):
    """A part of large blocks (a row group each) gives its keys from its footer's
    statistics, equal to its key column; a part with a row group of several blocks gives
    none (its key column is read)."""
    arch, _ = multi
    seen = set()
    for part in fp8ray.open_archive(str(arch)).manifest.parts:
        parquet = pq.ParquetFile(arch / part.name)
        column = parquet.read(columns=["key"]).column("key").to_pylist()
        one_each = all(parquet.metadata.row_group(g).num_rows == 1 for g in range(parquet.metadata.num_row_groups))
        assert _keys_in_footer(parquet.metadata) == (column if one_each else None), part.name
        seen.add(one_each)
    assert seen == {True, False}  # both ways are exercised by the tests above


def test_a_key_too_long_for_statistics_is_read_from_its_column(tmp_path):
    """Parquet records no statistics for a value over 4 KiB: such a key is found in the
    key column instead."""
    long_key = "k" * 5000
    tensors = {long_key: torch.randn(4, 64).to(torch.bfloat16), "short": torch.randn(4, 64).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "src.safetensors"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(archive, "ROW_GROUP_BYTES", 1)  # a row group per block
        compress_archive(str(tmp_path / "src.safetensors"), str(tmp_path / "arch"), lossless="none", **INLINE)
    reader = fp8ray.open_archive(str(tmp_path / "arch"))
    (part,) = reader.manifest.parts
    assert _keys_in_footer(pq.ParquetFile(tmp_path / "arch" / part.name).metadata) is None
    codec = fp8ray.Fp8Codec(options=reader.manifest.options)
    for key, tensor in tensors.items():
        assert torch.equal(reader.get(key), codec.decode(codec.encode(tensor))), key[:10]
