"""One block out of an archive (fp8ray.open_archive): the same tensor decompress gives,
reading little more than that block's frames, locally and on S3; a missing block and a
damaged part named in one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from _util import moto_s3, record_entry, rewrite_column
from safetensors.torch import load_file, save_file

import fp8ray
from fp8ray.bench.readcount import CountingHandler
from fp8ray.codec.blocks import dtype_name, tensor_to_bytes
from fp8ray.engine.archives import compress_archive, decompress_archive
from fp8ray.engine.pool import PoolSettings
from fp8ray.errors import BadInputError, CorruptArchiveError, InvalidOptionError
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


def test_an_archive_opened_by_pathlib_path_reads_as_by_its_string(multi):
    arch, restored = multi
    reader = fp8ray.open_archive(arch)  # a pathlib.Path
    assert reader.files() == FILES
    assert torch.equal(reader.get("layer3.kv", FILES[1]), restored[FILES[1]]["layer3.kv"])
    with pytest.raises(TypeError, match=r"^an archive's path must be a path or URI \(a str or os.PathLike\), got int$"):
        fp8ray.open_archive(3)


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
    with pytest.raises(BadInputError, match=r"^no block 'nope' of archive "):  # not "in file ''"
        v1.get("nope", "")


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
    for call in (reader.get, reader.file_of):  # file_of(3) said "no block 3 in any file"
        with pytest.raises(BadInputError, match=r"^key must be a string, got int 5$"):
            call(5)
    with pytest.raises(TypeError, match=r"^filesystem must be a pyarrow.fs.FileSystem or None, got str$"):
        fp8ray.open_archive(str(arch), filesystem="local")  # an AttributeError ('get_file_info') before
    with pytest.raises(BadInputError) as caught:  # escaped once, by repr (printable() then repr escaped twice)
        reader.get("no\x1b[31mpe")
    assert str(caught.value).startswith("no block 'no\\x1b[31mpe' in any file")
    with pytest.raises(BadInputError, match=r"^file must be a string, got int 3$"):
        reader.block("layer0.kv", 3)
    for call in (reader.metadata, reader.keys):  # an AttributeError from printable(None) before
        with pytest.raises(BadInputError, match=r"^file must be a string, got (NoneType None|int 3)$"):
            call(None if call is reader.metadata else 3)


def test_an_empty_path_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch):
    """'' resolved to the working directory, and every message named it '' ("  has no
    _manifest.json")."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInputError, match=r"^a path is empty: name a file or directory \('\.' for the working directory\)$"):
        fp8ray.open_archive("")
    with pytest.raises(BadInputError, match=r"^the source is an empty path: name the file or directory to read$"):
        compress_archive("", str(tmp_path / "a"), **INLINE)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_a_device_this_torch_lacks_is_named_as_the_device_not_as_damage(multi):
    arch, _ = multi
    with pytest.raises(InvalidOptionError, match=r"^device 'cuda' was asked for, but torch sees no CUDA device$"):
        fp8ray.open_archive(str(arch)).get("layer0.kv", "deep/c.safetensors", device="cuda")


@pytest.mark.parametrize("argv", [None, ["get", "ARCH", "layer0.kv", "--file", "deep/c.safetensors", "-o", "-"]])
def test_a_bad_thread_count_in_the_environment_is_named_as_it_not_as_damage(multi, monkeypatch, capsys, argv):
    """FP8RAY_NUM_THREADS=abc read as damage: "block ... of ARCH is damaged: FP8RAY_NUM_THREADS
    must be ..." (get, verify --against, fidelity), and a user may delete a good archive."""
    from fp8ray.cli import main

    arch, _ = multi
    monkeypatch.setenv("FP8RAY_NUM_THREADS", "abc")
    said = "FP8RAY_NUM_THREADS must be a whole number of at least 1, got 'abc'"
    if argv is None:
        with pytest.raises(InvalidOptionError, match=f"^{said}$"):
            fp8ray.open_archive(str(arch)).block("layer0.kv", "deep/c.safetensors")
    else:
        assert main([str(arch) if a == "ARCH" else a for a in argv]) == 1
        assert capsys.readouterr().err == f"fp8ray: error: {said}\n"


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


# --- damage the part's own CRC does not reach on a read of one block ----------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """An archive of small blocks (parts of several rows in one row group: the key column
    is read) and each block's dtype, shape and bytes."""
    root = tmp_path_factory.mktemp("small")
    g = torch.Generator().manual_seed(5)
    tensors = {
        "bf": torch.randn(4, 64, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(3, 5, 7, generator=g).to(torch.float16),
        "fp32": torch.randn(33, generator=g),
        "zeros": torch.zeros(2, 40, dtype=torch.bfloat16),
        "row": torch.randn(1, 40, generator=g).to(torch.bfloat16),
        "col": torch.randn(40, 2, generator=g).to(torch.bfloat16),
    }
    save_file(tensors, str(root / "src.safetensors"))
    compress_archive(str(root / "src.safetensors"), str(root / "arch"), part_bytes=1400, lossless="none", **INLINE)
    reader = fp8ray.open_archive(str(root / "arch"))
    good = {key: _block(reader, key) for key in tensors}
    return root / "arch", good


def _block(reader, key):
    block = reader.block(key)
    return block.dtype, tuple(block.shape), block.data.tobytes()


def _widest(arch: Path) -> archive.Part:
    return max(fp8ray.open_archive(str(arch)).manifest.parts, key=lambda p: p.blocks)


def _as_written_before(arch: Path) -> None:
    """Drop the part entries' footer and column CRCs: an archive as written before them."""
    path = arch / archive.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    for entry in manifest["parts"]:
        del entry["footer_crc32c"], entry["columns_crc32c"]
    path.write_text(json.dumps(manifest))


SWEEP = """
import json, sys
import fp8ray
arch, name, positions = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
def read(reader, key):
    block = reader.block(key)
    return block.dtype, tuple(block.shape), block.data.tobytes()
reader = fp8ray.open_archive(arch)
good = {key: read(reader, key) for key in reader.keys()}
path = f"{arch}/{name}"
original = open(path, "rb").read()
for at in positions:
    damaged = bytearray(original)
    damaged[at] ^= 0x5A
    open(path, "wb").write(damaged)
    seen = []
    for key in good:
        try:
            seen.append("same" if read(fp8ray.open_archive(arch), key) == good[key] else f"WRONG {key}")
        except fp8ray.errors.CorruptArchiveError:
            seen.append("refused")
        except BaseException as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    print(json.dumps([at, seen]), flush=True)
open(path, "wb").write(original)
"""


def _sweep(arch: Path, part: archive.Part, positions: list[int]) -> dict:
    """Each byte of ``positions`` of ``part`` flipped in turn and every block read back,
    in a child process (where pyarrow aborts, the child dies, not the tests): how each
    read ended, with the positions that ended so."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    child = subprocess.run(
        [sys.executable, "-c", SWEEP, str(arch), part.name, json.dumps(positions)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [json.loads(line) for line in child.stdout.splitlines()]
    done = len(lines)
    assert child.returncode == 0, f"aborted at byte {positions[done] if done < len(positions) else '?'}: {child.stderr[-2000:]}"
    outcomes: dict = {}
    for at, seen in lines:
        for outcome in seen:
            outcomes.setdefault(outcome, []).append(at)
    return outcomes


def _footer_and_key_bytes(path: Path) -> list[int]:
    """The byte offsets of a part's ``key`` column chunks and of its footer."""
    metadata = pq.ParquetFile(path).metadata
    size = path.stat().st_size
    footer = int.from_bytes(path.read_bytes()[-8:-4], "little")
    at = list(range(size - footer - 8, size))
    key = metadata.schema.names.index("key")
    for g in range(metadata.num_row_groups):
        chunk = metadata.row_group(g).column(key)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        at += range(start, start + chunk.total_compressed_size)
    return at


def test_no_flipped_byte_of_a_parts_footer_or_keys_gives_another_block_or_aborts(small, tmp_path):
    """Every byte of the key column and of the footer of a part of several blocks,
    flipped: each block reads as written or is refused as damaged."""
    arch, good = small
    shutil.copytree(arch, tmp_path / "arch")
    part = _widest(arch)
    assert part.blocks >= 3 and part.footer_crc32c is not None and part.columns_crc32c is not None
    positions = _footer_and_key_bytes(arch / part.name)
    outcomes = _sweep(tmp_path / "arch", part, positions)
    assert set(outcomes) <= {"same", "refused"}, {k: v[:5] for k, v in outcomes.items()}
    assert len(set(outcomes["refused"])) > 0.9 * len(positions)  # nearly every flip is seen (a few bytes change nothing read)


def test_a_damaged_footer_or_key_column_is_refused_naming_the_part(small, tmp_path):
    arch, good = small
    shutil.copytree(arch, tmp_path / "arch")
    part = _widest(arch)
    path = tmp_path / "arch" / part.name
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x5A  # in the footer
    path.write_bytes(data)
    reader = fp8ray.open_archive(str(tmp_path / "arch"))
    key = next(iter(good))
    for read in (reader.get, reader.block, lambda k: reader.keys()):
        with pytest.raises(CorruptArchiveError) as caught:
            read(key)
        assert re.search(
            rf"part {part.name} of .*arch is damaged: its Parquet footer has crc32c 0x\w+, its entry records", str(caught.value)
        )
        assert "\n" not in str(caught.value)


def test_keys_changed_with_a_matching_footer_are_refused(small, tmp_path):
    """A part whose keys were swapped but whose size, CRC and footer CRC were made to
    match: its columns' CRC refuses it."""
    arch, good = small
    shutil.copytree(arch, tmp_path / "arch")
    part = _widest(arch)
    path = tmp_path / "arch" / part.name
    keys = pq.read_table(path, columns=["key"]).column("key").to_pylist()
    entry = rewrite_column(path, "key", [keys[0], keys[2], keys[1], *keys[3:]])
    record_entry(tmp_path / "arch", entry, "crc32c", "file_bytes", "footer_crc32c")
    with pytest.raises(
        CorruptArchiveError, match=rf"^block '{keys[1]}': part {part.name} of .* is damaged: its metadata columns have crc32c"
    ):
        fp8ray.open_archive(str(tmp_path / "arch")).get(keys[1])


def test_a_frame_in_another_blocks_row_is_refused_by_its_header(small, tmp_path):
    """Two frames swapped (the part's CRCs made to match, or an older archive without
    them): the frame's header says another shape than its row."""
    arch, good = small
    part = _widest(arch)
    keys = pq.read_table(arch / part.name, columns=["key"]).column("key").to_pylist()
    frames = pq.read_table(arch / part.name, columns=["frame"]).column("frame").to_pylist()
    for name in ("new", "before"):
        shutil.copytree(arch, tmp_path / name)
        entry = rewrite_column(tmp_path / name / part.name, "frame", [frames[0], frames[2], frames[1], *frames[3:]])
        record_entry(tmp_path / name, entry, "crc32c", "file_bytes", "footer_crc32c", "columns_crc32c")
        if name == "before":
            _as_written_before(tmp_path / name)
        reader = fp8ray.open_archive(str(tmp_path / name))
        assert _block(reader, keys[0]) == good[keys[0]]
        for read in (reader.get, reader.block):
            with pytest.raises(
                CorruptArchiveError,
                match=rf"^block '{keys[1]}' in part {part.name} of .* is damaged: its row says \w+ \[.*\], its frame",
            ):
                read(keys[1])


def test_an_older_archive_repeating_a_key_or_other_first_key_is_refused(small, tmp_path):
    arch, good = small
    part = _widest(arch)
    keys = pq.read_table(arch / part.name, columns=["key"]).column("key").to_pylist()
    for name, changed, message in [
        ("twice", [keys[0], keys[1], keys[1], *keys[3:]], f"it holds block '{keys[1]}' twice"),
        ("first", ["other", *keys[1:]], f"its keys run from 'other' to '{keys[-1]}', its entry records '{keys[0]}'"),
    ]:
        shutil.copytree(arch, tmp_path / name)
        record_entry(tmp_path / name, rewrite_column(tmp_path / name / part.name, "key", changed), "crc32c", "file_bytes")
        _as_written_before(tmp_path / name)
        reader = fp8ray.open_archive(str(tmp_path / name))
        with pytest.raises(CorruptArchiveError, match=f"part {part.name} of .* is damaged: {re.escape(message)}"):
            reader.keys()
    reader = fp8ray.open_archive(str(tmp_path / "first"))
    assert all(reader.block(k) is not None for k in good if k not in keys)  # the other parts read
    shutil.copytree(arch, tmp_path / "before")
    _as_written_before(tmp_path / "before")
    reader = fp8ray.open_archive(str(tmp_path / "before"))
    assert {key: _block(reader, key) for key in good} == good


def test_a_scale_too_large_for_its_codes_fails_verify_and_every_read(small, tmp_path):
    """A frame whose scale was made too large for its codes, its own CRC and the part's
    made to match: verify (without a source to compare with) names the block, and get and
    decompress refuse it (naming its source file too: a key may be in several) rather
    than hand back infinities the source never held."""
    import struct

    import crc32c

    from fp8ray.codec import frame
    from fp8ray.engine.archives import verify_archive
    from fp8ray.errors import CorruptFrameError

    arch, good = small
    shutil.copytree(arch, tmp_path / "arch")
    part = _widest(arch)
    path = tmp_path / "arch" / part.name
    table = pq.read_table(path, columns=["key", "frame"])
    keys, frames = table.column("key").to_pylist(), table.column("frame").to_pylist()
    row = next(i for i, key in enumerate(keys) if key != "zeros")  # zeros decode to zero under any scale
    crafted = bytearray(frames[row])
    header = frame.parse(np.frombuffer(bytes(crafted), np.uint8))
    width = 4 if header.scale_dtype == "float32" else 2
    crafted[header.scales_offset : header.scales_offset + width] = struct.pack("<f", 3e38)[4 - width :]
    crafted[-4:] = struct.pack("<I", crc32c.crc32c(bytes(crafted[:-4])))
    frames[row] = bytes(crafted)
    entry = rewrite_column(path, "frame", frames)
    record_entry(tmp_path / "arch", entry, "crc32c", "file_bytes", "footer_crc32c", "columns_crc32c", "frames_crc32c")
    said = f"finite code\\(s\\) decode to inf in {good[keys[row]][0]}"
    report = verify_archive(str(tmp_path / "arch"), **INLINE)
    assert len(report.errors) == 1 and re.search(f"^block '{keys[row]}' in {part.name}: .*{said}", report.errors[0]), (
        report.errors
    )
    with pytest.raises(CorruptArchiveError, match=f"block '{keys[row]}' in part {part.name} of .* is damaged: .*{said}"):
        fp8ray.open_archive(str(tmp_path / "arch")).get(keys[row])
    with pytest.raises(CorruptFrameError, match=f"block '{keys[row]}' of src.safetensors in {part.name}: .*{said}"):
        decompress_archive(str(tmp_path / "arch"), str(tmp_path / "out.safetensors"), **INLINE)
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("part_bytes", [None, 1024], ids=["one-part", "a-part-a-block"])
def test_decompress_names_the_source_file_of_a_damaged_block(tmp_path, part_bytes):
    """Two files holding the same keys: a frame of one fails its checksum (the part's CRCs
    made to match), and decompress names which file's block it is, not the key alone,
    whether each file is written whole or, spanning several parts, in ranges."""
    from fp8ray.errors import CorruptFrameError

    src = tmp_path / "kv"
    src.mkdir()
    g = torch.Generator().manual_seed(9)
    for name in ("a", "b"):
        tensors = {f"layer{i}.k": torch.randn(4, 64, generator=g).to(torch.bfloat16) for i in range(3)}
        save_file(tensors, str(src / f"{name}.safetensors"))
    options = {} if part_bytes is None else {"part_bytes": part_bytes}
    compress_archive(str(src), str(tmp_path / "arch"), lossless="none", **options, **INLINE)
    parts = fp8ray.open_archive(str(tmp_path / "arch")).manifest.parts
    assert (len(parts) > 1) == (part_bytes is not None)  # small parts: each file spans several
    part = next(
        p for p in parts if "b.safetensors" in pq.read_table(tmp_path / "arch" / p.name, columns=["file"]).column(0).to_pylist()
    )
    path = tmp_path / "arch" / part.name
    table = pq.read_table(path, columns=["file", "key", "frame"])
    row = table.column("file").to_pylist().index("b.safetensors")
    key = table.column("key")[row].as_py()
    frames = table.column("frame").to_pylist()
    damaged = bytearray(frames[row])
    damaged[-10] ^= 0x01  # a code: the frame's own CRC no longer holds
    frames[row] = bytes(damaged)
    record_entry(
        tmp_path / "arch", rewrite_column(path, "frame", frames), "crc32c", "file_bytes", "footer_crc32c", "frames_crc32c"
    )
    with pytest.raises(CorruptFrameError, match=f"^block '{key}' of b.safetensors in {part.name}: .*checksum"):
        decompress_archive(str(tmp_path / "arch"), str(tmp_path / "out"), **INLINE)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("lossless, rows", [("zstd:3", 96), ("none", 96), ("none", 64)])
def test_a_reader_of_an_archive_replaced_since_says_so_not_that_it_is_damaged(tmp_path, lossless, rows):
    """A reader keeps the manifest and the footers it read; after compress --overwrite
    replaced the archive, a good archive's parts were reported damaged ("not readable as
    Parquet", "8548 bytes, its entry records 8279"); one whose parts had the same row
    groups (same shapes, no lossless stage) was read as if it were the old one."""
    g = torch.Generator().manual_seed(1)
    src, arch = tmp_path / "kv.safetensors", tmp_path / "arch"
    save_file({f"k{i}": torch.randn(64, 64, generator=g).bfloat16() for i in range(4)}, str(src))
    compress_archive(str(src), str(arch), lossless=lossless, part_bytes=16_000, **INLINE)
    reader = fp8ray.open_archive(str(arch))
    reader.get("k0")  # its first part's footer kept
    save_file({f"k{i}": torch.randn(rows, 64, generator=g).bfloat16() for i in range(4)}, str(src))
    compress_archive(str(src), str(arch), lossless=lossless, part_bytes=16_000, overwrite=True, **INLINE)
    for key in ("k0", "k3"):
        with pytest.raises(CorruptArchiveError, match=r"changed since it was opened \(its manifest was replaced\): open it"):
            reader.get(key)
    assert fp8ray.open_archive(str(arch)).get("k3").shape == (rows, 64)


def test_close_drops_what_the_reader_kept_and_it_reads_again(multi):
    arch, _ = multi
    reader = fp8ray.open_archive(str(arch))
    first = reader.get("layer0.kv", "deep/c.safetensors")
    assert reader._parts  # the footer and keys of the part looked into
    reader.close()
    assert not reader._parts
    assert torch.equal(reader.get("layer0.kv", "deep/c.safetensors"), first)
