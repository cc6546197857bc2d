"""LMCache filesystem stores as archive sources and outputs: ``compress STORE ARCHIVE
--lmcache-layout`` and ``decompress ARCHIVE STORE --lmcache-form raw|fp8ray``, local and
on S3 (moto's server), loaded back by LMCache's own StorageManager (lmcache 0.5.6, CPU).

The stores hold chunk files named as LMCache names them, raw or in the form LMCache's
``fp8`` or the ``fp8ray`` serde writes, flat or in hash-prefix folders as LMCache's
native connector places them with ``hash_subdir_levels`` (``9f/3a/<name>``), beside
entries a store holds that are not chunks. What is checked is exact: the archive's
frames are the codec's frames of each chunk's values (an fp8ray chunk in the archive's
mode is kept as it is), the raw store given back is the codec's decode of each frame bit
for bit, the fp8ray store is the archive's frames byte for byte, and LMCache loads
each file into the tensor fp8ray decodes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from _util import moto_s3

import fp8ray
from fp8ray.cli import main
from fp8ray.codec import CodecOptions, Fp8Codec
from fp8ray.engine.archives import compress_archive, decompress_archive
from fp8ray.engine.stores import compress_store
from fp8ray.errors import BadInputError, CorruptArchiveError, CorruptFrameError, InvalidOptionError, MismatchError, SourceError
from fp8ray.io.lmcache_store import ChunkName, format_chunk_name, hash_folders, parse_layout, scan_store
from fp8ray.io.paths import resolve
from fp8ray.lmcache import Fp8QuantizationSerializer

LAYOUT, SHAPE = "bfloat16:2,2,16,64", (2, 2, 16, 64)
RAW_BYTES = 2 * 2 * 16 * 64 * 2
INLINE = fp8ray.PoolSettings(num_workers=2, address="inline")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHUNKS = [
    ChunkName(MODEL, 0x01000100, 0, bytes.fromhex("9f3a" * 16)),
    ChunkName(MODEL, 0x02010201, 0, bytes.fromhex("9f17" * 16)),  # shares its first folder with the one above
    ChunkName(MODEL, 0x01000100, 0x1F, bytes.fromhex("c4d5" * 16), "tenant-42"),
    ChunkName(MODEL, 0x01000100, 2, bytes.fromhex("0102" * 8)),
]


def chunk_tensor(seed: int) -> torch.Tensor:
    """A KV chunk: K about 8, V about 1/64 in magnitude (into e4m3fn's subnormals)."""
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    kv[0] *= 8.0
    kv[1] /= 64.0
    return kv.to(torch.bfloat16)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def fp8_bytes(t: torch.Tensor) -> bytes:
    """What LMCache's fp8 serde stores (fp8ray's drop-in serializer: the same bytes)."""
    out = torch.empty(t.numel(), dtype=torch.uint8)
    Fp8QuantizationSerializer(torch.float8_e4m3fn).serialize(SimpleNamespace(tensor=t), SimpleNamespace(tensor=out))
    return out.numpy().tobytes()


def from_fp8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16).reshape(SHAPE)


def stored(t: torch.Tensor, form: str, options: CodecOptions | None = None) -> bytes:
    """A chunk file's bytes in ``form``."""
    if form == "raw":
        return raw_bytes(t)
    if form == "fp8":
        return fp8_bytes(t)
    return bytes(Fp8Codec(options=options).encode(t))


def write_store(directory: Path, form: str, levels: int, options: CodecOptions | None = None) -> dict[str, bytes]:
    """A store of CHUNKS in ``form`` at ``levels`` hash-prefix folders, and what else LMCache's
    directory may hold; returns each chunk file's relative name and bytes."""
    files = {}
    for i, chunk in enumerate(CHUNKS):
        name = hash_folders(chunk, levels) + format_chunk_name(chunk)
        files[name] = stored(chunk_tensor(i), form, options)
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(files[name])
    (directory / "tmp").mkdir(parents=True)  # LMCache's relative_tmp_dir, with a write in flight
    (directory / "tmp" / (format_chunk_name(CHUNKS[0]) + ".tmp")).write_bytes(b"\0" * 10)
    (directory / "notes.txt").write_text("not a chunk")
    return files


OTHERS = {"tmp/": "not a regular file, nor a hash-prefix folder", "notes.txt": "not an LMCache chunk name"}


def archive_frames(archive: str) -> dict[str, bytes]:
    """Every frame of an archive by the file it records (local or s3://)."""
    fs, path = resolve(archive)
    out = {}
    for info in fs.get_file_info(pafs.FileSelector(path)):
        if info.base_name.startswith("part-"):
            with fs.open_input_file(info.path) as f:
                table = pq.read_table(f, columns=["file", "frame"])
            out.update(zip(table.column("file").to_pylist(), table.column("frame").to_pylist()))
    return out


def tree(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def source_values(data: bytes, form: str) -> torch.Tensor:
    if form == "raw":
        return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).reshape(SHAPE)
    return from_fp8(data) if form == "fp8" else fp8ray.decode(data)


# --- LMCache's own StorageManager loading a store ----------------------------------------


def lmcache_loads(store: Path, names: list[str], serde: dict | None) -> dict[str, torch.Tensor]:
    """Each chunk file ``names`` (relative to ``store``) as LMCache's StorageManager, built
    from its own command-line arguments with an ``fs`` L2 adapter (and ``serde``), prefetches
    it from L2 into L1. lmcache 0.5.6's ``fs`` adapter reads its base_path flat, so a store
    in hash-prefix folders is loaded one folder at a time (its native connector, which has
    ``hash_subdir_levels``, is newer than the LMCache CI installs)."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _filename_to_object_key
    from lmcache.v1.distributed.storage_manager import StorageManager

    fp8ray.lmcache.register()
    layout = MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16])
    folders: dict[str, list[str]] = {}
    for name in names:
        folders.setdefault(os.path.dirname(name), []).append(name)
    loaded = {}
    for folder, members in folders.items():
        spec = {"type": "fs", "base_path": str(store / folder)} | ({"serde": serde} if serde else {})
        parser = argparse.ArgumentParser()
        add_storage_manager_args(parser)
        args = parser.parse_args(["--l1-size-gb", "0.01", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)])
        manager = StorageManager(parse_args_to_config(args))
        try:
            for name in members:
                key = _filename_to_object_key(os.path.basename(name))
                assert isinstance(key, ObjectKey), name
                handle = manager.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys([key], 0, layout)]))
                assert manager.wait_prefetch_status(handle, 120)
                result = manager.query_prefetch_status(handle)
                assert result.hit_cells[0].test(0) and result.l2_hit_cells[0].test(0), f"LMCache did not load {name}"
                with manager.read_prefetched_results([key]) as (obj,):
                    loaded[name] = obj.tensor.clone()
        finally:
            manager.close()
    return loaded


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("form, levels", [("raw", 2), ("fp8", 1), ("fp8ray", 0)])
def test_a_store_in_each_form_comes_back_as_a_store_lmcache_loads(tmp_path, form, levels):
    """raw, fp8 and fp8ray stores (hash-prefix folders or flat) -> archive -> raw and fp8ray
    stores: same names in the same folders; the archive holds the codec's frame of each
    chunk's values (an fp8ray chunk in the archive's mode as it was); the raw store is
    each frame's decode bit for bit, the fp8ray store each frame byte for byte; LMCache
    loads both into exactly those tensors."""
    store = tmp_path / "store"
    files = write_store(store, form, levels)
    before = tree(store)
    arch = str(tmp_path / "kv.fp8")
    report = compress_archive(str(store), arch, pool=INLINE, lmcache_layout=LAYOUT, provenance={"model": MODEL})
    assert tree(store) == before  # nothing read is changed
    assert report.blocks == len(CHUNKS) and report.raw_bytes == len(CHUNKS) * RAW_BYTES
    assert {s["name"]: s["reason"] for s in report.skipped}.keys() == OTHERS.keys()
    assert all(OTHERS[s["name"]] in s["reason"] for s in report.skipped)

    manifest = fp8ray.inspect_archive(arch).manifest
    assert manifest.layout.kind == "lmcache" and [f.name for f in manifest.layout.files] == sorted(files)
    assert manifest.provenance.model == MODEL
    frames = archive_frames(arch)
    assert frames.keys() == files.keys()
    for name, data in files.items():
        expected = data if form == "fp8ray" else bytes(Fp8Codec().encode(source_values(data, form)))
        assert frames[name] == expected, name
    reader = fp8ray.open_archive(arch)  # a chunk read alone, by its file name
    name = sorted(files)[0]
    assert torch.equal(reader.get(os.path.basename(name)), fp8ray.decode(frames[name]))

    raw = tmp_path / "raw"
    back = decompress_archive(arch, str(raw), pool=INLINE, lmcache_form="raw")
    assert back.files == len(files) and back.lmcache_serde is None
    assert tree(raw).keys() == files.keys()
    for name, data in tree(raw).items():
        assert data == raw_bytes(fp8ray.decode(frames[name])), name  # the codec's decode, bit for bit
    frames_store = tmp_path / "frames"
    back = decompress_archive(arch, str(frames_store), pool=INLINE, lmcache_form="fp8ray")
    assert back.lmcache_serde == {"type": "fp8ray", **CodecOptions().as_dict()}
    assert tree(frames_store) == frames

    names = sorted(files)
    for name, tensor in lmcache_loads(raw, names, None).items():
        assert torch.equal(tensor, fp8ray.decode(frames[name])), name
    for name, tensor in lmcache_loads(frames_store, names, back.lmcache_serde).items():
        assert torch.equal(tensor, fp8ray.decode(frames[name])), name


def test_fp8ray_chunks_in_another_mode_are_encoded_in_the_archives(tmp_path):
    """A frame is kept as it is only in the archive's own mode; one in another mode is
    decoded and encoded in the archive's, so every frame of the archive is in its mode."""
    token = CodecOptions(scaling="token", scale_dtype="float32")
    files = write_store(tmp_path / "store", "fp8ray", 1, token)
    arch = str(tmp_path / "kv.fp8")
    compress_archive(str(tmp_path / "store"), arch, pool=INLINE, lmcache_layout=LAYOUT)
    frames = archive_frames(arch)
    for name, data in files.items():
        assert frames[name] == bytes(Fp8Codec().encode(fp8ray.decode(data))) != data, name
    arch2 = str(tmp_path / "kv-token.fp8")
    compress_archive(str(tmp_path / "store"), arch2, pool=INLINE, lmcache_layout=LAYOUT, options=token)
    assert archive_frames(arch2) == files


def test_a_store_goes_to_s3_and_back_on_ray(tmp_path, ray_session):
    """The backup path: a store in hash-prefix folders to an archive on S3 (moto's server)
    by Ray workers, and back into a new store, raw and fp8ray, the same as through a local
    archive; and onto S3 as a store too."""
    store = tmp_path / "store"
    write_store(store, "raw", 2)
    local = str(tmp_path / "local.fp8")
    compress_archive(str(store), local, pool=INLINE, lmcache_layout=LAYOUT)
    with moto_s3("kvcache") as s3:
        ray_pool = fp8ray.PoolSettings(num_workers=2)
        report = compress_archive(str(store), s3("backups/kv.fp8"), pool=ray_pool, lmcache_layout=LAYOUT, part_bytes=20_000)
        assert report.parts > 1 and "testing:testing" not in report.archive
        assert archive_frames(s3("backups/kv.fp8")) == archive_frames(local)
        for form in ("raw", "fp8ray"):
            decompress_archive(s3("backups/kv.fp8"), str(tmp_path / f"s3-{form}"), pool=ray_pool, lmcache_form=form)
            decompress_archive(local, str(tmp_path / f"local-{form}"), pool=INLINE, lmcache_form=form)
            assert tree(tmp_path / f"s3-{form}") == tree(tmp_path / f"local-{form}")
        decompress_archive(s3("backups/kv.fp8"), s3("warm/store"), pool=ray_pool, lmcache_form="fp8ray")
        fs, path = resolve(s3("warm/store"))
        on_s3 = {}
        for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
            if info.type == pafs.FileType.File:
                with fs.open_input_file(info.path) as f:
                    on_s3[info.path[len(path) + 1 :]] = f.read()
        assert on_s3 == tree(tmp_path / "local-fp8ray")
    names = sorted(tree(tmp_path / "s3-raw"))
    frames = archive_frames(local)
    for name, tensor in lmcache_loads(tmp_path / "s3-fp8ray", names, {"type": "fp8ray"}).items():
        assert torch.equal(tensor, fp8ray.decode(frames[name])), name


def test_the_command_line_backs_up_and_restores_a_store(tmp_path, capsys):
    store = tmp_path / "store"
    files = write_store(store, "fp8", 2)
    arch = str(tmp_path / "kv.fp8")
    base = ["--address", "inline", "--workers", "2"]
    assert main(["compress", str(store), arch, "--lmcache-layout", LAYOUT, "--model", MODEL, *base]) == 0
    out, _ = capsys.readouterr()
    assert f"compressed {len(CHUNKS)} blocks" in out and "skipped 1 file and 1 folder: notes.txt, tmp/" in out
    assert main(["decompress", arch, str(tmp_path / "back"), "--lmcache-form", "fp8ray", "--expect-model", MODEL, *base]) == 0
    out, _ = capsys.readouterr()
    assert f"into {len(CHUNKS)} files as fp8ray LMCache chunk files" in out and '"serde": {"type": "fp8ray"' in out
    assert tree(tmp_path / "back").keys() == files.keys()
    argv = ["decompress", arch, str(tmp_path / "other"), "--lmcache-form", "raw", "--expect-model", "Qwen/Qwen2.5-7B", *base]
    assert main(argv) == 1
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and f"was made for model {MODEL!r}, expected model 'Qwen/Qwen2.5-7B'" in err
    assert not (tmp_path / "other").exists()


# --- refused input -------------------------------------------------------------------------


def test_a_wrong_layout_is_refused_naming_it_and_creates_nothing(tmp_path, capsys):
    store = tmp_path / "store"
    write_store(store, "raw", 1)
    with pytest.raises(MismatchError, match=r"holds no chunk file of the layout float32:2,2,16,64 in any form") as info:
        compress_archive(str(store), str(tmp_path / "a"), pool=INLINE, lmcache_layout="float32:2,2,16,64")
    assert info.value.field == "layout" and "is --lmcache-layout right?" in str(info.value)
    assert main(["compress", str(store), str(tmp_path / "a"), "--lmcache-layout", "bf16:2,2", "--address", "inline"]) == 1
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "layout 'bf16:2,2': expected DTYPE:D0,D1,..." in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_a_file_of_another_layout_is_named_and_strict_refuses_it(tmp_path):
    store = tmp_path / "store"
    write_store(store, "raw", 0)
    other = format_chunk_name(ChunkName(MODEL, 1, 0, b"\x77" * 16))
    (store / other).write_bytes(bytes(Fp8Codec().encode(chunk_tensor(9)[:, :, :8])))  # a shorter, last chunk
    misplaced = "ab/" + format_chunk_name(ChunkName(MODEL, 1, 0, b"\x12" * 16))
    (store / "ab").mkdir()
    (store / misplaced).write_bytes(raw_bytes(chunk_tensor(8)))
    report = compress_archive(str(store), str(tmp_path / "a"), pool=INLINE, lmcache_layout=LAYOUT)
    reasons = {s["name"]: s["reason"] for s in report.skipped}
    assert reasons[other] == "an fp8ray frame of bfloat16:2,2,8,64, not of the layout bfloat16:2,2,16,64"
    assert reasons[misplaced] == "in folder ab/, not its hash's prefix folder: LMCache would not find it there"
    with pytest.raises(SourceError, match=r"holds 4 entries compress does not take \(--strict\)"):
        compress_archive(str(store), str(tmp_path / "b"), pool=INLINE, lmcache_layout=LAYOUT, strict=True)
    assert not (tmp_path / "b").exists()


def test_a_damaged_chunk_fails_the_compress_naming_it_and_leaves_no_archive(tmp_path):
    store = tmp_path / "store"
    files = write_store(store, "fp8ray", 2)
    bad = sorted(files)[1]
    data = bytearray(files[bad])
    data[len(data) // 2] ^= 0x10
    (store / bad).write_bytes(bytes(data))
    with pytest.raises(CorruptFrameError, match=rf"{bad}.*checksum mismatch"):
        compress_archive(str(store), str(tmp_path / "a"), pool=INLINE, lmcache_layout=LAYOUT)
    assert not (tmp_path / "a").exists()


def test_lmcache_form_is_refused_where_it_does_not_apply(tmp_path, kv_source, capsys):
    src, _ = kv_source
    plain = str(tmp_path / "plain.fp8")
    compress_archive(str(src), plain, pool=INLINE)
    with pytest.raises(BadInputError, match=r"was not made from an LMCache store \(its source was safetensors files\)"):
        decompress_archive(plain, str(tmp_path / "x"), pool=INLINE, lmcache_form="raw")
    write_store(tmp_path / "store", "raw", 1)
    arch = str(tmp_path / "kv.fp8")
    compress_archive(str(tmp_path / "store"), arch, pool=INLINE, lmcache_layout=LAYOUT)
    with pytest.raises(BadInputError, match=r"holds an LMCache store \(4 chunk files\): pass --lmcache-form raw") as info:
        decompress_archive(arch, str(tmp_path / "x"), pool=INLINE)
    assert info.value.field == "lmcache_form"
    with pytest.raises(InvalidOptionError, match="does not go with --single-file"):
        decompress_archive(arch, str(tmp_path / "x.safetensors"), pool=INLINE, lmcache_form="raw", single_file=True)
    with pytest.raises(InvalidOptionError, match=r"must be one of \['raw', 'fp8ray'\], got 'fp8'"):
        decompress_archive(arch, str(tmp_path / "x"), pool=INLINE, lmcache_form="fp8")
    assert main(["decompress", arch, str(tmp_path / "x"), "--address", "inline"]) == 1
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "pass --lmcache-form raw" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.safetensors").exists()
    # every chunk into one safetensors file, under its file name, is still there
    one = decompress_archive(arch, str(tmp_path / "all.safetensors"), pool=INLINE, single_file=True)
    assert one.blocks == len(CHUNKS)
    with pytest.raises(SourceError, match="an LMCache store is read from a local directory"):
        compress_archive("s3://bucket/store", str(tmp_path / "y"), pool=INLINE, lmcache_layout=LAYOUT)


def test_a_damaged_part_leaves_no_store(tmp_path):
    write_store(tmp_path / "store", "raw", 1)
    arch = tmp_path / "kv.fp8"
    compress_archive(str(tmp_path / "store"), str(arch), pool=INLINE, lmcache_layout=LAYOUT)
    part = next(arch.glob("part-*.parquet"))
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0x01
    part.write_bytes(bytes(data))
    with pytest.raises(CorruptArchiveError, match=rf"part {part.name} of .* is damaged"):
        decompress_archive(str(arch), str(tmp_path / "back"), pool=INLINE, lmcache_form="fp8ray")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.fp8", "store"]


# --- the store tools keep hash-prefix folders ---------------------------------------------


def test_lmcache_compress_converts_a_store_in_hash_prefix_folders_keeping_them(tmp_path):
    store = tmp_path / "store"
    files = write_store(store, "raw", 2)
    scan = scan_store(str(store), parse_layout(LAYOUT))
    assert sorted(c.name for c in scan.chunks) == sorted(files)
    report = compress_store(str(store), str(tmp_path / "fp8"), LAYOUT, serde="fp8ray", pool=INLINE)
    assert report.files == len(files)
    out = tree(tmp_path / "fp8")
    assert out.keys() == files.keys()
    for name, data in files.items():
        assert out[name] == bytes(Fp8Codec().encode(source_values(data, "raw"))), name


def test_a_store_of_a_model_served_from_a_relative_path_comes_back(tmp_path):
    """LMCache names the chunks of a model served from ``./models/llama`` with a leading
    ``.`` (``.-SEP-models-SEP-llama@...``): a plain name, which decompress gives back."""
    store, arch, back = tmp_path / "store", str(tmp_path / "kv.fp8"), tmp_path / "back"
    store.mkdir()
    files = {}
    for i in range(2):
        name = format_chunk_name(ChunkName("./models/llama", 0x01000100, 0, bytes([i]) * 16))
        assert name.startswith(".")
        files[name] = stored(chunk_tensor(i), "fp8ray")
        (store / name).write_bytes(files[name])
    compress_archive(str(store), arch, lmcache_layout=parse_layout(LAYOUT), pool=INLINE)
    decompress_archive(arch, str(back), lmcache_form="fp8ray", pool=INLINE)
    assert tree(back) == files


def test_a_chunk_named_with_a_backslash_is_skipped_and_the_archive_restores(tmp_path):
    """LMCache on Linux names a chunk of a model ``org/mo\\del`` with a backslash, which no
    archive records (decompress does not write such a name): compress names it as skipped,
    ``--strict`` refuses it, and the archive of the rest reads back."""
    store, arch, back = tmp_path / "store", str(tmp_path / "kv.fp8"), tmp_path / "back"
    files = write_store(store, "fp8ray", 0)
    odd = format_chunk_name(ChunkName("org/mo\\del", 0, 0, b"\x05" * 16))
    (store / odd).write_bytes(stored(chunk_tensor(5), "fp8ray"))
    report = compress_archive(str(store), arch, lmcache_layout=LAYOUT, pool=INLINE)
    assert {s["name"]: s["reason"] for s in report.skipped}[odd] == "a backslash in its name, which decompress does not write"
    decompress_archive(arch, str(back), lmcache_form="fp8ray", pool=INLINE)
    assert tree(back) == files
    with pytest.raises(SourceError, match=r"compress does not take \(--strict\)"):
        compress_archive(str(store), str(tmp_path / "b"), pool=INLINE, lmcache_layout=LAYOUT, strict=True)


def test_a_chunk_named_in_bytes_that_are_not_utf8_is_skipped_and_the_archive_restores(tmp_path):
    """A chunk file whose name is not UTF-8 failed compress before any work with Python's
    "'utf-8' codec can't encode character '\\udcff'", naming no file."""
    store, arch, back = tmp_path / "store", str(tmp_path / "kv.fp8"), tmp_path / "back"
    files = write_store(store, "fp8ray", 0)
    odd = os.fsencode(str(store)) + b"/bad\xffname@0x01000100@0@7777.data"
    with open(odd, "wb") as f:
        f.write(stored(chunk_tensor(5), "fp8ray"))
    with open(os.fsencode(str(store)) + b"/notes\xff.txt", "wb") as f:  # no chunk: skipped, its name recorded escaped
        f.write(b"x")
    report = compress_archive(str(store), arch, lmcache_layout=LAYOUT, pool=INLINE)
    reasons = {s["name"]: s["reason"] for s in report.skipped}
    assert reasons["bad\\udcffname@0x01000100@0@7777.data"] == "a name that is not UTF-8, which an archive cannot record"
    assert "notes\\udcff.txt" in reasons
    recorded = json.loads((tmp_path / "kv.fp8" / "_manifest.json").read_bytes().decode("utf-8"))
    assert {"bad\\udcffname@0x01000100@0@7777.data", "notes\\udcff.txt"} <= {e["name"] for e in recorded["layout"]["skipped"]}
    decompress_archive(arch, str(back), lmcache_form="fp8ray", pool=INLINE)
    assert tree(back) == files


def test_verify_against_a_store_says_it_compares_only_file_sources(tmp_path):
    """verify --against compares an archive with a .safetensors or .parquet source; an
    archive of a store, given its store, is told so (not that the store holds no
    .safetensors files)."""
    store, arch = tmp_path / "store", str(tmp_path / "kv.fp8")
    store.mkdir()
    write_store(store, "raw", 0)
    compress_archive(str(store), arch, lmcache_layout=parse_layout(LAYOUT), pool=INLINE)
    with pytest.raises(InvalidOptionError, match=r"is of an LMCache store, and verify --against compares .* only: verify it"):
        fp8ray.verify_archive(arch, against=str(store), pool=INLINE)
    assert fp8ray.verify_archive(arch, pool=INLINE).ok
