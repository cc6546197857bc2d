"""Provenance: what a cache was made for (model, revision, KV layout), recorded in the
manifest by compress and checked by open_archive(expect=) and decompress(expect=), which
refuse a mismatch naming the field, the archive's value and the expected one. Archives
written without it keep their JSON byte for byte, and are refused when asked to match."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp8ray
from fp8ray.engine.archives import compress_archive, decompress_archive, inspect_archive
from fp8ray.engine.pool import PoolSettings
from fp8ray.errors import CorruptArchiveError, InvalidOptionError, MismatchError
from fp8ray.io.archive import MANIFEST_NAME, read_manifest
from fp8ray.io.paths import resolve
from fp8ray.io.provenance import Provenance
from fp8ray.io.records import Manifest

INLINE = {"pool": PoolSettings(num_workers=1, address="inline")}
DATA = Path(__file__).parent / "data"  # archives written before provenance existed (data/README.md)
FP8RAY = Path(sys.executable).parent / "fp8ray"
MADE_FOR = {"model": "meta-llama/Llama-3.1-8B", "revision": "0e9e39f", "kv_layout": "[2,L,T,H] bf16"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("prov")
    g = torch.Generator().manual_seed(3)
    tensors = {f"layer{i}.kv": torch.randn(2, 4, 16, 64, generator=g).to(torch.bfloat16) for i in range(3)}
    save_file(tensors, str(root / "kv.safetensors"))
    return root, tensors


@pytest.fixture(scope="module")
def made(source):
    root, _ = source
    compress_archive(str(root / "kv.safetensors"), str(root / "made"), provenance=MADE_FOR, **INLINE)
    return root / "made"


@pytest.fixture(scope="module")
def plain(source):
    root, _ = source
    compress_archive(str(root / "kv.safetensors"), str(root / "plain"), **INLINE)
    return root / "plain"


def test_compress_records_it_and_inspect_shows_it(made):
    manifest = json.loads((made / MANIFEST_NAME).read_text())
    assert manifest["provenance"] == MADE_FOR
    report = inspect_archive(str(made))
    assert report.manifest.provenance == Provenance(**MADE_FOR)
    assert report.as_dict()["provenance"] == MADE_FOR


def test_an_archive_without_provenance_has_no_key_and_the_same_json(plain):
    text = (plain / MANIFEST_NAME).read_text()
    assert "provenance" not in json.loads(text)
    manifest = read_manifest(*resolve(str(plain)))
    assert manifest.provenance is None
    assert json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n" == text


def test_some_fields_only(source, tmp_path):
    root, _ = source
    compress_archive(str(root / "kv.safetensors"), str(tmp_path / "a"), provenance=Provenance(model="m"), **INLINE)
    assert json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())["provenance"] == {"model": "m"}
    fp8ray.open_archive(str(tmp_path / "a"), expect={"model": "m"})
    with pytest.raises(MismatchError, match=r"records no revision, expected revision 'r1'") as err:
        fp8ray.open_archive(str(tmp_path / "a"), expect={"model": "m", "revision": "r1"})
    assert err.value.field == "revision"


def test_open_archive_checks_every_field_given(made, source):
    _, tensors = source
    with fp8ray.open_archive(str(made), expect=MADE_FOR) as reader:
        assert torch.equal(reader.get("layer0.kv").float().sign(), tensors["layer0.kv"].float().sign())
    fp8ray.open_archive(str(made), expect={"model": MADE_FOR["model"]})  # any subset
    fp8ray.open_archive(str(made), expect=None)
    fp8ray.open_archive(str(made), expect={})
    for name, wrong in (("model", "Qwen/Qwen2-7B"), ("revision", "main"), ("kv_layout", "[1,L,T,2H] bf16")):
        with pytest.raises(MismatchError) as err:
            fp8ray.open_archive(str(made), expect={**MADE_FOR, name: wrong})
        message = str(err.value)
        shown = name.replace("_", " ")
        assert err.value.field == name and "\n" not in message
        assert f"made for {shown} {MADE_FOR[name]!r}, expected {shown} {wrong!r}" in message and str(made) in message


def test_an_unknown_expectation_is_named(made):
    with pytest.raises(InvalidOptionError, match="'modle'") as err:
        fp8ray.open_archive(str(made), expect={"modle": "x"})
    assert err.value.field == "modle"
    for not_a_mapping in ("model", ["model"], 5):  # dict() took a list of one letter for a field 'm'
        with pytest.raises(InvalidOptionError, match=r"provenance must be a mapping of some of \['model'"):
            fp8ray.open_archive(str(made), expect=not_a_mapping)


@pytest.mark.parametrize("bad", [{"model": ""}, {"model": 3}, {"revision": "a\nb"}])
def test_bad_provenance_is_refused_before_any_work(source, tmp_path, bad):
    root, _ = source
    with pytest.raises(InvalidOptionError) as err:
        compress_archive(str(root / "kv.safetensors"), str(tmp_path / "x"), provenance=bad, **INLINE)
    assert err.value.field == next(iter(bad))
    assert not (tmp_path / "x").exists()


def test_decompress_checks_before_any_work(made, source, tmp_path):
    _, tensors = source
    out = tmp_path / "ok.safetensors"
    decompress_archive(str(made), str(out), expect={"model": MADE_FOR["model"], "kv_layout": MADE_FOR["kv_layout"]}, **INLINE)
    assert set(load_file(out)) == set(tensors)
    with pytest.raises(MismatchError, match="model 'meta-llama/Llama-3.1-8B', expected model 'other'") as err:
        decompress_archive(str(made), str(tmp_path / "no.safetensors"), expect={"model": "other"}, **INLINE)
    assert err.value.field == "model"
    assert not (tmp_path / "no.safetensors").exists()


@pytest.mark.parametrize("name", ["v1_archive", "v2_archive"])
def test_old_archives_read_and_are_refused_an_expectation(name, tmp_path):
    arch = DATA / name
    assert read_manifest(*resolve(str(arch))).provenance is None
    reader = fp8ray.open_archive(str(arch))
    assert reader.keys()
    with pytest.raises(MismatchError, match=r"records no provenance, expected model 'm'") as err:
        fp8ray.open_archive(str(arch), expect={"model": "m"})
    assert err.value.field == "model"
    with pytest.raises(MismatchError, match="records no provenance"):
        decompress_archive(str(arch), str(tmp_path / "out"), expect={"revision": "r"}, **INLINE)
    assert not (tmp_path / "out").exists()


def test_a_damaged_provenance_record_is_named(made, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(made, copy)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    for bad, fragment in (({"model": 7}, "'model' is 7"), ({"modell": "x"}, "'modell'"), ("m", "not an object")):
        manifest["provenance"] = bad
        with pytest.raises(CorruptArchiveError, match=fragment):
            Manifest.from_json(manifest, str(copy / MANIFEST_NAME))


# --- through the installed command --------------------------------------------------


def fp8ray_cli(*argv) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([str(FP8RAY), *map(str, argv)], capture_output=True, text=True, timeout=300, env=env)


def test_the_command_line(source, tmp_path):
    root, tensors = source
    arch = tmp_path / "arch"
    flags = ["--model", MADE_FOR["model"], "--revision", MADE_FOR["revision"], "--kv-layout", MADE_FOR["kv_layout"]]
    done = fp8ray_cli("compress", root / "kv.safetensors", arch, *flags, "--address", "inline", "--workers", "1")
    assert done.returncode == 0, done.stderr
    shown = fp8ray_cli("inspect", arch)
    assert shown.returncode == 0, shown.stderr
    assert "made for model 'meta-llama/Llama-3.1-8B', revision '0e9e39f', kv layout '[2,L,T,H] bf16'" in shown.stdout
    as_json = fp8ray_cli("inspect", arch, "--json")
    assert json.loads(as_json.stdout)["provenance"] == MADE_FOR

    out = tmp_path / "back.safetensors"
    done = fp8ray_cli(
        "decompress",
        arch,
        out,
        "--expect-model",
        MADE_FOR["model"],
        "--expect-kv-layout",
        MADE_FOR["kv_layout"],
        "--address",
        "inline",
    )
    assert done.returncode == 0, done.stderr
    assert set(load_file(out)) == set(tensors)

    refused = fp8ray_cli("decompress", arch, tmp_path / "no.safetensors", "--expect-revision", "main", "--address", "inline")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode != 0 and len(lines) == 1 and lines[0].startswith("fp8ray: error: "), refused.stderr[-2000:]
    assert "made for revision '0e9e39f', expected revision 'main'" in lines[0]
    assert not (tmp_path / "no.safetensors").exists()

    old = fp8ray_cli("decompress", DATA / "v2_archive", tmp_path / "old", "--expect-model", "m", "--address", "inline")
    assert old.returncode != 0 and "records no provenance, expected model 'm'" in old.stderr
    plain = fp8ray_cli("inspect", DATA / "v2_archive")
    assert plain.returncode == 0 and "made for" not in plain.stdout
