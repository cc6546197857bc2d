"""The scratch folders of runs killed outright: marked while written, removed by the next
run writing the same output, and nothing else ever removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from _util import run_cli
from safetensors.torch import save_file

from fp8ray.io.leftovers import MARK, ScratchMark, sweep_leftovers
from fp8ray.io.lmcache_store import ChunkName, format_chunk_name
from fp8ray.io.paths import temporary_name

LOCAL = pafs.LocalFileSystem()
DIES_HOLDING = """
import os, sys
import pyarrow.fs as pafs
from fp8ray.io.leftovers import ScratchMark
from fp8ray.io.paths import temporary_name
scratch = temporary_name(sys.argv[1])
os.mkdir(scratch)
ScratchMark(scratch)
with open(os.path.join(scratch, "half.safetensors"), "wb") as f:
    f.write(b"x" * 2**20)
print(scratch, flush=True)
os._exit(0)  # as SIGKILL would: no clean-up runs, the kernel drops the lock
"""


def killed_run_left(output: Path) -> Path:
    """The scratch folder of a run writing ``output`` that died without cleaning up."""
    result = subprocess.run([sys.executable, "-c", DIES_HOLDING, str(output)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip())


def test_a_dead_writers_folder_goes_and_a_live_ones_stays(tmp_path):
    output = tmp_path / "out.safetensors"
    dead = killed_run_left(output)
    live = Path(temporary_name(str(output)))
    live.mkdir()
    mark = ScratchMark(str(live))  # held by this process: another open of it cannot lock it
    said = []
    sweep_leftovers(LOCAL, str(output), "out.safetensors", said.append)
    assert not dead.exists() and (live / MARK).exists()
    [line] = said
    assert line.startswith(f"removed 1 scratch folder left beside out.safetensors by killed runs ({dead.name}; 1.0 MiB")
    mark.release()  # before the rename into place: the mark must not reach the output
    assert not (live / MARK).exists()
    mark.release()


def test_only_marked_folders_of_the_outputs_own_names_are_removed(tmp_path):
    """An unmarked folder (another program's, or an output set aside while it is replaced),
    a file or link of a temporary's name, and another output's leftovers all stay."""
    output = tmp_path / "out"
    unmarked = Path(temporary_name(str(output)))
    unmarked.mkdir()
    (unmarked / "old.safetensors").write_bytes(b"the user's old output")
    a_file = Path(temporary_name(str(output)))
    a_file.write_bytes(b"")
    target = killed_run_left(tmp_path / "elsewhere")
    link = Path(temporary_name(str(output)))
    link.symlink_to(target)
    other = killed_run_left(tmp_path / "out2")
    said = []
    sweep_leftovers(LOCAL, str(output), "out", said.append)
    assert said == [] and all(p.exists() for p in (unmarked, a_file, link, target, other))
    sweep_leftovers(pafs.SubTreeFileSystem(str(tmp_path), LOCAL), str(output), "out", said.append)  # no locks there
    assert said == [] and target.exists()


@pytest.fixture
def small_archive(tmp_path) -> Path:
    save_file({"a": torch.randn(8, 64, dtype=torch.bfloat16)}, tmp_path / "kv.safetensors")
    code = run_cli_quiet("compress", tmp_path / "kv.safetensors", tmp_path / "kv.fp8", "--address", "inline")
    assert code == 0
    return tmp_path / "kv.fp8"


def run_cli_quiet(*argv) -> int:
    from fp8ray.cli import main

    return main([str(a) for a in argv] + ["--json"])


def removed_line(output: Path, leftover: Path) -> str:
    return f"fp8ray: removed 1 scratch folder left beside {output} by killed runs ({leftover.name}; 1.0 MiB)\n"


def test_decompress_compress_and_store_conversions_remove_what_killed_runs_left(small_archive, tmp_path, capsys):
    capsys.readouterr()
    restored = tmp_path / "restored.safetensors"
    leftover = killed_run_left(restored)
    code, _, err = run_cli(capsys, "decompress", small_archive, restored, "--address", "inline")
    assert code == 0 and err == removed_line(restored, leftover) and not leftover.exists()

    leftover = killed_run_left(small_archive)  # a compress --overwrite killed as it built the new archive
    code, _, err = run_cli(capsys, "compress", tmp_path / "kv.safetensors", small_archive, "--overwrite", "--address", "inline")
    assert code == 0 and err == removed_line(small_archive, leftover) and not leftover.exists()

    store = tmp_path / "store"
    store.mkdir()
    (store / format_chunk_name(ChunkName("m", 0, 0, b"\x01"))).write_bytes(
        torch.randn(2, 2, 16, 64).bfloat16().view(torch.uint8).numpy().tobytes()
    )
    converted = tmp_path / "fp8"
    leftover = killed_run_left(converted)
    code, _, err = run_cli(capsys, "lmcache-compress", store, converted, "--layout", "bfloat16:2,2,16,64", "--address", "inline")
    assert code == 0 and err == removed_line(converted, leftover) and not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "kv.fp8", "kv.safetensors", "restored.safetensors", "store"]


def test_a_decompress_killed_mid_write_is_cleaned_up_by_the_next(tmp_path):
    """The real thing: SIGKILL once decompress's scratch folder holds data; the rerun removes it."""
    blocks = {f"layer{i}": torch.randn(1024, 4096, dtype=torch.bfloat16) for i in range(32)}  # 256 MiB
    save_file(blocks, tmp_path / "kv.safetensors")
    fp8ray = Path(sys.executable).parent / "fp8ray"
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    common = ["--address", "inline", "--workers", "1"]
    subprocess.run(
        [fp8ray, "compress", tmp_path / "kv.safetensors", tmp_path / "kv.fp8", "--scaling", "tensor", *common],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    out = tmp_path / "out.safetensors"
    proc = subprocess.Popen([fp8ray, "decompress", tmp_path / "kv.fp8", out, *common], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    scratch = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = [p for p in tmp_path.glob(".out.safetensors.tmp-*") if (p / MARK).exists()]
        if found and any(f.stat().st_blocks for f in found[0].glob("*.safetensors")):
            scratch = found[0]
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    if scratch is None:
        pytest.skip("decompress finished before it could be killed mid-write")
    assert scratch.exists() and not out.exists()
    result = subprocess.run([fp8ray, "decompress", tmp_path / "kv.fp8", out, *common], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"removed 1 scratch folder left beside {out} by killed runs ({scratch.name}; " in result.stderr
    assert not scratch.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["kv.fp8", "kv.safetensors", "out.safetensors"]
