"""`fp8ray get`: one block of an archive to a .safetensors file, through the installed
command: the same tensor decompress gives, and every refusal in one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_one_line_errors import FP8RAY, assert_one_line, fp8ray

import fp8ray as fp8ray_api
from fp8ray.engine.archives import compress_archive, decompress_archive
from fp8ray.engine.pool import PoolSettings

FILES = ["a.safetensors", "deep/b.safetensors", "deep/c.safetensors"]
INLINE = PoolSettings(num_workers=1, address="inline")


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    """A three-file archive in several parts (the key ``shared`` in every file, ``onlyN``
    in one), and what decompress gives back of it, by file."""
    root = tmp_path_factory.mktemp("get")
    g = torch.Generator().manual_seed(3)
    for i, name in enumerate(FILES):
        (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "shared": torch.randn(2, 64, 128, generator=g).to(torch.bfloat16),
            f"only{i}": torch.randn(3, 50, generator=g).to([torch.float16, torch.float32, torch.bfloat16][i]),
        }
        save_file(tensors, str(root / "src" / name), metadata={"request": str(i)})
    compress_archive(str(root / "src"), str(root / "arch"), part_bytes=40_000, pool=INLINE)
    decompress_archive(str(root / "arch"), str(root / "out"), pool=INLINE)
    return root / "arch", {name: load_file(root / "out" / name) for name in FILES}


def test_every_block_gotten_equals_decompress(archive, tmp_path):
    arch, restored = archive
    for name, tensors in restored.items():
        for key, tensor in tensors.items():
            out = tmp_path / f"{name.replace('/', '_')}.{key}.safetensors"
            result = fp8ray("get", arch, key, "--file", name, "-o", out)
            assert result.returncode == 0, result.stderr
            with safe_open(str(out), "pt") as f:
                assert list(f.keys()) == [key] and f.metadata() == {"request": str(FILES.index(name))}
                got = f.get_tensor(key)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), (name, key)
    # A key in one file needs no --file; '-' writes the safetensors bytes to standard output.
    result = fp8ray("get", arch, "only2", "-o", tmp_path / "only2.safetensors")
    assert result.returncode == 0 and torch.equal(load_file(tmp_path / "only2.safetensors")["only2"], restored[FILES[2]]["only2"])
    piped = subprocess.run(
        [str(FP8RAY), "get", str(arch), "only1", "-o", "-"],
        capture_output=True,
        timeout=300,
        env=dict(os.environ, RAY_AUTH_MODE="disabled"),
    )
    assert piped.returncode == 0, piped.stderr
    (tmp_path / "only1.safetensors").write_bytes(piped.stdout)
    assert torch.equal(load_file(tmp_path / "only1.safetensors")["only1"], restored[FILES[1]]["only1"])


def test_a_block_of_a_version_1_archive_is_said_without_a_file(tmp_path):
    """Its one file has no name: "of ''" was said of it."""
    v1 = Path(__file__).resolve().parents[1] / "io" / "data" / "v1_archive"
    key = fp8ray_api.open_archive(str(v1)).keys()[0]
    result = fp8ray("get", v1, key, "-o", tmp_path / "one.safetensors")
    assert result.returncode == 0 and re.match(rf"^wrote '{re.escape(key)}' \(\w+ \[[\d, ]+\]\) to ", result.stdout), result


def test_standard_output_closed_is_refused_in_one_line(archive):
    """Started with stdout closed (``>&-``): an AttributeError traceback before."""
    arch, _ = archive
    closed = subprocess.run(
        f"{FP8RAY} get {arch} only1 -o - >&-",
        shell=True,
        capture_output=False,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        env=dict(os.environ, RAY_AUTH_MODE="disabled"),
    )
    assert closed.returncode == 1 and closed.stderr == "fp8ray: error: -o - writes to standard output, which is closed\n"


def test_a_full_standard_output_is_named(archive):
    """Behind `> /dev/full` the error said only "[Errno 28] No space left on device"."""
    arch, _ = archive
    full = subprocess.run(
        f"{FP8RAY} get {arch} only1 -o - > /dev/full",
        shell=True,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        env=dict(os.environ, RAY_AUTH_MODE="disabled"),
    )
    assert (full.returncode, full.stderr) == (
        1,
        "fp8ray: error: cannot write to standard output (-o -): No space left on device\n",
    )


@pytest.fixture(scope="module")
def large_block(tmp_path_factory):
    """An archive of one block of 2 MiB, larger than a pipe holds."""
    root = tmp_path_factory.mktemp("large")
    save_file({"big": torch.randn(1024, 1024).to(torch.bfloat16)}, str(root / "big.safetensors"))
    compress_archive(str(root / "big.safetensors"), str(root / "arch"), pool=INLINE)
    return root / "arch"


def unbuffered_bash(line: str) -> subprocess.CompletedProcess:
    """``line`` run by bash with Python unbuffered (PYTHONUNBUFFERED, as container images
    set it): where one write to standard output can be cut short without an error."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    return subprocess.run(line, shell=True, executable="/bin/bash", stderr=subprocess.PIPE, text=True, timeout=300, env=env)


def test_a_reader_that_leaves_early_is_not_a_whole_output(large_block):
    """One write of the body took what the pipe held and returned its count, without an
    error: get exited 0 with the rest never written."""
    piped = unbuffered_bash(f"set -o pipefail; {FP8RAY} get {large_block} big -o - | head -c 100 > /dev/null")
    assert (piped.returncode, piped.stderr) == (141, "")


def test_a_file_size_limit_on_standard_output_is_named(large_block, tmp_path):
    """Under `ulimit -f` the body was cut at the limit and get exited 0."""
    limited = unbuffered_bash(f"ulimit -f 1000; {FP8RAY} get {large_block} big -o - > {tmp_path / 'out.safetensors'}")
    assert (limited.returncode, limited.stderr) == (1, "fp8ray: error: cannot write to standard output (-o -): File too large\n")


def test_missing_and_ambiguous_keys_name_what_to_choose(archive, tmp_path):
    arch, _ = archive
    out = tmp_path / "x.safetensors"
    assert_one_line(
        fp8ray("get", arch, "nope", "--file", "deep/b.safetensors", "-o", out),
        "no block 'nope' in file 'deep/b.safetensors' of archive",
    )
    assert_one_line(
        fp8ray("get", arch, "only0", "--file", "deep/b.safetensors", "-o", out), "no block 'only0' in file 'deep/b.safetensors'"
    )
    assert_one_line(
        fp8ray("get", arch, "shared", "--file", "deep/d.safetensors", "-o", out), "holds no file 'deep/d.safetensors'"
    )
    assert_one_line(fp8ray("get", arch, "nope", "-o", out), "no block 'nope' in any file of archive")
    assert_one_line(
        fp8ray("get", arch, "shared", "-o", out),
        "key 'shared' is in 3 files",
        "a.safetensors, deep/b.safetensors, deep/c.safetensors",
        "name the file",
    )
    assert_one_line(fp8ray("get", tmp_path / "no-archive", "shared", "-o", out), "does not exist")
    assert not out.exists()
    # pyarrow's own words ("[Errno 36] Failed stat()ing path ... Detail: ...") once named the path twice
    (tmp_path / "afile").write_bytes(b"")
    long_name = tmp_path / ("x" * 300 + ".safetensors")
    assert_one_line(fp8ray("get", arch, "only0", "-o", long_name), f"cannot write output {long_name}: File name too long")
    nested = tmp_path / "afile" / "x" / "o.safetensors"
    assert_one_line(fp8ray("get", arch, "only0", "-o", nested, "--parents"), f"cannot write output {nested}: Not a directory")
    # With --parents the folders are made only for a block read: refusals left them behind.
    for args, said in (((tmp_path / "no-archive", "shared"), "does not exist"), ((arch, "shared"), "name the file")):
        assert_one_line(fp8ray("get", *args, "-o", tmp_path / "made" / "x.safetensors", "--parents"), said)
        assert not (tmp_path / "made").exists()


def test_an_existing_output_is_refused_without_overwrite(archive, tmp_path):
    arch, restored = archive
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"mine")
    assert_one_line(fp8ray("get", arch, "only0", "-o", out), f"output {out} exists (pass --overwrite to replace it)")
    assert out.read_bytes() == b"mine"
    assert_one_line(fp8ray("get", arch, "only0", "-o", tmp_path), "is a directory")
    assert_one_line(fp8ray("get", arch, "only0", "-o", arch / "x.safetensors"), "must not lie inside each other")
    assert_one_line(fp8ray("get", arch, "only0", "-o", tmp_path / "new" / "x.safetensors"), "pass --parents")
    assert fp8ray("get", arch, "only0", "-o", out, "--overwrite").returncode == 0
    assert torch.equal(load_file(out)["only0"], restored[FILES[0]]["only0"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]  # no temporary file left


def test_decompress_to_a_dash_is_refused_as_get_reads_it(archive, tmp_path):
    """`get -o -` writes to standard output; `decompress ARCHIVE -` wrote a file named '-'."""
    arch, _ = archive
    assert_one_line(fp8ray("decompress", arch, "-", "--address", "inline", cwd=tmp_path), "not standard output ('-')")
    assert list(tmp_path.iterdir()) == []


def test_get_loads_no_torch(archive, tmp_path):
    """A block is decoded to its bytes and written as such: torch is never imported."""
    arch, restored = archive
    out = tmp_path / "shared.safetensors"
    code = (
        "import sys\n"
        "from fp8ray.cli import main\n"
        f"status = main(['get', {str(arch)!r}, 'shared', '--file', 'deep/b.safetensors', '-o', {str(out)!r}])\n"
        "print(status, 'torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, RAY_AUTH_MODE="disabled"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["0", "False"], result.stdout[-2000:]
    assert torch.equal(load_file(out)["shared"], restored["deep/b.safetensors"]["shared"])


def _damage(arch, tmp_path, name: str, at: int):
    """A copy of ``arch`` with byte ``at`` of its first part flipped (negative: from its end)."""
    import shutil

    copy = tmp_path / name
    shutil.copytree(arch, copy)
    part = copy / "part-00000.parquet"
    data = bytearray(part.read_bytes())
    data[at] ^= 0x5A
    part.write_bytes(bytes(data))
    return copy


def test_a_damaged_footer_is_one_line_from_get_and_verify(archive, tmp_path):
    """A flipped byte in a part's Parquet footer: `get` refuses the block naming the part,
    `verify` names the part as damaged; exit 1, one line each, no traceback."""
    arch, _ = archive
    damaged = _damage(arch, tmp_path, "footer", -30)
    result = fp8ray("get", damaged, "shared", "--file", FILES[0], "-o", tmp_path / "x.safetensors")
    assert result.returncode == 1
    assert_one_line(result, "part-00000.parquet", "is damaged: its Parquet footer has crc32c")
    result = fp8ray("verify", damaged)
    problems = [line for line in result.stderr.splitlines() if "part-00000.parquet" in line]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(problems) == 1 and "is damaged" in problems[0], result.stderr


def test_verify_names_a_damaged_part_without_its_columns_in_one_line(archive, tmp_path):
    """An archive from before the footer CRC whose damaged part lost its key column:
    one problem line, no traceback."""
    import json

    import pyarrow.parquet as pq

    arch, _ = archive
    damaged = _damage(arch, tmp_path, "nokey", 0)
    part = damaged / "part-00000.parquet"
    pq.write_table(pq.read_table(arch / "part-00000.parquet").drop_columns(["key"]), part)
    manifest = json.loads((damaged / "_manifest.json").read_text())
    for entry in manifest["parts"]:
        entry.pop("footer_crc32c"), entry.pop("columns_crc32c")
    manifest["parts"][0]["file_bytes"] = part.stat().st_size
    manifest["archive_bytes"] = sum(entry["file_bytes"] for entry in manifest["parts"])
    (damaged / "_manifest.json").write_text(json.dumps(manifest))
    result = fp8ray("verify", damaged)
    problems = [line for line in result.stderr.splitlines() if "part-00000.parquet" in line]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(problems) == 1 and "is damaged" in problems[0], result.stderr
    result = fp8ray("get", damaged, "shared", "--file", FILES[0], "-o", tmp_path / "x.safetensors")
    assert_one_line(result, "part-00000.parquet", "is damaged: it has no 'key' column")


def test_standard_output_on_a_terminal_is_refused(archive):
    """128 KiB of binary went to the terminal, as gzip and zstd refuse to do."""
    import pty

    arch, _ = archive
    leader, follower = pty.openpty()
    try:
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        done = subprocess.run(
            [str(FP8RAY), "get", str(arch), "only1", "-o", "-"],
            stdout=follower,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=300,
        )
    finally:
        os.close(follower)
        os.close(leader)
    said = "fp8ray: error: -o - writes a safetensors file's bytes, and standard output is a terminal: redirect or pipe it\n"
    assert (done.returncode, done.stderr) == (1, said)
