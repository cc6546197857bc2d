"""The layering of fp8ray/ (README: Layout), enforced by import-linter's contracts in
pyproject.toml: they hold on the code, and they fail when a lower layer imports a higher one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_layers_hold():
    result = lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory) -> Path:
    """fp8ray's sources and contracts in a scratch directory, to break on purpose."""
    root = tmp_path_factory.mktemp("layers")
    shutil.copytree(REPO / "fp8ray", root / "fp8ray", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(
    "module, line, contract",
    [
        ("codec/formats.py", "from ..io import paths", "Each layer imports only the layers below it"),
        ("io/archive.py", "from ..engine import pool", "Each layer imports only the layers below it"),
        ("engine/pool.py", "from ..cli import common", "Each layer imports only the layers below it"),
        ("engine/pool.py", "from ..eval import models", "Each layer imports only the layers below it"),
        ("codec/frame.py", "import pyarrow", "The codec is pure transforms"),
        ("io/blocks.py", "import ray", "Sources, sinks and the LMCache adapter do not need Ray"),
        ("io/lmcache_store.py", "from ..lmcache import frames", "Each layer imports only the layers below it"),
        ("lmcache/store_files.py", "from ..engine import pool", "Each layer imports only the layers below it"),
        ("lmcache/registry.py", "import ray", "Sources, sinks and the LMCache adapter do not need Ray"),
        ("engine/archives.py", "import tqdm", "Only the CLI parses arguments and draws progress bars"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(package_copy, module, line, contract):
    target = package_copy / "fp8ray" / module
    original = target.read_text()
    target.write_text(original + f"\n{line}  # added by the test\n")
    try:
        result = lint(package_copy, pythonpath=package_copy)
    finally:
        target.write_text(original)
    assert result.returncode != 0, result.stdout[-2000:]
    assert f"{contract}" in result.stdout and "BROKEN" in result.stdout, result.stdout[-3000:]


def test_contracts_name_every_subpackage():
    """A new subpackage must take its place in the layers, not slip outside them."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["id"] == "layers")["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    packages = {f"fp8ray.{p.name}" for p in (REPO / "fp8ray").iterdir() if (p / "__init__.py").is_file()}
    assert packages <= named, packages - named


def test_io_codec_and_lmcache_load_without_ray():
    code = (
        "import sys; import fp8ray.io.archive, fp8ray.io.blocks, fp8ray.io.lmcache_store, fp8ray.io.safetensors, "
        "fp8ray.lmcache, fp8ray.lmcache.store_files, fp8ray.eval.fidelity, fp8ray.serve.requests; "
        "print([m for m in sys.modules if m == 'ray' or m.startswith('ray.')])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_an_inline_compress_never_imports_ray(tmp_path):
    """Inline workers need no Ray, and a one-shot command does not pay for importing it."""
    import torch
    from safetensors.torch import save_file

    save_file({"k": torch.ones(4, 64, dtype=torch.bfloat16)}, str(tmp_path / "kv.safetensors"))
    code = (
        "import sys; from fp8ray.cli import main; "
        f"code = main(['compress', {str(tmp_path / 'kv.safetensors')!r}, {str(tmp_path / 'arch')!r}, '--address', 'inline']); "
        "print(code, [m for m in sys.modules if m == 'ray' or m.startswith('ray.')])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "0 []"
    assert (tmp_path / "arch/_manifest.json").exists()
