"""lmcache-compress/-decompress --expect-model: a store holding a chunk of another model
(which LMCache names in each chunk's file name) is refused before any work, naming the
file and both models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8ray
from fp8ray.engine.stores import compress_store, decompress_store
from fp8ray.errors import InvalidOptionError, MismatchError
from fp8ray.io.lmcache_store import ChunkName, format_chunk_name

LAYOUT, SHAPE = "bfloat16:2,2,16,64", (2, 2, 16, 64)
INLINE = {"pool": fp8ray.PoolSettings(num_workers=1, address="inline")}
FP8RAY = Path(sys.executable).parent / "fp8ray"
LLAMA, QWEN = "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B-Instruct"


def write_store(directory: Path, models: list[str]) -> list[str]:
    directory.mkdir()
    names = []
    for i, model in enumerate(models):
        name = format_chunk_name(ChunkName(model, 1, 0, bytes([i + 1]) * 16))
        t = torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        (directory / name).write_bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        names.append(name)
    return names


def test_a_store_of_the_expected_model_converts_both_ways(tmp_path):
    names = write_store(tmp_path / "store", [LLAMA, LLAMA])
    compress_store(str(tmp_path / "store"), str(tmp_path / "fp8"), LAYOUT, serde="fp8ray", expect_model=LLAMA, **INLINE)
    assert sorted(os.listdir(tmp_path / "fp8")) == sorted(names)
    decompress_store(str(tmp_path / "fp8"), str(tmp_path / "raw"), LAYOUT, expect_model=LLAMA, **INLINE)
    assert sorted(os.listdir(tmp_path / "raw")) == sorted(names)


def test_a_chunk_of_another_model_is_refused_by_name(tmp_path):
    names = write_store(tmp_path / "store", [LLAMA, QWEN, LLAMA])
    with pytest.raises(MismatchError) as err:
        compress_store(str(tmp_path / "store"), str(tmp_path / "out"), LAYOUT, expect_model=LLAMA, **INLINE)
    message = str(err.value)
    assert err.value.field == "model" and "\n" not in message
    assert names[1] in message and f"was made for model {QWEN!r}, expected model {LLAMA!r}" in message
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    compress_store(str(tmp_path / "store"), str(tmp_path / "any"), LAYOUT, **INLINE)  # nothing expected: no check


def test_an_archive_of_a_store_records_only_the_model_its_chunks_name(tmp_path):
    """compress --lmcache-layout --model M recorded M whatever the chunks' names said, so
    that decompress --expect-model M gave back chunks of other models."""
    from fp8ray.engine.archives import compress_archive

    names = write_store(tmp_path / "store", [LLAMA, QWEN])
    with pytest.raises(MismatchError, match=rf"{names[1]}.* was made for model {QWEN!r}, expected model {LLAMA!r}"):
        compress_archive(
            str(tmp_path / "store"), str(tmp_path / "a"), lmcache_layout=LAYOUT, provenance={"model": LLAMA}, **INLINE
        )
    assert not (tmp_path / "a").exists()
    compress_archive(str(tmp_path / "store"), str(tmp_path / "b"), lmcache_layout=LAYOUT, **INLINE)  # none recorded


def test_an_empty_model_name_is_refused(tmp_path):
    write_store(tmp_path / "store", [LLAMA])
    with pytest.raises(InvalidOptionError) as err:
        compress_store(str(tmp_path / "store"), str(tmp_path / "out"), LAYOUT, expect_model="", **INLINE)
    assert err.value.field == "model"


def test_the_command_line(tmp_path):
    write_store(tmp_path / "store", [QWEN])
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    argv = [
        str(FP8RAY),
        "lmcache-compress",
        str(tmp_path / "store"),
        str(tmp_path / "out"),
        "--layout",
        LAYOUT,
        "--address",
        "inline",
    ]
    refused = subprocess.run([*argv, "--expect-model", LLAMA], capture_output=True, text=True, timeout=300, env=env)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode != 0 and len(lines) == 1 and lines[0].startswith("fp8ray: error: "), refused.stderr[-2000:]
    assert f"made for model {QWEN!r}, expected model {LLAMA!r}" in lines[0]
    done = subprocess.run([*argv, "--expect-model", QWEN], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr


def test_a_chunk_whose_model_name_is_not_printable_is_named_not_blamed_on_the_option(tmp_path):
    names = write_store(tmp_path / "store", [LLAMA, "bad\tmodel"])
    with pytest.raises(MismatchError) as err:
        compress_store(str(tmp_path / "store"), str(tmp_path / "out"), LAYOUT, expect_model=LLAMA, **INLINE)
    message = str(err.value)
    assert err.value.field == "model" and "\n" not in message and "\t" not in message
    assert "bad\\tmodel" in message and "not printable" in message and f"expected model {LLAMA!r}" in message
    assert "chunk file bad\\tmodel@" in message and names[1].split("@")[1] in message  # the file is named
    assert not (tmp_path / "out").exists()
