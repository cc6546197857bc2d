"""scripts/device_check: without a GPU it says so and exits 0; its CPU self-check runs
the whole script; a mismatch is reported by mode and first differing byte, exit 1."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8ray import Fp8Codec
from fp8ray.codec import frame

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "device_check"


def load_script() -> types.ModuleType:
    loader = importlib.machinery.SourceFileLoader("device_check", str(SCRIPT))
    module = types.ModuleType(loader.name)
    module.__file__ = str(SCRIPT)
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("launcher", [[], [sys.executable]], ids=["shebang", "python"])
def test_without_a_gpu_it_says_so_and_exits_0(launcher):
    if torch.cuda.is_available():  # then the real check, without the timings
        result = subprocess.run([*launcher, str(SCRIPT), "--no-bandwidth"], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "matches the CPU path bit for bit" in result.stdout
        return
    result = subprocess.run([*launcher, str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("device_check: no CUDA GPU here") and "nothing to check" in result.stdout


def test_cpu_self_check_runs_the_whole_script():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--mib", "1", "--repeat", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "CPU self-check" in out and "bit-for-bit: " in out
    table = [line for line in out.splitlines() if line.startswith("| e4m3fn")]
    assert len(table) == 12  # 6 modes, encode and decode
    assert "| e4m3fn, block 32, bfloat16 scales by mse | encode |" in out
    assert out.rstrip().endswith("every frame and every decode matches the CPU path bit for bit")


def test_the_grid_covers_every_format_scaling_scale_dtype_choice_and_dtype():
    script = load_script()
    seen = {(c.options.fp8, c.options.scaling, c.options.scale_dtype, c.options.scale_choice, c.x.dtype) for c in script.cases()}
    for combo in [
        ("e4m3fn", "none", "float32", "amax"),
        ("e5m2", "token", "bfloat16", "mse"),
        ("e5m2", "block", "float32", "mse"),
    ]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert (*combo, dtype) in seen
    assert not any(mode[3] == "mse" and mode[1] not in ("token", "block") for mode in seen)
    assert len({mode[:4] for mode in seen}) == 2 * (
        3 * 2 + 2 * 4
    )  # formats x (plain x scale dtypes + searched x dtypes x choices)


def test_a_mismatch_names_the_mode_and_first_differing_byte_and_exits_1(monkeypatch, capsys):
    script = load_script()
    real_encode = script.device_encode

    def damaged_encode(codec, x, device):
        f = real_encode(codec, x, device).copy()
        if (
            codec.options.scaling == "block"
            and codec.options.scale_choice == "mse"
            and codec.options.nonfinite == "error"
            and x.dtype == torch.float16
            and x.dim() == 3
        ):
            header = frame.parse(f)
            f[header.codes_offset + 100] ^= 0x01
        return f

    monkeypatch.setattr(script, "device_encode", damaged_encode)
    assert script.main(["--device", "cpu", "--no-bandwidth"]) == 1
    out = capsys.readouterr().out
    mismatches = [line for line in out.splitlines() if line.startswith("MISMATCH")]
    assert len(mismatches) == 4  # e4m3fn and e5m2, bfloat16 and float32 scales
    assert (
        "MISMATCH encode [e4m3fn:block:block_size=32:scale_dtype=bfloat16:scale_choice=mse:nonfinite=error, "
        "float16 [3, 37, 130]]: "
        "first differing byte" in out
    )
    assert "(code of element 100)" in mismatches[0] and "1 bytes differ" in mismatches[0]
    assert "device_check: 4 mismatch(es)" in out


def test_a_decode_mismatch_names_the_element_and_byte(monkeypatch, capsys):
    script = load_script()
    real_decode = script.device_decode

    def off_by_one_bit(f, device):
        results = real_decode(f, device)
        name, t = results[0]
        if t.dtype == torch.float32 and t.numel() > 3:
            t = t.clone()
            t.view(-1).view(torch.int32)[3] ^= 1
        return [(name, t), *results[1:]]

    monkeypatch.setattr(script, "device_decode", off_by_one_bit)
    assert script.main(["--device", "cpu", "--no-bandwidth"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH decode [e4m3fn:none:" in out and "float32 [3, 37, 130]]: first differing element 3 (byte 12)" in out
    assert "MISMATCH decode into out=" not in out


def test_frame_difference_says_where_the_byte_lies():
    script = load_script()
    f = np.frombuffer(Fp8Codec(scaling="token", scale_dtype="float32").encode(torch.randn(4, 8)), np.uint8)
    header = frame.parse(f)
    assert script.frame_difference(f, f.copy()) is None
    for at, where in [
        (5, "header"),
        (header.scales_offset + 9, "scale 2"),
        (header.codes_offset + 7, "code of element 7"),
        (f.size - 1, "checksum"),
    ]:
        damaged = f.copy()
        damaged[at] ^= 0xFF
        assert f"first differing byte {at} of {f.size} ({where})" in script.frame_difference(f, damaged)
    assert "are 60 and 59 bytes long" in script.frame_difference(f[:60], f[:59])
