"""The archive format without Ray: the plan, frame columns, parts and sidecars, the
manifest, and scratch names."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from fp8ray import CodecOptions, Fp8Codec, decode
from fp8ray.errors import CorruptArchiveError
from fp8ray.io import archive
from fp8ray.io.blocks import BlockRef, SourceFile, SourceLayout

FS = pafs.LocalFileSystem()


def refs(sizes: list[int], files: str | None = None) -> list[BlockRef]:
    files = files or "a" * len(sizes)
    return [BlockRef(f"k{i}", "bfloat16", (n // 2,), "safetensors", "/src", 0, f) for i, (n, f) in enumerate(zip(sizes, files))]


def test_plan_depends_only_on_the_source():
    blocks = refs([100, 100, 300, 50, 50, 50])
    parts = archive.plan_parts(blocks, 200)
    assert [[r.key for r in p] for p in parts] == [["k0", "k1"], ["k2"], ["k3", "k4", "k5"]]
    assert archive.plan_parts(blocks, 10**9) == [blocks]
    assert archive.plan_parts([], 200) == []
    record = archive.plan_record("s3://key:secret@bucket/kv", CodecOptions().as_dict(), "none", parts)
    assert record.source == "s3://***@bucket/kv" and record.parts[1] == (("a", "k2"),)


def test_parts_follow_the_files():
    """Whole files share a part while they fit; a file larger than a part gets parts of its own."""
    blocks = refs([60, 60, 60, 60, 300, 300, 50, 50], "aabbccdd")
    parts = archive.plan_parts(blocks, 200)
    assert [[r.key for r in p] for p in parts] == [["k0", "k1"], ["k2", "k3"], ["k4"], ["k5"], ["k6", "k7"]]
    assert [[r.key for r in p] for p in archive.plan_parts(blocks, 250)] == [
        ["k0", "k1", "k2", "k3"],
        ["k4"],
        ["k5"],
        ["k6", "k7"],
    ]
    assert all(len({r.file for r in p}) == 1 or sum(r.nbytes for r in p) <= 200 for p in parts)


def test_a_part_holds_at_most_part_blocks_blocks_however_small():
    """A million tiny blocks were one part: no progress until the end, one worker, and a
    worker's per-row objects for all of them at once."""
    n = 2 * archive.PART_BLOCKS + 5
    blocks = refs([2] * n, "a" * (archive.PART_BLOCKS + 3) + "b" * (archive.PART_BLOCKS + 2))
    parts = archive.plan_parts(blocks, archive.DEFAULT_PART_BYTES)
    assert [len(p) for p in parts] == [archive.PART_BLOCKS, archive.PART_BLOCKS, 5]
    assert [r for p in parts for r in p] == blocks


def encoded_part(n: int = 3):
    codec = Fp8Codec(scaling="token")
    tensors = [torch.randn(4, 16 + i, dtype=torch.bfloat16) for i in range(n)]
    blocks = [BlockRef(f"b{i}", "bfloat16", tuple(t.shape), "safetensors", "/x", 0) for i, t in enumerate(tensors)]
    sizes = [codec.encoded_size(t.shape, t.dtype) for t in tensors]
    frames = np.empty(sum(sizes), np.uint8)
    start = 0
    for t, size in zip(tensors, sizes):
        codec.encode(t, out=frames[start : start + size])
        start += size
    return codec, tensors, blocks, sizes, frames


def test_row_groups_hold_1024_blocks_or_1_mib_of_frames():
    """A block read alone reads its row group's frames: a large block gets one of its own."""
    assert archive.row_groups([10] * 2100) == [1024, 1024, 52]
    assert archive.row_groups([16_000] * 140) == [65, 65, 10]  # small blocks: 1 MiB of them
    assert archive.row_groups([600_000] * 3) == [1, 1, 1]
    assert archive.row_groups([400_000, 400_000, 400_000, 3 << 20, 10]) == [2, 1, 1, 1]
    assert archive.row_groups([]) == []


def test_frame_column_shares_the_frames_buffer():
    _, tensors, _, sizes, frames = encoded_part()
    column = archive.frame_column(frames, sizes)
    assert column.buffers()[2].address == frames.ctypes.data  # no copy
    assert [len(v.as_py()) for v in column] == sizes
    with pytest.raises(ValueError, match="add up to"):
        archive.frame_column(frames, sizes[:-1])


def test_a_part_is_written_described_and_checked(tmp_path):
    codec, tensors, blocks, sizes, frames = encoded_part()
    rows = archive.part_rows(blocks, codec.options, sizes, archive.frame_column(frames, sizes))
    info = archive.write_part(FS, str(tmp_path), 7, rows)
    assert info.name == "part-00007.parquet" and info.blocks == 3 and (info.first_key, info.last_key) == ("b0", "b2")
    assert info.frame_bytes == sum(sizes) and info.raw_bytes == sum(t.numel() * 2 for t in tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_part-00007.json", "part-00007.parquet"]
    assert archive.read_sidecar(FS, str(tmp_path), 7) == info and archive.read_sidecar(FS, str(tmp_path), 8) is None
    entry = archive.Part.from_json(json.loads((tmp_path / "_part-00007.json").read_text()), "sidecar")
    table = archive.read_part(FS, str(tmp_path), entry)  # checked against the sidecar's CRC
    assert table.column("key").to_pylist() == ["b0", "b1", "b2"]
    for t, f in zip(tensors, archive.iter_frames(table)):
        assert torch.equal(decode(f), decode(codec.encode(t)))
    # Plain Parquet: readable without fp8ray.
    assert pq.read_table(tmp_path / info.name).schema.names == archive.SCHEMA.names
    metadata = pq.ParquetFile(tmp_path / info.name).metadata
    assert metadata.num_row_groups == 1
    # Every column chunk compressed, shape's list values too (pyarrow names their leaf).
    chunks = [metadata.row_group(0).column(i) for i in range(metadata.num_columns)]
    assert {c.path_in_schema: c.compression for c in chunks} == {
        **dict.fromkeys(archive.METADATA_LEAVES, "ZSTD"),
        "frame": "UNCOMPRESSED",
    }
    assert "shape.list.element" in archive.METADATA_LEAVES
    # The same rows give the same bytes.
    again = archive.write_part(FS, str(tmp_path), 8, rows)
    assert (again.crc32c, again.file_bytes) == (info.crc32c, info.file_bytes)

    data = bytearray((tmp_path / info.name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / info.name).write_bytes(bytes(data))
    with pytest.raises(CorruptArchiveError, match=r"part part-00007.parquet of .* is damaged: \d+ bytes with crc32c"):
        archive.check_part(FS, str(tmp_path), entry)


def test_part_frames_give_each_frame_and_runs_of_rows_across_row_groups(tmp_path, monkeypatch):
    """PartFrames, over a part of several row groups (read a group at a time): frame i is
    iter_frames' i-th; consecutive frames of one size come as one [n, size] view per row
    group they lie in; frames of two sizes give None."""
    monkeypatch.setattr(archive, "ROW_GROUP_BYTES", 300)  # a few frames a row group
    codec = Fp8Codec(scaling="token")
    tensors = [torch.randn(4, 16, dtype=torch.bfloat16) for _ in range(9)] + [torch.randn(2, 8, dtype=torch.bfloat16)]
    blocks = [BlockRef(f"b{i}", "bfloat16", tuple(t.shape), "safetensors", "/x", 0) for i, t in enumerate(tensors)]
    frames = [bytes(codec.encode(t)) for t in tensors]
    sizes = [len(f) for f in frames]
    rows = archive.part_rows(blocks, codec.options, sizes, archive.frame_column(np.frombuffer(b"".join(frames), np.uint8), sizes))
    info = archive.write_part(FS, str(tmp_path), 0, rows)
    assert pq.ParquetFile(tmp_path / info.name).metadata.num_row_groups > 3
    table = archive.read_part(FS, str(tmp_path), info, columns=["frame"])
    assert table.column("frame").num_chunks > 3  # a chunk per row group: no joining copy
    part = archive.PartFrames(table)
    assert part.num_rows == 10
    assert [bytes(part[i]) for i in range(10)] == [bytes(f) for f in archive.iter_frames(table)] == frames
    arrays = part.row_arrays(1, 8)
    assert len(arrays) > 2 and all(a.ndim == 2 and a.shape[1] == sizes[0] for a in arrays)
    assert [bytes(row) for a in arrays for row in a] == frames[1:9]
    assert part.row_arrays(5, 5) is None  # the last frame is smaller
    assert part.row_arrays(3, 0) == []
    with pytest.raises(IndexError):
        part[10]
    with pytest.raises(IndexError):
        part.row_arrays(8, 3)


def test_manifest_is_written_last_and_read_back(tmp_path):
    codec, _, blocks, sizes, frames = encoded_part()
    info = archive.write_part(
        FS, str(tmp_path), 0, archive.part_rows(blocks, codec.options, sizes, archive.frame_column(frames, sizes))
    )
    with pytest.raises(CorruptArchiveError, match="no _manifest.json: not a complete fp8ray archive"):
        archive.read_manifest(FS, str(tmp_path))
    with pytest.raises(CorruptArchiveError, match=r"is not a directory: not an fp8ray archive$"):
        archive.read_manifest(FS, str(tmp_path / "part-00000.parquet"))  # "has no _manifest.json" before
    layout = SourceLayout("safetensors", "file", (SourceFile("src", 3),))
    manifest = archive.build_manifest("s3://k:s@b/src", layout, codec.options.as_dict(), "none", {}, 3, [info], "9.9")
    archive.write_manifest(FS, str(tmp_path), manifest)
    assert archive.read_manifest(FS, str(tmp_path)) == manifest
    assert manifest.source == "s3://***@b/src" and manifest.archive_bytes == info.file_bytes
    assert manifest.options == codec.options and manifest.layout == layout
    (tmp_path / archive.MANIFEST_NAME).write_text(json.dumps({**manifest.to_json(), "version": 99}))
    with pytest.raises(CorruptArchiveError, match="version 99"):
        archive.read_manifest(FS, str(tmp_path))


def test_manifests_from_before_the_scale_options_read_as_written():
    layout = SourceLayout("safetensors", "file", (SourceFile("src", 0),))
    manifest = archive.build_manifest(
        "src", layout, {"fp8": "e4m3fn", "scaling": "token", "block_size": 128}, "none", {}, 0, [], "0"
    )
    old = archive.Manifest.from_json(manifest.to_json(), "_manifest.json")
    assert old.options == CodecOptions("e4m3fn", "token", 128, "float32", "amax")


def test_scratch_is_named_and_cleaned(tmp_path):
    temporary = ".part-00002.parquet.tmp-" + "0123456789abcdef" * 2  # a killed writer's
    for name in ("_plan.json", "_part-00001.json", temporary, "part-00001.parquet", "_manifest.json"):
        (tmp_path / name).write_bytes(b"x")
    archive.clean_scratch(FS, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_manifest.json", "part-00001.parquet"]


def test_a_manifest_cannot_name_files_outside_the_output(tmp_path):
    """A crafted (or damaged, yet checksummed) manifest naming ../evil is refused before
    anything is written."""
    from fp8ray.io.restore import plan_restore

    def manifest(layout: SourceLayout) -> archive.Manifest:
        part = archive.Part("part-00000.parquet", 1, 4, 44, 500, 0, "k", "k")
        return archive.build_manifest("src", layout, CodecOptions().as_dict(), "none", {}, 1, [part], "0")

    layout = SourceLayout("safetensors", "directory", (SourceFile("../evil.safetensors", 1),))
    columns = [{"file": ["../evil.safetensors"], "key": ["k"], "dtype": ["bfloat16"], "shape": [[2]], "frame_bytes": [44]}]
    with pytest.raises(CorruptArchiveError, match="not a plain relative file name"):
        plan_restore(manifest(layout), columns)
    layout = SourceLayout("safetensors", "directory", (SourceFile("a.safetensors", 1),))
    with pytest.raises(CorruptArchiveError, match=r"part-00000\.parquet \(row 0\) names the file 'b.safetensors', which the"):
        plan_restore(manifest(layout), [{**columns[0], "file": ["b.safetensors"]}])


@pytest.mark.parametrize(
    "text, message",
    [
        ("[]", "not an object"),
        ("[" * 100_000 + "]" * 100_000, "unreadable manifest: maximum recursion depth exceeded"),  # nested past the stack
        ('{"format": "fp8ray-archive", "version": 2}', "'codec' is missing"),
        (
            (
                '{"format": "fp8ray-archive", "version": 2, "fp8ray_version": "0", "codec": {}, "source": "s", "blocks": 1, '
                '"layout": {"kind": "safetensors", "container": "file", "files": [{"name": "a.safetensors", "blocks": 1}]}, '
                '"raw_bytes": 1, "frame_bytes": 1, "archive_bytes": 1, "parts": [{"name": "../x"}]}'
            ),
            "part entry 0's 'blocks' is missing",
        ),
    ],
)
def test_damaged_manifests_are_refused_by_name(tmp_path, text, message):
    (tmp_path / archive.MANIFEST_NAME).write_text(text)
    with pytest.raises(CorruptArchiveError, match=message):
        archive.read_manifest(FS, str(tmp_path))


def test_frames_swapped_between_rows_keep_the_parts_crc_and_are_refused(tmp_path):
    """Each frame ends with its own CRC-32C, a CRC codeword: two frames of one length
    swapped leave the part's CRC-32C as it was (shown here), so the frames' own CRCs in
    row order are recorded too, and verify and decompress refuse the part by them."""
    from safetensors.torch import save_file

    from fp8ray import PoolSettings
    from fp8ray.engine.archives import compress_archive, decompress_archive, verify_archive

    src, arch = tmp_path / "kv.safetensors", tmp_path / "kv.fp8"
    g = torch.Generator().manual_seed(3)
    save_file({name: torch.randn(4, 64, generator=g).to(torch.bfloat16) for name in ("layer0.k", "layer0.v")}, str(src))
    inline = PoolSettings(address="inline")
    compress_archive(str(src), str(arch), lossless="none", pool=inline)
    (part,) = archive.read_manifest(FS, str(arch)).parts
    path = arch / part.name
    data = bytearray(path.read_bytes())
    first, second = pq.read_table(path, columns=["frame"]).column("frame").to_pylist()
    assert len(first) == len(second) and first != second
    at_first, at_second = data.find(first), data.find(second)
    data[at_first : at_first + len(first)], data[at_second : at_second + len(second)] = second, first
    path.write_bytes(data)
    assert archive.file_crc32c(FS, str(path))[0] == part.crc32c  # the part's CRC cannot see it
    report = verify_archive(str(arch), pool=inline)
    assert not report.ok and any("its frames are not the ones written in its rows" in e for e in report.errors), report.errors
    with pytest.raises(CorruptArchiveError, match="its frames are not the ones written in its rows"):
        decompress_archive(str(arch), str(tmp_path / "out.safetensors"), pool=inline)
    assert not (tmp_path / "out.safetensors").exists()
