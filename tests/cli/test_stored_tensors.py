"""A file holding tensors fp8 does not encode (positions, masks, float64, fp8 caches) is
archived whole: those tensors go into stored frames and come back bit for bit, through
the Ray workers, inline, to one file, from and to Parquet; verify and fidelity check
them identical."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _util import random_bits, run_cli, tensor_bytes
from safetensors.torch import load_file, save_file

from fp8ray.codec.names import STORED_DTYPE_CODES

pytestmark = pytest.mark.usefixtures("ray_session")


def mixed_tensors() -> dict[str, torch.Tensor]:
    """A KV cache of the three encoded dtypes beside one tensor of every stored dtype (an
    empty and a 0-d one among them)."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "layer0.k": torch.randn(2, 8, 64, generator=g).to(torch.bfloat16),
        "layer0.v": torch.randn(2, 8, 64, generator=g).to(torch.float16),
        "layer1.k": torch.randn(2, 8, 64, generator=g),
    }
    for i, dtype in enumerate(sorted(STORED_DTYPE_CODES)):
        tensors[f"extra.{dtype}"] = random_bits(dtype, (3, 7), seed=i)
    tensors["positions"] = torch.arange(40, dtype=torch.int64)
    tensors["empty_mask"] = torch.zeros(0, 5, dtype=torch.bool)
    tensors["step"] = torch.tensor(7, dtype=torch.int32)
    return tensors


def safetensors_header(path: Path) -> bytes:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + n]


def assert_stored_ones_identical(original: dict[str, torch.Tensor], path: Path) -> None:
    back = load_file(str(path))
    assert set(back) == set(original)
    for key, t in original.items():
        assert back[key].dtype == t.dtype and back[key].shape == t.shape, key
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            assert tensor_bytes(back[key]) == tensor_bytes(t), key


@pytest.mark.parametrize("address", ["default", "inline"])
def test_a_file_of_every_dtype_is_archived_whole_and_comes_back(tmp_path, capsys, address):
    """Through the Ray workers and inline alike: the header (keys, order, dtypes, shapes,
    metadata) is the source's, every stored tensor's bytes are too, and verify --against
    passes; the parts say which rows are stored."""
    src = tmp_path / "mixed.safetensors"
    tensors = mixed_tensors()
    save_file(tensors, str(src), metadata={"model": "m"})
    where = [] if address == "default" else ["--address", address]
    code, out, err = run_cli(capsys, "compress", src, tmp_path / "arch", *where)
    assert code == 0, err
    stored = len(tensors) - 3
    assert out.startswith(f"compressed {len(tensors)} blocks ({stored} stored as they are, not in fp8) into 1 part")
    assert run_cli(capsys, "decompress", tmp_path / "arch", tmp_path / "out.safetensors", *where)[0] == 0
    assert safetensors_header(tmp_path / "out.safetensors") == safetensors_header(src)
    assert_stored_ones_identical(tensors, tmp_path / "out.safetensors")
    manifest = json.loads((tmp_path / "arch" / "_manifest.json").read_text())
    assert (manifest["version"], manifest["stored_blocks"]) == (3, stored)  # older fp8ray refuses it by its version
    code, out, _ = run_cli(capsys, "inspect", tmp_path / "arch")
    assert code == 0 and f"{len(tensors)} blocks in 1 part, " in out and f" ({stored} stored as they are, not in fp8); " in out
    code, out, err = run_cli(capsys, "verify", tmp_path / "arch", "--against", src)
    assert code == 0 and out.startswith(f"{len(tensors)} blocks in 1 part: ok; worst relative error "), (out, err)
    assert out.rstrip().endswith(f"'); {stored} stored blocks identical to the source"), out
    table = pq.read_table(tmp_path / "arch" / "part-00000.parquet", columns=["key", "dtype", "fp8", "scaling", "block_size"])
    rows = {r["key"]: r for r in table.to_pylist()}
    assert (
        rows["positions"]["fp8"] == "stored" and rows["positions"]["scaling"] == "none" and rows["positions"]["block_size"] == 0
    )
    assert rows["layer0.k"]["fp8"] == "e4m3fn" and rows["layer0.k"]["block_size"] == 32


def test_many_small_stored_blocks_in_a_row_come_back(tmp_path, capsys):
    """Small blocks of one dtype and shape go through the kernels in runs; stored ones,
    which have no kernel, one at a time, both ways."""
    tensors = {f"slots.{i:03d}": torch.arange(64, dtype=torch.int64) + i for i in range(300)}
    tensors |= {f"layer{i}.k": torch.ones(8, 64, dtype=torch.bfloat16) for i in range(4)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    code, _, err = run_cli(capsys, "compress", tmp_path / "a.safetensors", tmp_path / "arch", "--address", "inline")
    assert code == 0, err
    code, _, err = run_cli(capsys, "decompress", tmp_path / "arch", tmp_path / "back.safetensors", "--address", "inline")
    assert code == 0, err
    assert (tmp_path / "back.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()  # ones: exact in fp8


def test_single_file_decompress_and_get_give_stored_tensors_back(tmp_path, capsys):
    src = tmp_path / "kv"
    src.mkdir()
    first, second = mixed_tensors(), {"layer2.k": torch.ones(4, 64, dtype=torch.bfloat16), "slots": torch.arange(9) * 3}
    save_file(first, str(src / "a.safetensors"))
    save_file(second, str(src / "b.safetensors"))
    assert run_cli(capsys, "compress", src, tmp_path / "arch", "--address", "inline")[0] == 0
    out = tmp_path / "one.safetensors"
    code, _, err = run_cli(capsys, "decompress", tmp_path / "arch", out, "--single-file", "--address", "inline")
    assert code == 0, err
    assert_stored_ones_identical({**first, **second}, out)
    code, _, err = run_cli(
        capsys, "get", tmp_path / "arch", "slots", "--file", "b.safetensors", "-o", tmp_path / "slots.safetensors"
    )
    assert code == 0, err
    assert torch.equal(load_file(str(tmp_path / "slots.safetensors"))["slots"], second["slots"])


def test_verify_against_names_the_first_stored_element_that_differs(tmp_path, capsys):
    src = tmp_path / "a.safetensors"
    tensors = {"layer0.k": torch.ones(4, 64, dtype=torch.bfloat16), "positions": torch.arange(32, dtype=torch.int64)}
    save_file(tensors, str(src))
    assert run_cli(capsys, "compress", src, tmp_path / "arch", "--address", "inline")[0] == 0
    tensors["positions"][5] = -1
    save_file(tensors, str(tmp_path / "b.safetensors"))
    code, out, err = run_cli(capsys, "verify", tmp_path / "arch", "--against", tmp_path / "b.safetensors", "--json")
    report = json.loads(out)
    assert code == 1 and len(report["errors"]) == 1 and report["stored"] == []
    assert list(report["metrics"]) == ["layer0.k"]  # the differing block is an error, never an exact figure
    assert (
        "block 'positions' in part-00000.parquet: 1 of 32 int64 elements differ from the source, which the stored frame "
        "holds exactly; the first, element [5]: bits 0x0000000000000005, the source's 0xffffffffffffffff" in err
    ), err


def test_fidelity_lists_stored_tensors_apart_and_measures_only_the_cache(tmp_path, capsys):
    src = tmp_path / "a.safetensors"
    cache = {f"layer{i}.{kv}": torch.randn(4, 64).to(torch.bfloat16) for i in range(2) for kv in "kv"}
    save_file({**cache, "positions": torch.arange(4096, dtype=torch.int64) * 10**6}, str(src))
    save_file(cache, str(tmp_path / "cache_only.safetensors"))
    assert run_cli(capsys, "compress", src, tmp_path / "arch", "--address", "inline")[0] == 0
    assert run_cli(capsys, "compress", tmp_path / "cache_only.safetensors", tmp_path / "arch2", "--address", "inline")[0] == 0
    code, out, err = run_cli(capsys, "fidelity", src, tmp_path / "arch", "--json")
    assert code == 0, err
    with_positions = json.loads(out)
    code, out, _ = run_cli(capsys, "fidelity", tmp_path / "cache_only.safetensors", tmp_path / "arch2", "--json")
    without = json.loads(out)
    assert with_positions["stored"] == ["positions"] and "positions" not in with_positions["keys"]
    assert with_positions["total"] == without["total"]  # huge exact integers do not dilute the error
    assert (
        "1 key(s) stored as they are (not fp8), identical to the original: positions"
        in run_cli(capsys, "fidelity", src, tmp_path / "arch")[1]
    )
    many = {**cache, **{f"slot{i}": torch.arange(4) + i for i in range(5)}}
    save_file(many, str(tmp_path / "many.safetensors"))
    assert run_cli(capsys, "compress", tmp_path / "many.safetensors", tmp_path / "arch3", "--address", "inline")[0] == 0
    out = run_cli(capsys, "fidelity", tmp_path / "many.safetensors", tmp_path / "arch3")[1]
    assert re.search(r"5 key\(s\) stored as they are \(not fp8\), identical to the original: (slot\d, ){2}slot\d and 2 more", out)


def test_a_parquet_source_with_stored_dtypes_round_trips(tmp_path, capsys):
    rows = [
        ("ids", "int64", [4], np.array([1, -2, 2**62, 0], np.int64).tobytes()),
        ("mask", "bool", [3], bytes([1, 0, 1])),
        ("kv", "float32", [2, 32], np.linspace(-1, 1, 64, dtype=np.float32).tobytes()),
        ("fp8", "float8_e5m2", [5], bytes(range(5))),
        ("freqs", "float64", [2], np.array([np.nan, -np.inf]).tobytes()),
    ]
    table = pa.table(
        {
            "key": [r[0] for r in rows],
            "dtype": [r[1] for r in rows],
            "shape": [r[2] for r in rows],
            "data": pa.array([r[3] for r in rows], pa.large_binary()),
        }
    )
    pq.write_table(table, tmp_path / "blocks.parquet")
    assert run_cli(capsys, "compress", tmp_path / "blocks.parquet", tmp_path / "arch", "--address", "inline")[0] == 0
    code, _, err = run_cli(capsys, "decompress", tmp_path / "arch", tmp_path / "back.parquet", "--address", "inline")
    assert code == 0, err
    back = pq.read_table(tmp_path / "back.parquet")
    assert back["key"].to_pylist() == [r[0] for r in rows] and back["dtype"].to_pylist() == [r[1] for r in rows]
    for (key, dtype, _, data), got in zip(rows, back["data"].to_pylist()):
        if dtype != "float32":
            assert got == data, key


def test_verify_finds_a_manifest_whose_stored_count_is_not_the_parts(tmp_path, capsys):
    """The manifest's stored_blocks is what the parts hold: one edited (within what a
    manifest may say) fails verify; one removed from a version 3 manifest, added to a
    version 2 one, or above the block count, fails reading it."""
    save_file(mixed_tensors(), str(tmp_path / "mixed.safetensors"))
    assert run_cli(capsys, "compress", tmp_path / "mixed.safetensors", tmp_path / "arch", "--address", "inline")[0] == 0
    path = tmp_path / "arch" / "_manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "stored_blocks": manifest["stored_blocks"] - 1}))
    code, out, err = run_cli(capsys, "verify", tmp_path / "arch", "--address", "inline")
    assert (
        code == 1
        and (f"the manifest records {manifest['stored_blocks'] - 1} stored blocks, the parts hold {manifest['stored_blocks']}")
        in err
    )
    for edited in (
        {k: v for k, v in manifest.items() if k != "stored_blocks"},
        {**manifest, "version": 2},
        {**manifest, "stored_blocks": manifest["blocks"] + 1},
    ):
        path.write_text(json.dumps(edited))
        code, out, err = run_cli(capsys, "inspect", tmp_path / "arch")
        assert code == 1 and "version 3 and only it holds stored blocks, at least one" in err, err
