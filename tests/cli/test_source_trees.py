"""A directory source is a tree (issue 19): compress takes every .safetensors file in
every folder and names what it leaves; decompress gives the tree back byte for byte and
never removes what it did not write; verify --against compares file sets; inspect checks
that every part is there. Through the fp8ray command (in-process, workers inline)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from _util import run_cli
from safetensors.torch import save_file

INLINE = ("--address", "inline")
# Values exact in e4m3fn, so that scaling "none" gives the bytes back as they were.
EXACT = ("--scaling", "none")


def digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def small(seed: int, rows: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.{kv}": torch.randint(-8, 9, (rows, 64), generator=g).to(torch.bfloat16) for i in range(2) for kv in "kv"}


@pytest.fixture
def tree(tmp_path) -> Path:
    """20 safetensors files, 8 of them in subfolders (two levels), plus a README.txt and
    a tenant_b/index.json: the issue's directory."""
    root = tmp_path / "kv"
    for i in range(12):
        (root).mkdir(exist_ok=True)
        save_file(small(i), str(root / f"req{i:02d}.safetensors"), {"request": str(i)})
    for i in range(8):
        folder = root / "tenant_b" / ("deep" if i >= 5 else "")
        folder.mkdir(parents=True, exist_ok=True)
        save_file(small(100 + i), str(folder / f"t{i}.safetensors"))
    (root / "README.txt").write_text("what these are")
    (root / "tenant_b" / "index.json").write_text("{}")
    return root


def taken(root: Path) -> dict[str, str]:
    return {name: d for name, d in digests(root).items() if name.endswith(".safetensors")}


def test_a_tree_comes_back_byte_for_byte_and_the_skipped_files_are_named(tree, tmp_path, capsys):
    arch, out = tmp_path / "arch", tmp_path / "out"
    code, stdout, err = run_cli(capsys, "compress", tree, arch, *EXACT, *INLINE)
    assert code == 0, err
    assert stdout.startswith("compressed 80 blocks ")
    assert stdout.rstrip("\n").endswith("; skipped 2 files: README.txt, tenant_b/index.json")
    manifest = json.loads((arch / "_manifest.json").read_text())
    assert manifest["layout"]["skipped"] == [
        {"name": "README.txt", "reason": "not a .safetensors file"},
        {"name": "tenant_b/index.json", "reason": "not a .safetensors file"},
    ]
    assert len(manifest["layout"]["files"]) == 20
    code, _, err = run_cli(capsys, "decompress", arch, out, *INLINE)
    assert code == 0, err
    assert digests(out) == taken(tree) and len(digests(out)) == 20  # every file the command did not name
    code, stdout, _ = run_cli(capsys, "inspect", arch)
    assert code == 0 and "the source's tree skipped 2 files: README.txt, tenant_b/index.json" in stdout


def test_what_a_tree_holds_besides_is_named_in_json_and_strict_refuses_it(tree, tmp_path, capsys):
    (tree / ".hidden.safetensors").write_bytes(b"x")
    (tree / ".cache").mkdir()
    (tree / ".cache" / "c.safetensors").write_bytes(b"x")
    (tree / "empty" / "inner").mkdir(parents=True)
    (tree / "to_tenant").symlink_to(tree / "tenant_b")  # a link to a folder: not followed
    (tree / "alias.safetensors").symlink_to(tree / "req00.safetensors")  # a link to a file: the file
    code, stdout, err = run_cli(capsys, "compress", tree, tmp_path / "arch", *INLINE, "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["blocks"] == 84 and report["skipped"] == [
        {"name": ".cache/", "reason": "hidden folder"},
        {"name": ".hidden.safetensors", "reason": "hidden file"},
        {"name": "README.txt", "reason": "not a .safetensors file"},
        {"name": "empty/inner/", "reason": "empty folder"},
        {"name": "tenant_b/index.json", "reason": "not a .safetensors file"},
        {"name": "to_tenant/", "reason": "symbolic link to a folder, not followed"},
    ]
    code, stdout, err = run_cli(capsys, "compress", tree, tmp_path / "arch2", *INLINE)
    assert code == 0 and stdout.rstrip("\n").endswith(
        "; skipped 3 files and 3 folders: .cache/, .hidden.safetensors, README.txt, empty/inner/, tenant_b/index.json, to_tenant/"
    )
    code, stdout, err = run_cli(capsys, "compress", tree, tmp_path / "strict", *INLINE, "--strict")
    assert code == 1 and stdout == "" and err.count("\n") == 1
    assert err == (
        f"fp8ray: error: source {tree} holds 6 entries compress does not take (--strict): .cache/ (hidden folder), "
        ".hidden.safetensors (hidden file), README.txt (not a .safetensors file), empty/inner/ (empty folder), "
        "tenant_b/index.json (not a .safetensors file), to_tenant/ (symbolic link to a folder, not followed)\n"
    )
    assert not (tmp_path / "strict").exists()


def test_strict_takes_a_clean_tree(tree, tmp_path, capsys):
    (tree / "README.txt").unlink()
    (tree / "tenant_b" / "index.json").unlink()
    code, stdout, err = run_cli(capsys, "compress", tree, tmp_path / "arch", *INLINE, "--strict")
    assert code == 0 and "skipped" not in stdout, err


def test_verify_against_names_the_source_file_the_archive_lacks(tree, tmp_path, capsys):
    arch = tmp_path / "arch"
    assert run_cli(capsys, "compress", tree, arch, *INLINE)[0] == 0
    code, stdout, _ = run_cli(capsys, "verify", arch, "--against", tree, *INLINE)
    assert code == 0 and "ok" in stdout
    shutil.copy(tree / "req00.safetensors", tree / "tenant_b" / "extra.safetensors")  # every key is one the archive has
    code, stdout, err = run_cli(capsys, "verify", arch, "--against", tree, *INLINE)
    assert code == 1 and "1 problem" in stdout
    assert err.splitlines() == [
        "fp8ray: source file tenant_b/extra.safetensors (4 blocks) is not in the archive",
        f"fp8ray: error: archive {arch} failed verification (1 problem)",
    ]
    (tree / "tenant_b" / "extra.safetensors").unlink()
    save_file(
        {**small(3), "layer9.k": torch.zeros(2, 64, dtype=torch.bfloat16)}, str(tree / "req03.safetensors"), {"request": "3"}
    )
    code, _, err = run_cli(capsys, "verify", arch, "--against", tree, *INLINE)
    assert code == 1
    assert "fp8ray: 1 block(s) of source file req03.safetensors are not in the archive, e.g. 'layer9.k'" in err.splitlines()
    (tree / "req03.safetensors").unlink()
    code, _, err = run_cli(capsys, "verify", arch, "--against", tree, *INLINE)
    assert code == 1 and f"fp8ray: file req03.safetensors of the archive is not in {tree}" in err.splitlines()


def test_decompress_never_removes_what_it_did_not_write(tree, tmp_path, capsys):
    arch, out = tmp_path / "arch", tmp_path / "out"
    assert run_cli(capsys, "compress", tree, arch, *EXACT, *INLINE)[0] == 0
    assert run_cli(capsys, "decompress", arch, out, *INLINE)[0] == 0
    code, _, err = run_cli(capsys, "decompress", arch, out, "--overwrite", *INLINE)  # its own output: replaced
    assert code == 0 and err == "", err
    (out / "notes.txt").write_text("mine")
    (out / "tenant_b" / "mine").mkdir()
    (out / "tenant_b" / "mine" / "x.bin").write_bytes(b"mine")
    before = digests(out)
    code, _, err = run_cli(capsys, "decompress", arch, out, "--overwrite", *INLINE)
    assert code == 1 and err == (
        f"fp8ray: error: output {out} holds 2 entries the archive does not describe (notes.txt, tenant_b/mine/x.bin): "
        "--overwrite replaces only the archive's own files; pass --force-replace to delete them too\n"
    )
    assert digests(out) == before
    code, stdout, err = run_cli(capsys, "decompress", arch, out, "--force-replace", *INLINE, "--json")
    assert code == 0 and err == (
        f"fp8ray: --force-replace: replacing {out} deletes 2 entries the archive does not describe: "
        f"notes.txt, tenant_b/mine/x.bin\n"
    )
    assert json.loads(stdout)["deleted"] == ["notes.txt", "tenant_b/mine/x.bin"]
    assert digests(out) == taken(tree)


@pytest.fixture
def two_parts(tree, tmp_path, capsys) -> Path:
    arch = tmp_path / "arch"
    assert run_cli(capsys, "compress", tree, arch, "--part-mb", "0.005", *INLINE)[0] == 0
    assert len(list(arch.glob("part-*.parquet"))) > 2
    return arch


def test_a_missing_part_is_missing_everywhere(two_parts, tmp_path, capsys):
    arch = two_parts
    part = arch / "part-00001.parquet"
    size = part.stat().st_size
    part.unlink()
    missing = f"part part-00001.parquet is missing from {arch} (the manifest records it, {size} bytes)"
    code, stdout, err = run_cli(capsys, "inspect", arch)
    assert code == 1 and stdout.startswith(f"{arch}: ")
    assert err.splitlines() == [f"fp8ray: {missing}", f"fp8ray: error: archive {arch} failed inspection (1 problem)"]
    code, stdout, _ = run_cli(capsys, "inspect", arch, "--json")
    assert code == 1 and json.loads(stdout)["problems"] == [missing]
    code, _, err = run_cli(capsys, "verify", arch, *INLINE)
    assert code == 1 and err.splitlines()[0] == f"fp8ray: {missing}"
    code, _, err = run_cli(capsys, "decompress", arch, tmp_path / "out", *INLINE)
    assert code == 1 and err == f"fp8ray: error: {missing}\n"
    assert not (tmp_path / "out").exists()


def test_a_damaged_part_is_damaged_not_missing(two_parts, tmp_path, capsys):
    arch = two_parts
    part = arch / "part-00001.parquet"
    recorded = part.stat().st_size
    with open(part, "ab") as f:
        f.write(b"junk")
    code, _, err = run_cli(capsys, "inspect", arch)
    assert code == 1 and err.splitlines()[0] == (
        f"fp8ray: part part-00001.parquet of {arch} is damaged: {recorded + 4} bytes, the manifest records {recorded}"
    )
    code, _, err = run_cli(capsys, "decompress", arch, tmp_path / "out", *INLINE)
    assert code == 1 and err.startswith(f"fp8ray: error: part part-00001.parquet of {arch} is damaged") and "missing" not in err
    data = bytearray(part.read_bytes()[:recorded])
    data[recorded // 2] ^= 0xFF  # the recorded size, other bytes: only the CRC can tell
    part.write_bytes(bytes(data))
    assert run_cli(capsys, "inspect", arch)[0] == 0  # no part is read
    code, _, err = run_cli(capsys, "verify", arch, *INLINE)
    assert code == 1 and f"part part-00001.parquet of {arch} is damaged: {recorded} bytes with crc32c" in err


def test_old_manifests_without_skipped_still_read(tree, tmp_path, capsys):
    arch = tmp_path / "arch"
    assert run_cli(capsys, "compress", tree, arch, *EXACT, *INLINE)[0] == 0
    manifest = json.loads((arch / "_manifest.json").read_text())
    del manifest["layout"]["skipped"]  # as version 2 archives written before it was recorded
    (arch / "_manifest.json").write_text(json.dumps(manifest))
    code, stdout, _ = run_cli(capsys, "inspect", arch)
    assert code == 0 and "skipped" not in stdout
    assert run_cli(capsys, "decompress", arch, tmp_path / "out", *INLINE)[0] == 0
    assert digests(tmp_path / "out") == taken(tree)


def test_a_source_file_with_tmp_in_its_name_comes_back(tmp_path, capsys):
    """``.tmp-`` inside a source file's name is not one of fp8ray's temporaries: verify and
    decompress take the archive, and the file comes back under its name."""
    src, arch, out = tmp_path / "kv", tmp_path / "arch", tmp_path / "out"
    src.mkdir()
    save_file(small(1), str(src / "run.tmp-2.safetensors"))
    save_file(small(2), str(src / "a.safetensors"))
    assert run_cli(capsys, "compress", src, arch, *EXACT, *INLINE)[0] == 0
    assert run_cli(capsys, "verify", arch, "--against", src, *INLINE)[0] == 0
    assert run_cli(capsys, "decompress", arch, out, *INLINE)[0] == 0
    assert digests(out) == digests(src)


def test_a_source_file_named_with_a_backslash_is_left_out_and_named(tmp_path, capsys):
    """A backslash is a plain character of a POSIX name, but decompress writes no such
    name (and every reader refuses a manifest listing one): compress leaves the file out
    of a tree, naming it as skipped (--strict refuses), and refuses it as a source of its own."""
    src, arch, out = tmp_path / "kv", tmp_path / "arch", tmp_path / "out"
    src.mkdir()
    save_file(small(1), str(src / "a\\b.safetensors"))
    save_file(small(2), str(src / "c.safetensors"))
    code, stdout, err = run_cli(capsys, "compress", src, arch, *EXACT, *INLINE, "--json")
    assert code == 0, err
    assert json.loads(stdout)["skipped"] == [
        {"name": "a\\b.safetensors", "reason": "a backslash in its name, which decompress does not write"}
    ]
    assert run_cli(capsys, "inspect", arch)[0] == 0
    assert run_cli(capsys, "decompress", arch, out, *INLINE)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["c.safetensors"]
    code, _, err = run_cli(capsys, "compress", src, tmp_path / "strict", "--strict", *INLINE)
    assert code == 1 and "a\\b.safetensors (a backslash in its name, which decompress does not write)" in err
    code, _, err = run_cli(capsys, "compress", src / "a\\b.safetensors", tmp_path / "one", *INLINE)
    assert (code, err.count("\n")) == (1, 1) and "a backslash in its name, which decompress does not write; rename it" in err


def test_names_that_are_not_utf8_are_left_out_and_named_escaped(tmp_path, capsys):
    """A POSIX name is bytes, an archive's manifest UTF-8 JSON: compress stopped on such a
    name with Python's own "surrogates not allowed", naming no file. A file or folder so
    named is now skipped, named escaped; a path given so named is refused in one line."""
    src, arch, out = tmp_path / "kv", tmp_path / "arch", tmp_path / "out"
    src.mkdir()
    save_file(small(1), os.fsdecode(bytes(src) + b"/x\xff.safetensors"))
    os.mkdir(os.fsdecode(bytes(src) + b"/d\xfe"))
    save_file(small(2), os.fsdecode(bytes(src) + b"/d\xfe/y.safetensors"))
    save_file(small(3), str(src / "c.safetensors"))
    code, stdout, err = run_cli(capsys, "compress", src, arch, *EXACT, *INLINE, "--json")
    assert code == 0, err
    reason = "a name that is not UTF-8, which an archive cannot record"
    assert json.loads(stdout)["skipped"] == [
        {"name": "d\\udcfe/", "reason": reason},
        {"name": "x\\udcff.safetensors", "reason": reason},
    ]
    assert run_cli(capsys, "decompress", arch, out, *INLINE)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["c.safetensors"]
    for argv in (
        ("compress", os.fsdecode(bytes(src) + b"/x\xff.safetensors"), tmp_path / "one"),
        ("decompress", arch, os.fsdecode(bytes(tmp_path) + b"/o\xfe")),
    ):
        code, _, err = run_cli(capsys, *argv, *INLINE)
        assert (code, err.count("\n")) == (1, 1) and "is not UTF-8, which fp8ray cannot open: rename it" in err, err


def test_a_file_inside_a_hidden_or_escaping_folder_is_refused_from_a_manifest():
    from fp8ray.errors import CorruptArchiveError
    from fp8ray.io.records import checked_file_name

    assert checked_file_name("tenant_b/deep/t5.safetensors") == "tenant_b/deep/t5.safetensors"
    # Names a source may have: a store's chunk of a model served from ./models/x, ".tmp-" inside a name.
    for good in (".-SEP-models-SEP-x@0x01@0@ab01.data", "ab/.-SEP-m@0x01@0@ab01.data", "run.tmp-2.safetensors"):
        assert checked_file_name(good) == good
    temporary = ".t5.safetensors.tmp-" + "0123456789abcdef" * 2  # what fp8ray's writers name their files
    for bad in (
        "a/../../x.safetensors",
        "/etc/x.safetensors",
        "a//b.safetensors",
        ".git/x.safetensors",
        "a/./b",
        "a\\b",
        temporary,
        "\ud800x.safetensors",  # JSON's \ud800: decompress failed on it naming its own temporary folder
    ):
        with pytest.raises(CorruptArchiveError, match="not a plain relative file name"):
            checked_file_name(bad)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs a /sys nobody may write in")
def test_a_permission_error_names_the_output_typed_once(tree, tmp_path, capsys):
    arch = tmp_path / "arch"
    assert run_cli(capsys, "compress", tree / "req00.safetensors", arch, *INLINE)[0] == 0
    out = "/sys/kernel/fp8ray-restored.safetensors"  # not writable, even by root
    code, _, err = run_cli(capsys, "decompress", arch, out, *INLINE)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"fp8ray: error: cannot write output {out}: ") and ".tmp-" not in err
    reason = err.rstrip("\n").rpartition(": ")[2]
    assert reason in ("Operation not permitted", "Permission denied") and err.count(reason) == 1


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs a /sys nobody may write in")
def test_a_destination_it_may_not_create_is_named_once(tree, tmp_path, capsys):
    dst = "/sys/kernel/fp8ray-arch"
    code, _, err = run_cli(capsys, "compress", tree, dst, *INLINE)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"fp8ray: error: cannot write destination {dst}: ") and err.count(dst) == 1
    reason = err.rstrip("\n").rpartition(": ")[2]
    assert reason in ("Operation not permitted", "Permission denied") and err.count(reason) == 1


def test_an_unreadable_folder_of_a_source_is_named(tmp_path, capsys, monkeypatch):
    """`source srcu cannot be read: Permission denied` named the top folder, not the one
    that failed. (As root nothing is unreadable: the system's answer is stood in for.)"""
    src = tmp_path / "src"
    (src / "sub" / "deep").mkdir(parents=True)
    save_file({"k": torch.ones(4)}, str(src / "a.safetensors"))
    locked = str(src / "sub" / "deep")
    scandir = os.scandir

    def refusing(path="."):
        if os.path.normpath(str(path)) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    code, _, err = run_cli(capsys, "compress", src, tmp_path / "arch", *INLINE)
    assert (code, err) == (1, f"fp8ray: error: source {src} cannot be read (sub/deep): Permission denied\n")
