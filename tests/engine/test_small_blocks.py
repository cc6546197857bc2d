"""Small blocks go through compress and decompress a part at a time (runs of frames, one
header parse per file, one write per batch), and the archive is still the one block by
block coding gives: each frame the codec's own frame of its block, each part the bytes
``write_part`` makes of those frames, each file given back the blocks' decodes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

import fp8ray
from fp8ray.codec import CodecOptions, Fp8Codec, decode
from fp8ray.errors import SourceError
from fp8ray.io import archive
from fp8ray.io.blocks import BlockReader, bytes_to_tensor, list_blocks, read_blocks, tensor_to_bytes
from fp8ray.io.safetensors import SafetensorsWriter

INLINE = fp8ray.PoolSettings(num_workers=1, address="inline")
# Runs of small blocks of one shape, broken by a large block, a lone odd shape and an empty one.
FILES = [[(128, 64)] * 300, [(4096, 64), (3, 5), (0, 64)] + [(16, 64)] * 50, [(128, 64)] * 40]


@pytest.fixture(scope="module")
def small_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("small") / "kv"
    root.mkdir()
    g = torch.Generator().manual_seed(7)
    for i, shapes in enumerate(FILES):
        tensors = [(f"f{i}.{j:04d}", "bfloat16", shape) for j, shape in enumerate(shapes)]
        with SafetensorsWriter(str(root / f"kv{i}.safetensors"), tensors, {"file": str(i)}) as w:
            for shape in shapes:
                w.write(tensor_to_bytes((torch.randn(shape, generator=g) * 20).to(torch.bfloat16)))
    return root


@pytest.mark.parametrize("scaling", ["tensor", "token", "block"])
def test_a_small_block_archive_is_block_by_block_coding(small_source, tmp_path, scaling):
    options = CodecOptions(scaling=scaling)
    codec = Fp8Codec(options=options)
    arch, out = tmp_path / "arch", tmp_path / "out"
    fp8ray.compress_archive(str(small_source), str(arch), options=options, lossless="none", part_bytes=1 << 20, pool=INLINE)
    fp8ray.decompress_archive(str(arch), str(out), pool=INLINE)
    refs = list_blocks(str(small_source))
    frames = {r.ident: bytes(codec.encode(bytes_to_tensor(data, r.dtype, r.shape))) for r, data in zip(refs, read_blocks(refs))}
    manifest = archive.read_manifest(pafs.LocalFileSystem(), str(arch))
    assert len(manifest.parts) > 1
    start = 0
    for i, part in enumerate(manifest.parts):
        part_refs = refs[start : start + part.blocks]
        start += part.blocks
        expected = [frames[r.ident] for r in part_refs]
        assert pq.read_table(arch / part.name).column("frame").to_pylist() == expected, part.name
        again = tmp_path / f"again{i}"
        again.mkdir()
        rows = archive.part_rows(part_refs, options, [len(f) for f in expected], expected)
        archive.write_part(pafs.LocalFileSystem(), str(again), i, rows, "none")
        assert (again / part.name).read_bytes() == (arch / part.name).read_bytes(), part.name
    assert start == len(refs)
    for i in range(len(FILES)):
        name = f"kv{i}.safetensors"
        tensors = [(r.key, r.dtype, r.shape) for r in refs if r.file == name]
        with SafetensorsWriter(str(tmp_path / name), tensors, {"file": str(i)}) as w:
            for key, _, _ in tensors:
                w.write(tensor_to_bytes(decode(frames[(name, key)])))
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_the_reader_reads_a_part_in_runs_and_names_a_block_cut_short(small_source, tmp_path):
    """Blocks end to end in a file are read with one call each run; a file cut short after
    it was listed is refused naming the first block it cuts."""
    refs = list_blocks(str(small_source))
    picked = refs[:5] + refs[7:9] + refs[300:310]  # a gap, then another file
    reader = BlockReader()
    got = reader.read(picked)
    for ref, data in zip(picked, got):
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            assert data.tobytes() == f.read(ref.nbytes), ref.key
    assert np.array_equal(reader.joined, np.concatenate(got))  # laid end to end in the order asked for
    got = [d.copy() for d in got]  # views of the reader's buffer, which the next read reuses
    interleaved = [refs[0], refs[300], refs[1]]  # read file by file: not in the order asked for
    assert [d.tobytes() for d in reader.read(interleaved)] == [d.tobytes() for d in got[:1] + got[7:8] + got[1:2]]
    assert reader.joined is None
    short = tmp_path / "short.safetensors"
    short.write_bytes((small_source / "kv0.safetensors").read_bytes())
    cut = [dataclasses.replace(r, path=str(short)) for r in refs[:300]]
    with open(short, "r+b") as f:
        f.truncate(cut[200].offset + 10)
    with pytest.raises(SourceError, match=r"key 'f0\.0200' has 10 bytes, its shape \[128, 64\] bfloat16 needs 16384"):
        BlockReader().read(cut)
