"""fp8ray's frame serde against the contract of the installed ``lmcache`` (0.5.6 in CI;
LMCache's main branch checked by hand, docs/LMCACHE.md): the size contract it registers
with, vLLM's fused ``[1, L, T, 2H]`` and split ``[2, L, T, H]`` KV objects, K and V as a
group through LMCache's ``MultiSerializer``/``MultiDeserializer``, the used size of the
buffer it writes, and a 1-byte (vLLM ``fp8``) source: a failed task and no file, never
0 bytes reported as stored, unless ``"fp8_input": "passthrough"`` is asked for."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from _util import kv_like, wait_for_lmcache_fd

import fp8ray
from fp8ray.bench.lmcache import byte_obj, kv_obj, memory_obj, run_task
from fp8ray.codec import Fp8Codec
from fp8ray.errors import BadInputError
from fp8ray.lmcache import exact_size_contract, lmcache_multi_serde_classes, lmcache_serde_classes, register

from lmcache.v1.distributed import serde as lmcache_serde  # isort: skip
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # isort: skip
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor  # isort: skip

KEY = ObjectKey(chunk_hash=b"\x5a" * 32, model_name="org/model", kv_rank=0x01000100)
SPLIT, FUSED = (2, 4, 32, 64), (1, 4, 32, 128)  # [2, L, T, H] and vLLM's blocks-first [1, L, T, 2H]


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()


def layout_of(t: torch.Tensor) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(shapes=[t.shape], dtypes=[t.dtype])


def test_register_declares_exact_where_the_installed_lmcache_has_a_size_contract():
    contract = getattr(lmcache_serde, "SerdeSizeContract", None)
    assert register() is exact_size_contract() and "fp8ray" in lmcache_serde.get_registered_serde_types()
    if contract is None:  # 0.5.6: nothing to declare, registered as before
        assert register() is None
    else:  # LMCache after 0.5.6: its registry records fp8ray's estimate as exact
        assert register() is contract.EXACT and lmcache_serde.get_serde_size_contract("fp8ray") is contract.EXACT


@pytest.mark.parametrize("shape", [SPLIT, FUSED], ids=["split-2LTH", "fused-1LT2H"])
def test_registered_type_round_trips_split_and_fused_kv_objects(shape):
    x = kv_like(shape, torch.bfloat16, seed=21)
    processor = create_serde_processor(SerdeConfig("fp8ray", {}))
    try:
        size = processor.estimate_serialized_size(layout_of(x))
        assert size == Fp8Codec().encoded_size(x.shape, x.dtype)
        buf, out = byte_obj(size), memory_obj([x.shape], [x.dtype])
        assert run_task(processor, "serialize", [kv_obj(x)], [buf], [KEY]) is True
        assert bytes(buf.byte_array) == bytes(Fp8Codec().encode(x))
        assert run_task(processor, "deserialize", [buf], [out], [KEY]) is True
        assert torch.equal(out.tensor, fp8ray.decode(bytes(buf.byte_array)))
    finally:
        processor.close()


def test_the_serializer_narrows_a_larger_lmcache_buffer_to_what_it_wrote():
    x = kv_like(FUSED, torch.float16, seed=22)
    serializer, _ = lmcache_serde_classes()
    size = serializer().estimate_serialized_size(layout_of(x))
    buf = byte_obj(size + 4096)  # called directly, not through AsyncSerdeProcessor
    assert serializer().serialize(kv_obj(x), buf, KEY) == size
    assert buf.get_size() == size and bytes(buf.byte_array) == bytes(Fp8Codec().encode(x))


def test_k_and_v_groups_through_lmcaches_multi_serde_interface():
    k, v = kv_like((4, 32, 64), torch.bfloat16, seed=23), kv_like((4, 32, 64), torch.bfloat16, seed=24)
    ser_cls, de_cls = lmcache_multi_serde_classes()
    ser, de = ser_cls(), de_cls()
    assert isinstance(ser, lmcache_serde.MultiSerializer) and isinstance(de, lmcache_serde.MultiDeserializer)
    assert ser.group_size == de.group_size == 2
    size = ser.estimate_serialized_size((layout_of(k), layout_of(v)))
    buf = byte_obj(size)
    lmcache_serde.validate_group_size((kv_obj(k), kv_obj(v)), ser.group_size, role="src")
    assert ser.serialize((kv_obj(k), kv_obj(v)), buf, KEY) == size
    assert bytes(buf.byte_array) == bytes(Fp8Codec().encode(k)) + bytes(Fp8Codec().encode(v))
    k_out, v_out = memory_obj([k.shape], [k.dtype]), memory_obj([v.shape], [v.dtype])
    de.deserialize(buf, (k_out, v_out), KEY)
    assert torch.equal(k_out.tensor, fp8ray.decode(bytes(Fp8Codec().encode(k))))
    assert torch.equal(v_out.tensor, fp8ray.decode(bytes(Fp8Codec().encode(v))))
    v_only = memory_obj([v.shape], [v.dtype])
    de.deserialize(buf, (None, v_only), KEY)  # V-only retrieval: the K slot is left alone
    assert torch.equal(v_only.tensor, v_out.tensor)
    with pytest.raises(ValueError, match="slot 0 of the src group is None"):
        ser.serialize((None, kv_obj(v)), byte_obj(size), KEY)
    # the single-object pair behind LMCache's own length-1 group adapter: the same bytes
    single_ser, single_de = lmcache_serde_classes()
    wrapped, alone = byte_obj(size), byte_obj(size)
    n = lmcache_serde.single_to_multi_serializer(single_ser()).serialize((kv_obj(k),), wrapped, KEY)
    assert n == single_ser().serialize(kv_obj(k), alone, KEY) and bytes(wrapped.byte_array) == bytes(alone.byte_array)
    out = memory_obj([k.shape], [k.dtype])
    lmcache_serde.single_to_multi_deserializer(single_de()).deserialize(wrapped, (out,), KEY)
    assert torch.equal(out.tensor, k_out.tensor)


def fp8_kv(shape=FUSED) -> torch.Tensor:
    """vLLM's ``fp8`` KV as LMCache hands it over: 1-byte codes (uint8)."""
    return torch.randint(0, 0x7E, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(25))


def test_an_fp8_source_fails_the_serialize_task_naming_its_dtype():
    codes = fp8_kv()
    serializer, _ = lmcache_serde_classes()
    with pytest.raises(BadInputError, match=r"src tensor is torch.uint8 \[1, 4, 32, 128\]: already one byte per element"):
        serializer().serialize(kv_obj(codes), byte_obj(codes.numel()), KEY)
    processor = create_serde_processor(SerdeConfig("fp8ray", {}))
    try:
        size = processor.estimate_serialized_size(layout_of(codes))  # sized, never an error in LMCache's allocator
        assert size == codes.numel()
        assert run_task(processor, "serialize", [kv_obj(codes)], [byte_obj(size)], [KEY]) is False
    finally:
        processor.close()


@pytest.mark.parametrize("fp8_input", ["refuse", "passthrough"])
def test_lmcaches_fs_adapter_stores_no_file_for_an_fp8_source_unless_passed_through(tmp_path, fp8_input):
    """LMCache's own fs adapter behind its serde wrapper (as ``--l2-adapter`` builds it):
    refused, the store task fails and no file appears (never an empty file reported as
    stored); passed through, the file holds the codes as they are and loads back."""
    from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
    from lmcache.v1.distributed.l1_manager import L1Manager
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper

    store = tmp_path / "l2"
    spec = {"type": "fs", "base_path": str(store), "serde": {"type": "fp8ray", "fp8_input": fp8_input}}
    (config,) = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters
    l1 = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=16 << 20, use_lazy=False, shm_name="")))
    adapter = SerdeL2AdapterWrapper(create_l2_adapter(config), create_serde_processor(config.serde_config), l1)
    codes = fp8_kv()
    try:
        keys = [KEY]
        obj = l1.reserve_write(keys, [False], layout_of(codes), tag="test")[KEY][1]
        obj.tensor.copy_(codes)
        l1.finish_write_and_reserve_read(keys, tag="test")
        task = adapter.submit_store_task(keys, [obj])
        wait_for_lmcache_fd(adapter.get_store_event_fd())
        stored = adapter.pop_completed_store_tasks()[task].is_successful()
        files = sorted(p for p in store.rglob("*") if p.is_file()) if store.exists() else []
        if fp8_input == "refuse":
            assert not stored and files == []
            return
        assert stored and [f.read_bytes() for f in files] == [bytes(codes.numpy())]
        out = l1.reserve_write([ObjectKey(os.urandom(8), "load", 1)], [True], layout_of(codes), tag="load")
        (out,) = [o[1] for o in out.values()]
        task = adapter.submit_load_task(keys, [out])
        wait_for_lmcache_fd(adapter.get_load_event_fd())
        assert adapter.query_load_result(task).test(0) and torch.equal(out.tensor, codes)
    finally:
        adapter.close()


def test_the_lmcache_extra_brings_what_the_server_line_of_docs_lmcache_imports():
    """docs/LMCACHE.md's ``lmcache server`` line on a CPU install (lmcache with --no-deps)
    needs msgspec, pyzmq and blake3: the ``lmcache`` extra lists them, and with them the
    module the server command runs imports."""
    import re
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["lmcache"]
    assert {"msgspec", "pyzmq", "blake3"} <= {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] for r in extra}
    code = "import fp8ray.lmcache as m; m.register(); import lmcache.v1.multiprocess.http_server"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
