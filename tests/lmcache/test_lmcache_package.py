"""fp8ray's serdes inside the real ``lmcache`` package (0.5.6, installed by scripts/setup
with --no-deps): LMCache's own serializer, memory objects, ``AsyncSerdeProcessor``,
serde registry, adapter-config parser, L1 manager, filesystem L2 adapter and serde
wrapper, not copies of them.

The registered type is checked on a real KV cache (the shipped model over the shipped
text, captured once for the module): every decoded element within the derived bound of
docs/ACCURACY.md (``error_bound`` with each element's stored scale), and bit-identical
to ``fp8ray.decode`` of the stored frame.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest
import torch
from _util import DTYPES, element_scales, error_bound, kv_like, wait_for_lmcache_fd

import fp8ray
from fp8ray.bench.lmcache import byte_obj, capture_chunks, keys_for, kv_obj, memory_obj, run_task
from fp8ray.codec import CodecOptions, Fp8Codec, frame
from fp8ray.codec.metrics import error_sums
from fp8ray.io.lmcache_store import ChunkName, format_chunk_name
from fp8ray.lmcache import Fp8QuantizationDeserializer, Fp8QuantizationSerializer, register

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # isort: skip
from lmcache.v1.distributed.serde import (  # isort: skip
    AsyncSerdeProcessor,
    Deserializer,
    SerdeConfig,
    Serializer,
    create_serde_processor,
    get_registered_serde_types,
)
from lmcache.v1.distributed.serde import Fp8QuantizationDeserializer as LMCacheFp8Deserializer  # isort: skip
from lmcache.v1.distributed.serde import Fp8QuantizationSerializer as LMCacheFp8Serializer  # isort: skip

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
KEY = ObjectKey(chunk_hash=b"\x9f\x3a" * 16, model_name="HuggingFaceTB/SmolLM2-135M-Instruct", kv_rank=0x01000100)
# As an L2 adapter's JSON would give them: codec options by name, LMCache's max_workers.
MODES = {
    "default": {},
    "token-e5m2": {"fp8": "e5m2", "scaling": "token", "scale_dtype": "float32", "max_workers": 2},
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()
    yield


@pytest.fixture(scope="module")
def real_chunks():
    """The shipped model's KV cache over 96 tokens as LMCache chunks of 64 tokens: one
    full [2, 30, 64, 192] and one partial [2, 30, 32, 192], bfloat16."""
    chunks = capture_chunks(96, chunk_tokens=64)
    assert [tuple(c.shape) for c in chunks] == [(2, 30, 64, 192), (2, 30, 32, 192)]
    return chunks


def in_range(shape, dtype, fp8, seed):
    fmax = torch.finfo(fp8).max
    return kv_like(shape, dtype, seed=seed).float().clamp(-fmax, fmax).to(dtype)


def layout_of(t: torch.Tensor) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(shapes=[t.shape], dtypes=[t.dtype])


def buffer_bytes(obj) -> bytes:
    return bytes(obj.byte_array)  # what an L2 adapter stores: the used size after serialize


# --- the seed-compatible pair against LMCache's own fp8 serde -----------------------------


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_seed_pair_equals_lmcaches_fp8_serde_called_with_a_key(fp8, dtype):
    src = kv_obj(in_range((2, 4, 32, 64), dtype, fp8, seed=11))
    theirs, ours = byte_obj(src.tensor.numel()), byte_obj(src.tensor.numel())
    n_theirs = LMCacheFp8Serializer(fp8).serialize(src, theirs, KEY)
    n_ours = Fp8QuantizationSerializer(fp8).serialize(src, ours, KEY)
    assert n_ours == n_theirs == src.tensor.numel()
    assert torch.equal(ours.tensor, theirs.tensor)
    layout = MemoryLayoutDesc(shapes=[torch.Size([2, 4, 32, 64]), torch.Size([3, 5])], dtypes=[dtype, dtype])
    assert Fp8QuantizationSerializer(fp8).estimate_serialized_size(layout) == LMCacheFp8Serializer(fp8).estimate_serialized_size(
        layout
    )

    every_code = byte_obj(4 * 256)
    every_code.tensor.copy_(torch.arange(256, dtype=torch.uint8).repeat(4))
    a, b = memory_obj([(4, 256)], [dtype]), memory_obj([(4, 256)], [dtype])
    LMCacheFp8Deserializer(fp8).deserialize(every_code, a, KEY)
    Fp8QuantizationDeserializer(fp8).deserialize(every_code, b, KEY)
    nan = torch.isnan(a.tensor)
    assert torch.equal(torch.isnan(b.tensor), nan) and torch.equal(a.tensor[~nan], b.tensor[~nan])


def test_seed_pair_in_lmcaches_async_processor_matches_lmcaches_fp8(tmp_path):
    chunks = [in_range((2, 4, 64, 96), torch.bfloat16, torch.float8_e4m3fn, seed=s) for s in range(3)]
    keys = keys_for(len(chunks))
    ours = AsyncSerdeProcessor(Fp8QuantizationSerializer(), Fp8QuantizationDeserializer(), max_workers=2)
    theirs = create_serde_processor(SerdeConfig("fp8", {}))
    try:
        size = ours.estimate_serialized_size(layout_of(chunks[0]))
        assert size == theirs.estimate_serialized_size(layout_of(chunks[0]))
        results = {}
        for name, processor in (("ours", ours), ("theirs", theirs)):
            bufs = [byte_obj(size) for _ in chunks]
            assert run_task(processor, "serialize", [kv_obj(c) for c in chunks], bufs, keys) is True
            outs = [memory_obj([c.shape], [c.dtype]) for c in chunks]
            assert run_task(processor, "deserialize", bufs, outs, keys) is True
            results[name] = ([buffer_bytes(b) for b in bufs], [o.tensor.clone() for o in outs])
        assert results["ours"][0] == results["theirs"][0]
        for a, b, c in zip(results["ours"][1], results["theirs"][1], chunks):
            assert torch.equal(a, b) and torch.equal(a, c.to(torch.float8_e4m3fn).to(torch.bfloat16))
    finally:
        ours.close()
        theirs.close()


# --- the registered type ------------------------------------------------------------------


def test_register_is_idempotent_and_keeps_lmcaches_own_names():
    register()
    register()
    assert "fp8ray" in get_registered_serde_types() and "fp8" in get_registered_serde_types()
    with pytest.raises(ValueError, match="'fp8' is already registered by another factory"):
        register("fp8")


def adapter_config(spec: dict):
    """An L2 adapter's config as LMCache parses it from ``--l2-adapter JSON``."""
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    (config,) = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters
    return config


def test_an_adapters_serde_json_builds_fp8rays_processor(tmp_path):
    config = adapter_config(
        {"type": "fs", "base_path": str(tmp_path), "serde": {"type": "fp8ray", "scaling": "token", "max_workers": 2}}
    )
    assert config.serde_config == SerdeConfig("fp8ray", {"scaling": "token", "max_workers": 2})
    processor = create_serde_processor(config.serde_config)
    try:
        assert isinstance(processor, AsyncSerdeProcessor)
        assert isinstance(processor._serializer, Serializer) and isinstance(processor._deserializer, Deserializer)
        x = torch.zeros(2, 3, 8, 64, dtype=torch.bfloat16)
        assert processor.estimate_serialized_size(layout_of(x)) == Fp8Codec(scaling="token").encoded_size(x.shape, x.dtype)
    finally:
        processor.close()
    for kwargs, field in (
        ({"fp8_dtype": "float8_e4m3fn"}, "fp8_dtype"),
        ({"block_size": -1}, "block_size"),
        ({"max_workers": 0}, "max_workers"),
    ):
        with pytest.raises(ValueError, match=field):  # at build time, naming the key
            create_serde_processor(SerdeConfig("fp8ray", kwargs))


@pytest.mark.parametrize("mode", list(MODES))
def test_registered_type_round_trips_a_real_kv_cache_within_the_derived_bound(real_chunks, mode):
    kwargs = MODES[mode]
    options = CodecOptions.parse({k: v for k, v in kwargs.items() if k != "max_workers"})
    processor = create_serde_processor(SerdeConfig("fp8ray", kwargs))
    plain = create_serde_processor(SerdeConfig("fp8", {"fp8_dtype": f"float8_{options.fp8}"}))
    try:
        for x in real_chunks:  # LMCache's serde wrapper submits objects of one shape together
            size = processor.estimate_serialized_size(layout_of(x))
            assert size == Fp8Codec(options=options).encoded_size(x.shape, x.dtype)
            src, buf, out = kv_obj(x), byte_obj(size), memory_obj([x.shape], [x.dtype])
            assert run_task(processor, "serialize", [src], [buf], [KEY]) is True
            stored = buffer_bytes(buf)
            assert stored == bytes(Fp8Codec(options=options).encode(x))  # exactly the estimate, exactly the codec's frame
            assert run_task(processor, "deserialize", [buf], [out], [KEY]) is True
            y = out.tensor
            assert torch.equal(y, fp8ray.decode(stored))
            header = frame.parse(frame.as_byte_array(stored))
            scales = torch.from_numpy(frame.scales_of(frame.as_byte_array(stored), header).copy())
            s = element_scales(scales, header.scaling, header.shape, header.block_size)
            err = (y.double() - x.double()).abs().reshape(-1)
            assert bool((err <= error_bound(x, y, s, options.fp8)).all())
            assert bool((y != x).any())  # lossy indeed: the bound is what is checked

            # ...and it loses less than LMCache's plain fp8 cast of the same chunk.
            plain_buf, plain_out = byte_obj(x.numel()), memory_obj([x.shape], [x.dtype])
            assert run_task(plain, "serialize", [src], [plain_buf], [KEY]) is True
            assert run_task(plain, "deserialize", [plain_buf], [plain_out], [KEY]) is True
            assert error_sums(x, y).rel_fro < error_sums(x, plain_out.tensor).rel_fro
    finally:
        processor.close()
        plain.close()


def test_a_flipped_truncated_or_mismatched_buffer_fails_the_deserialize_task(real_chunks):
    x = real_chunks[0]
    processor = create_serde_processor(SerdeConfig("fp8ray", {}))
    try:
        size = processor.estimate_serialized_size(layout_of(x))
        buf = byte_obj(size)
        assert run_task(processor, "serialize", [kv_obj(x)], [buf], [KEY]) is True
        good = buf.tensor.clone()
        out = memory_obj([x.shape], [x.dtype])
        for offset in (5, 40, 100, size // 2, size - 2):  # header, shape, scales, codes, checksum
            bad = byte_obj(size)
            bad.tensor.copy_(good)
            bad.tensor[offset] ^= 0x01
            assert run_task(processor, "deserialize", [bad], [out], [KEY]) is False, offset
        short = byte_obj(size - 1)
        short.tensor.copy_(good[:-1])
        assert run_task(processor, "deserialize", [short], [out], [KEY]) is False
        other_dtype = memory_obj([x.shape], [torch.float16])
        assert run_task(processor, "deserialize", [buf], [other_dtype], [KEY]) is False
        # one bad object fails its whole task, as LMCache's wrapper expects (a miss for the batch)
        assert run_task(processor, "deserialize", [buf, short], [out, memory_obj([x.shape], [x.dtype])], [KEY, KEY]) is False
        assert run_task(processor, "deserialize", [buf], [out], [KEY]) is True
        assert torch.equal(out.tensor, fp8ray.decode(good))
    finally:
        processor.close()


# --- end to end: LMCache's filesystem L2 adapter with its serde wrapper ---------------------


def test_lmcaches_fs_adapter_stores_and_loads_fp8ray_frames(real_chunks, tmp_path):
    """The path an LMCache server takes for ``--l2-adapter '{"type": "fs", ..., "serde":
    {"type": "fp8ray"}}'`` (StorageManager._build_l2_adapter): LMCache parses the JSON,
    builds the fs adapter, and wraps it in a SerdeL2AdapterWrapper over the registered
    serde; its temporary buffers come from a real L1Manager."""
    from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
    from lmcache.v1.distributed.l1_manager import L1Manager
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper

    store = tmp_path / "l2"
    config = adapter_config({"type": "fs", "base_path": str(store), "serde": {"type": "fp8ray"}})
    l1 = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=64 << 20, use_lazy=False, shm_name="")))
    adapter = SerdeL2AdapterWrapper(create_l2_adapter(config), create_serde_processor(config.serde_config), l1)
    codec = Fp8Codec()
    try:
        expected = {}
        for c, x in enumerate(real_chunks):  # one store task per shape, as LMCache's store controller groups them
            keys = [
                ObjectKey(
                    chunk_hash=bytes([c]) * 32, model_name="HuggingFaceTB/SmolLM2-135M", kv_rank=0x01000100, cache_salt="t1"
                )
            ]
            reserved = l1.reserve_write(keys, [False], layout_of(x), tag="test")
            obj = reserved[keys[0]][1]
            obj.tensor.copy_(x)
            l1.finish_write_and_reserve_read(keys, tag="test")
            task = adapter.submit_store_task(keys, [obj])
            wait_for_lmcache_fd(adapter.get_store_event_fd())
            result = adapter.pop_completed_store_tasks()[task]
            assert result.is_successful()
            expected[keys[0]] = x

        names = {key: _object_key_to_filename(key) for key in expected}
        assert sorted(os.listdir(store)) == sorted(names.values())
        for key, x in expected.items():  # LMCache's names, which fp8ray's store tools read
            name = format_chunk_name(ChunkName(key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash, key.cache_salt))
            assert name == names[key]
            assert (store / name).read_bytes() == bytes(codec.encode(x))

        def load(keys):
            outs = [
                l1.reserve_write([ObjectKey(os.urandom(8), "load", 1)], [True], layout_of(expected[k]), tag="load") for k in keys
            ]
            objs = [next(iter(o.values()))[1] for o in outs]
            task = adapter.submit_load_task(keys, objs)
            wait_for_lmcache_fd(adapter.get_load_event_fd())
            bitmap = adapter.query_load_result(task)
            return [bitmap.test(i) for i in range(len(keys))], objs

        for key in expected:  # loaded one shape at a time, into fresh L1 buffers
            loaded, (obj,) = load([key])
            assert loaded == [True] and torch.equal(obj.tensor, fp8ray.decode((store / names[key]).read_bytes()))

        # A damaged file is a miss, never a wrong tensor: a flipped byte, then a truncated file.
        key = next(iter(expected))
        path = store / names[key]
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(data))
        assert load([key])[0] == [False]
        path.write_bytes(bytes(codec.encode(expected[key]))[:-10])
        assert load([key])[0] == [False]
        path.write_bytes(bytes(codec.encode(expected[key])))
        assert load([key])[0] == [True]
    finally:
        adapter.close()


def test_an_lmcache_storage_manager_built_from_the_command_line_stores_and_prefetches_through_fp8ray(real_chunks, tmp_path):
    """What ``lmcache server --l2-adapter '{"type": "fs", ..., "serde": {"type": "fp8ray"}}'``
    builds once register() has run: LMCache's StorageManager from LMCache's own argument
    parser. KV objects written to L1 reach the fs store as fp8ray frames; dropped from L1,
    they are prefetched back through the serde; a damaged file is a miss."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.distributed.storage_manager import StorageManager

    store = tmp_path / "l2"
    parser = argparse.ArgumentParser()
    add_storage_manager_args(parser)
    spec = {"type": "fs", "base_path": str(store), "serde": {"type": "fp8ray", "max_workers": 2}}
    args = parser.parse_args(["--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)])
    manager = StorageManager(parse_args_to_config(args))
    codec = Fp8Codec()
    try:
        keys = {}
        for c, x in enumerate(real_chunks):  # one object layout per call, as LMCache's transfer code does
            key = ObjectKey(chunk_hash=bytes([c + 1]) * 32, model_name="HuggingFaceTB/SmolLM2-135M", kv_rank=0x01000100)
            objs = manager.reserve_write([key], layout_of(x))
            objs[key].tensor.copy_(x)
            manager.finish_write([key])
            keys[key] = x
        from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename

        paths = {key: store / _object_key_to_filename(key) for key in keys}
        for _ in range(600):  # the store controller writes to L2 in the background (tmp file, then rename)
            if all(p.exists() for p in paths.values()):
                break
            time.sleep(0.1)
        for key, x in keys.items():
            assert paths[key].read_bytes() == bytes(codec.encode(x))
        assert manager.delete_l1_keys(list(keys), force=True) == (len(keys), 0)

        def prefetch(key) -> torch.Tensor | None:
            handle = manager.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys([key], 0, layout_of(keys[key]))]))
            assert manager.wait_prefetch_status(handle, 120)
            result = manager.query_prefetch_status(handle)
            if not result.hit_cells[0].test(0):
                return None
            assert result.l2_hit_cells[0].test(0)  # loaded from L2, through the serde
            with manager.read_prefetched_results([key]) as (obj,):
                out = obj.tensor.clone()
            manager.delete_l1_keys([key], force=True)
            return out

        for key in keys:
            assert torch.equal(prefetch(key), fp8ray.decode(paths[key].read_bytes()))
        key = next(iter(keys))
        data = bytearray(paths[key].read_bytes())
        data[len(data) // 3] ^= 0x80
        paths[key].write_bytes(bytes(data))
        assert prefetch(key) is None
    finally:
        manager.close()


# --- the benchmark's plumbing (its figures are in BENCHMARKS.md, never asserted) --------


def test_kv_chunks_lay_captured_blocks_out_as_lmcache_does():
    from fp8ray.bench.lmcache import kv_chunks

    g = torch.Generator().manual_seed(0)
    blocks = {f"layer{i:03d}.{kind}": torch.randn(3, 10, 4, generator=g) for i in range(2) for kind in "kv"}
    chunks = kv_chunks(blocks, chunk_tokens=4)
    assert [tuple(c.shape) for c in chunks] == [(2, 2, 4, 12), (2, 2, 4, 12), (2, 2, 2, 12)]
    whole = torch.cat(chunks, dim=2)
    for layer in range(2):
        for t in range(10):
            for h in range(3):
                assert torch.equal(whole[0, layer, t, h * 4 : (h + 1) * 4], blocks[f"layer{layer:03d}.k"][h, t])
                assert torch.equal(whole[1, layer, t, h * 4 : (h + 1) * 4], blocks[f"layer{layer:03d}.v"][h, t])


def test_bench_lmcache_measures_every_serde_on_the_same_chunks():
    from fp8ray.bench.lmcache import bench_lmcache, format_table
    from fp8ray.eval.sample import sample_kv_chunk

    chunks = [sample_kv_chunk(layers=2, tokens=16, seed=s) for s in range(2)]
    rows = bench_lmcache(chunks, [CodecOptions(), CodecOptions(scaling="token")], repeat=1)
    assert [r.serde for r in rows] == [
        "LMCache fp8",
        "fp8ray e4m3fn, block 32, bfloat16 scales by mse",
        "fp8ray e4m3fn, token, bfloat16 scales by mse",
    ]
    assert rows[0].bytes_per_chunk == chunks[0].numel() and rows[0].raw_per_chunk == 2 * chunks[0].numel()
    assert rows[2].bytes_per_chunk == Fp8Codec(scaling="token").encoded_size(chunks[0].shape, torch.bfloat16)
    plain = [c.to(torch.float8_e4m3fn).to(torch.bfloat16) for c in chunks]
    k = sum(error_sums(c[0], p[0]).err2 for c, p in zip(chunks, plain)) / sum(
        error_sums(c[0], p[0]).ref2 for c, p in zip(chunks, plain)
    )
    assert rows[0].k_err == pytest.approx(k**0.5, rel=1e-12)
    assert all(r.serialize_gbps > 0 and r.deserialize_gbps > 0 for r in rows)
    table = format_table(rows, "title")
    assert table.count("\n| ") == 4 and "| 1.00, 1.00 |" in table


def test_bench_lmcache_copies_store_the_chunks_again_from_memory_of_their_own():
    from fp8ray.bench.lmcache import _Subject, bench_lmcache, describe
    from fp8ray.eval.sample import sample_kv_chunk

    chunks = [sample_kv_chunk(layers=2, tokens=16, seed=s) for s in range(2)]
    once, thrice = (bench_lmcache(chunks, [CodecOptions()], repeat=1, copies=n) for n in (1, 3))
    for a, b in zip(once, thrice):  # the same chunks again: the same sizes and errors (sums of 3 copies: to rounding)
        assert (a.serde, a.bytes_per_chunk, a.raw_per_chunk) == (b.serde, b.bytes_per_chunk, b.raw_per_chunk)
        assert (a.k_err, a.v_err) == (pytest.approx(b.k_err, rel=1e-12), pytest.approx(b.v_err, rel=1e-12))
    processor = create_serde_processor(SerdeConfig("fp8", {"max_workers": 1}))
    try:
        subject = _Subject("LMCache fp8", processor, chunks * 3)
    finally:
        processor.close()
    for objs in (subject.srcs, subject.bufs, subject.outs):
        assert len({o.tensor.data_ptr() for o in objs}) == 6  # no copy shares another's memory
    assert all(torch.equal(o.tensor, c) for o, c in zip(subject.srcs, chunks * 3))
    title = describe(chunks, 32, 1, copies=3)
    size = 3 * sum(c.numel() * 2 for c in chunks) / 1e6
    assert f"each run storing 3 copies of them (6 chunks, {size:.1f} MB of bf16)" in title
    assert "storing 1 copy of them (2 chunks" in describe(chunks, 32, 1)
