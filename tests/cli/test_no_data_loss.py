"""Nothing of the user's is lost: no command writes over what it reads, a failed run
leaves the destination as it found it, and --overwrite replaces only with a complete
result. Through the fp8ray command, in-process on the session Ray."""

from __future__ import annotations

import builtins
import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from _util import no_space
from safetensors.torch import save_file

import fp8ray
import fp8ray.io.archive
import fp8ray.io.safetensors
import fp8ray.lmcache.store_files
from fp8ray.cli import main
from fp8ray.errors import SourceError
from fp8ray.io.lmcache_store import ChunkName, format_chunk_name

pytestmark = pytest.mark.usefixtures("ray_session")


def run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    return code, err


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def kvdir(kv_source, tmp_path) -> Path:
    src, _ = kv_source
    d = tmp_path / "kvdir"
    d.mkdir()
    shutil.copy(src, d / "a.safetensors")
    return d


def test_compress_over_its_own_source_is_refused_before_anything(kvdir, tmp_path, capsys):
    k2 = tmp_path / "k2"
    shutil.copytree(kvdir, k2)  # cp -r kvdir k2 && fp8ray compress k2 k2 --overwrite
    before = digests(k2)
    code, err = run(capsys, "compress", k2, k2, "--overwrite")
    assert code == 1 and err.count("\n") == 1 and "is the source" in err
    assert digests(k2) == before


def test_compress_into_a_folder_holding_the_source_is_refused(kvdir, tmp_path, capsys):
    nest = tmp_path / "nest"
    shutil.copytree(kvdir, nest / "src")
    before = digests(nest)
    code, err = run(capsys, "compress", nest / "src", nest, "--overwrite")
    assert code == 1 and "must not lie inside each other" in err
    (tmp_path / "alias").symlink_to(nest / "src")  # through a symbolic link too
    code, err = run(capsys, "compress", nest / "src", tmp_path / "alias", "--overwrite")
    assert code == 1 and "is the source" in err
    assert digests(nest) == before


def test_overwrite_replaces_only_an_archive(kvdir, tmp_path, capsys):
    docs = tmp_path / "mydocs"
    docs.mkdir()
    (docs / "thesis.txt").write_text("years of work")
    for flags in ((), ("--overwrite",), ("--resume",)):
        code, err = run(capsys, "compress", kvdir, docs, *flags)
        assert code == 1 and "is not an fp8ray archive: not writing into it" in err, err
    assert [p.name for p in docs.iterdir()] == ["thesis.txt"] and (docs / "thesis.txt").read_text() == "years of work"


def test_overwrite_keeps_what_the_user_put_beside_an_archive(kvdir, tmp_path, capsys):
    """Replacing an archive deletes its directory: one that also holds the user's files
    (notes, results) is refused, naming them, and left as it was."""
    arch = tmp_path / "arch"
    assert run(capsys, "compress", kvdir, arch, "--address", "inline")[0] == 0
    (arch / "NOTES.md").write_text("my notes")
    (arch / "results").mkdir()
    (arch / "results" / "eval.json").write_text("1")
    before = digests(arch)
    code, err = run(capsys, "compress", kvdir, arch, "--overwrite", "--address", "inline", "--scaling", "token")
    assert code == 1 and err.count("\n") == 1, err
    assert "holds 2 entries beside the archive that fp8ray did not write (NOTES.md, results)" in err, err
    assert digests(arch) == before
    (arch / "NOTES.md").unlink()
    shutil.rmtree(arch / "results")
    assert run(capsys, "compress", kvdir, arch, "--overwrite", "--address", "inline", "--scaling", "token")[0] == 0
    assert sorted(p.name for p in arch.iterdir()) == ["_manifest.json", "part-00000.parquet"]


def test_decompress_into_its_archive_is_refused(kvdir, tmp_path, capsys):
    arch = tmp_path / "arch"
    assert run(capsys, "compress", kvdir, arch)[0] == 0
    before = digests(arch)
    code, err = run(capsys, "decompress", arch, arch / "back", "--overwrite")
    assert code == 1 and "inside each other" in err
    code, err = run(capsys, "decompress", arch, arch, "--overwrite")
    assert code == 1 and "is the source" in err
    assert digests(arch) == before


@pytest.fixture
def nan_source(tmp_path) -> Path:
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    x[2, 7] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_file({"a": torch.ones(4, 64, dtype=torch.bfloat16), "b": x}, str(path))
    return path


def test_a_failed_compress_leaves_the_destination_as_it_found_it(nan_source, tmp_path, capsys):
    dst = tmp_path / "dst"
    code, err = run(capsys, "compress", nan_source, dst, "--part-mb", "100")
    assert code == 1 and "non-finite" in err and not dst.exists()
    code, err = run(capsys, "compress", nan_source, dst)  # the same command again: the same error, not "exists"
    assert code == 1 and "non-finite" in err and not dst.exists()
    dst.mkdir()
    code, err = run(capsys, "compress", nan_source, dst)
    assert code == 1 and list(dst.iterdir()) == []


def test_a_failed_overwrite_keeps_the_old_archive(kv_source, nan_source, tmp_path, capsys):
    src, _ = kv_source
    arch = tmp_path / "arch"
    assert run(capsys, "compress", src, arch)[0] == 0
    before = digests(arch)
    code, err = run(capsys, "compress", nan_source, arch, "--overwrite")
    assert code == 1 and "non-finite" in err
    assert digests(arch) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert run(capsys, "compress", nan_source, arch, "--overwrite", "--nonfinite", "keep")[0] == 0
    assert digests(arch) != before and (arch / "_manifest.json").exists()


def test_a_full_disk_mid_compress_names_the_destination_and_what_resume_keeps(tmp_path, capsys, monkeypatch):
    """A part's write that fails (ENOSPC) was pyarrow's "[Errno 28] Error writing bytes to
    file. Detail: ...", naming neither the archive nor what was left of the run."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):  # a part each
        save_file(
            {"kv": torch.randn(2, 512, 512, generator=torch.Generator().manual_seed(i)).bfloat16()}, str(src / f"{i}.safetensors")
        )
    write_atomic = fp8ray.io.archive.write_atomic

    def full_from_part_2(fs, path, data):
        if "part-00002" in path:
            no_space()
        write_atomic(fs, path, data)

    arch = tmp_path / "arch"
    one_worker = ["--part-mb", "1", "--address", "inline", "--workers", "1"]
    monkeypatch.setattr(fp8ray.io.archive, "write_atomic", full_from_part_2)
    code, err = run(capsys, "compress", src, arch, *one_worker)
    assert code == 1 and err.count("\n") == 1, err
    # Parts 0 and 1, and any call already queued when part 2 failed: what --resume keeps.
    done = len(list(arch.glob("_part-*.json")))
    assert done >= 2 and not (arch / "_part-00002.json").exists()
    left = f"{done} of 4 parts done: rerun with --resume to keep them"
    assert err == f"fp8ray: error: cannot write destination {arch} (part-00002.parquet: No space left on device); {left}\n"
    monkeypatch.undo()
    code = main([str(a) for a in ["compress", src, arch, *one_worker, "--resume"]])
    out, _ = capsys.readouterr()
    assert code == 0 and (arch / "_manifest.json").exists() and f"({done} reused)" in out

    # A part whose sidecar cannot be written goes too: --resume would write it again beside it.
    def full_at_sidecar_1(fs, path, data):
        if "_part-00001.json" in path:
            no_space()
        write_atomic(fs, path, data)

    monkeypatch.setattr(fp8ray.io.archive, "write_atomic", full_at_sidecar_1)
    code, err = run(capsys, "compress", src, tmp_path / "arch2", *one_worker)
    assert code == 1 and "_part-00001.json: No space left on device" in err, err
    assert not (tmp_path / "arch2" / "part-00001.parquet").exists() and (tmp_path / "arch2" / "part-00000.parquet").exists()
    # No part done: the folders --parents made go with the archive's directory.
    monkeypatch.setattr(fp8ray.io.archive, "write_atomic", no_space)
    code, err = run(capsys, "compress", src, tmp_path / "made" / "deep" / "arch", *one_worker, "--parents")
    assert code == 1 and "No space left on device" in err and not (tmp_path / "made").exists(), err


def test_a_source_file_unreadable_mid_compress_says_what_resume_keeps(tmp_path):
    """A source file that cannot be read mid-run (moved away for a while, a network
    filesystem gone) ended the run in one line that left out the finished parts it kept;
    once the file is back as it was, --resume keeps them."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):  # a part each
        save_file({"kv": torch.full((2, 512, 512), float(i)).bfloat16()}, str(src / f"{i}.safetensors"))
    calls = []

    def progress(blocks):
        calls.append(blocks)
        if len(calls) == 2:  # part 0 done (the first call counts the parts resumed)
            os.rename(src / "2.safetensors", tmp_path / "away")

    arch = tmp_path / "arch"
    one_worker = fp8ray.PoolSettings(num_workers=1, address="inline")
    with pytest.raises(SourceError) as failed:
        fp8ray.compress_archive(str(src), str(arch), part_bytes=2**20, pool=one_worker, progress=progress)
    done = len(list(arch.glob("_part-*.json")))
    assert done >= 1 and not (arch / "_part-00002.json").exists()
    assert str(failed.value) == (
        f"source file {src / '2.safetensors'} cannot be read: No such file or directory; {done} of 4 parts done: "
        "rerun with --resume to keep them"
    )
    os.rename(tmp_path / "away", src / "2.safetensors")  # the same size and time: as it was
    report = fp8ray.compress_archive(str(src), str(arch), part_bytes=2**20, pool=one_worker, resume=True)
    assert report.parts_reused == done and fp8ray.verify_archive(str(arch), against=str(src), pool=one_worker).ok


def appeared(output) -> str:
    return f"fp8ray: error: output {output} appeared while this command ran: not replacing it\n"


def one_chunk_store(tmp_path) -> tuple[Path, str]:
    """An LMCache store of one bfloat16 chunk of the layout 2,2,16,64, and the chunk's name."""
    store = tmp_path / "store"
    store.mkdir()
    name = format_chunk_name(ChunkName("m", 0, 0, b"\x01"))
    (store / name).write_bytes(torch.randn(2, 2, 16, 64).bfloat16().view(torch.uint8).numpy().tobytes())
    return store, name


def test_a_full_disk_under_get_and_a_store_conversion_names_the_output(kvdir, tmp_path, capsys, monkeypatch):
    """Both said pyarrow's or Python's words for it: get "[Errno 28] Error writing bytes to
    file...", lmcache-compress "block 'm@...data' (raw -> fp8 of <the source's file>): [Errno
    28] ...", as if the source's file were at fault."""
    arch = tmp_path / "arch"
    assert run(capsys, "compress", kvdir / "a.safetensors", arch, "--address", "inline")[0] == 0
    key = fp8ray.open_archive(str(arch)).keys()[0]
    store, name = one_chunk_store(tmp_path)
    monkeypatch.setattr(fp8ray.io.safetensors.SafetensorsWriter, "write", no_space)

    def open_for_reading_only(path, mode="r", *args, **kwargs):
        return no_space() if "w" in mode else builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(fp8ray.lmcache.store_files, "open", open_for_reading_only, raising=False)
    out = tmp_path / "k.safetensors"
    assert run(capsys, "get", arch, key, "-o", out) == (1, f"fp8ray: error: cannot write output {out}: No space left on device\n")
    out = tmp_path / "made" / "deep" / "k.safetensors"  # the folders --parents made go too
    said = f"fp8ray: error: cannot write output {out}: No space left on device\n"
    assert run(capsys, "get", arch, key, "-o", out, "--parents") == (1, said)
    fp8 = tmp_path / "made" / "fp8"
    code, err = run(capsys, "lmcache-compress", store, fp8, "--layout", "bfloat16:2,2,16,64", "--address", "inline", "--parents")
    expected = f"cannot write destination {fp8} ({name}: No space left on device)"
    assert (code, err) == (1, f"fp8ray: error: {expected}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch", "kvdir", "store"]  # no temporary left either


def test_missing_parent_directories_are_named_not_created(kv_source, tmp_path, capsys):
    src, _ = kv_source
    code, err = run(capsys, "compress", src, tmp_path / "no" / "such" / "arch")
    assert code == 1 and f"directory {tmp_path / 'no' / 'such'} does not exist" in err, err
    store = tmp_path / "store"
    store.mkdir()
    code, err = run(capsys, "lmcache-compress", store, tmp_path / "no" / "such" / "fp8", "--layout", "bfloat16:2,2,16,64")
    assert code == 1 and f"directory {tmp_path / 'no' / 'such'} does not exist" in err, err
    assert not (tmp_path / "no").exists()
    assert run(capsys, "compress", src, tmp_path / "no" / "such" / "arch", "--parents")[0] == 0
    arch = tmp_path / "no" / "such" / "arch"
    code, err = run(capsys, "decompress", arch, tmp_path / "gone" / "out.safetensors")
    assert code == 1 and "does not exist" in err and not (tmp_path / "gone").exists()


def test_a_symbolic_link_to_nothing_at_the_output_is_replaced_only_with_overwrite(kvdir, tmp_path, capsys):
    """get took a link to nothing for no output, ran, and then said the output "appeared
    while this command ran"; decompress refused it up front, as get does now."""
    from fp8ray import open_archive

    arch = tmp_path / "arch"
    assert run(capsys, "compress", kvdir / "a.safetensors", arch, "--address", "inline")[0] == 0
    key = next(iter(open_archive(str(arch)).keys()))
    for name, argv in (("out.safetensors", ("decompress", arch)), ("got.safetensors", ("get", arch, key, "-o"))):
        out = tmp_path / name
        out.symlink_to(tmp_path / "nowhere")
        code, err = run(capsys, *argv, out, *(("--address", "inline") if argv[0] == "decompress" else ()))
        assert code == 1 and "exists (pass --overwrite" in err and out.is_symlink(), err
        assert run(capsys, *argv, out, "--overwrite", *(("--address", "inline") if argv[0] == "decompress" else ()))[0] == 0
        assert not out.is_symlink() and out.stat().st_size > 0


def test_overwrite_through_a_symbolic_link_replaces_what_it_points_to(kvdir, tmp_path, capsys):
    """A link to an archive, or to a decompressed file: --overwrite put the new output in
    the link's place (on the link's filesystem) and left the old one where it pointed."""
    from fp8ray import open_archive

    inline = ("--address", "inline")
    real, link = tmp_path / "disk" / "arch", tmp_path / "arch"
    real.parent.mkdir()
    assert run(capsys, "compress", kvdir, real, *inline)[0] == 0
    link.symlink_to(real)
    assert run(capsys, "compress", kvdir, link, "--overwrite", "--scaling", "token", *inline)[0] == 0
    assert link.is_symlink() and open_archive(str(real)).manifest.codec["scaling"] == "token"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch", "disk", "kvdir"]
    out_real, out_link = tmp_path / "disk" / "out", tmp_path / "out"
    assert run(capsys, "decompress", real, out_real, *inline)[0] == 0
    out_link.symlink_to(out_real)
    (out_real / "a.safetensors").write_bytes(b"stale")
    assert run(capsys, "decompress", real, out_link, "--overwrite", *inline)[0] == 0
    assert out_link.is_symlink() and (out_real / "a.safetensors").stat().st_size > 5
    key = next(iter(open_archive(str(real)).keys()))
    got_real, got_link = tmp_path / "disk" / "got.safetensors", tmp_path / "got.safetensors"
    got_real.write_bytes(b"stale")
    got_link.symlink_to(got_real)
    assert run(capsys, "get", real, key, "-o", got_link, "--overwrite")[0] == 0
    assert got_link.is_symlink() and got_real.stat().st_size > 5


def test_compress_to_a_symbolic_link_to_nothing_keeps_the_link(kvdir, tmp_path, capsys):
    """The link was taken for no destination: making the directory failed ("File exists")
    and the clean-up then deleted the user's link."""
    link = tmp_path / "arch"
    link.symlink_to(tmp_path / "nowhere")
    for flags in ((), ("--overwrite",)):
        code, err = run(capsys, "compress", kvdir, link, "--address", "inline", *flags)
        assert code == 1 and "is a symbolic link to nothing" in err and link.is_symlink(), err


def test_parents_that_cannot_all_be_made_are_taken_away(kvdir, tmp_path, capsys):
    """A name too long for the filesystem: the folders above it were made, then left."""
    from fp8ray import open_archive

    arch = tmp_path / "arch"
    assert run(capsys, "compress", kvdir, arch, "--address", "inline")[0] == 0
    key = next(iter(open_archive(str(arch)).keys()))
    long = "x" * 300
    for argv in (
        ("compress", kvdir, tmp_path / "made" / long / "arch", "--address", "inline"),
        ("decompress", arch, tmp_path / "made" / long / "out", "--address", "inline"),
        ("get", arch, key, "-o", tmp_path / "made" / long / "k.safetensors"),
    ):
        code, err = run(capsys, *argv, "--parents")
        assert code == 1 and "File name too long" in err and not (tmp_path / "made").exists(), (argv[0], err)


def test_overwrite_never_puts_a_file_in_place_of_a_fifo_or_a_device(kvdir, tmp_path, capsys):
    """An output that is a FIFO, or a link to a device (/dev/null), is refused even with
    --overwrite: the output's rename would put a plain file in its place."""
    import os
    import stat

    from fp8ray import open_archive

    arch = tmp_path / "arch"
    assert run(capsys, "compress", kvdir / "a.safetensors", arch, "--address", "inline")[0] == 0
    key = next(iter(open_archive(str(arch)).keys()))
    fifo, null = tmp_path / "fifo", tmp_path / "null"
    os.mkfifo(fifo)
    null.symlink_to("/dev/null")
    for output, kind in ((fifo, "a FIFO"), (null, "a character device")):
        refusal = f"fp8ray: error: output {output} is {kind}, not a file: fp8ray writes files only, and never replaces one\n"
        for argv in (("decompress", arch, output, "--address", "inline"), ("get", arch, key, "-o", output)):
            assert run(capsys, *argv, "--overwrite") == (1, refusal)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.readlink(null) == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_an_output_made_while_a_command_runs_is_never_replaced(kvdir, tmp_path, capsys, monkeypatch):
    """Another command (or the user) puts a file or a directory at the output after this
    one checked it: it stays as it is, and the refusal says why; with --overwrite too,
    which replaces only an output there when the command checked it (decompress
    --overwrite deleted a directory of the user's made meanwhile, past --force-replace)."""
    from fp8ray import PoolSettings, decompress_archive, open_archive
    from fp8ray.errors import ArchiveExistsError

    arch = tmp_path / "arch"
    assert run(capsys, "compress", kvdir, arch, "--address", "inline")[0] == 0
    inline = PoolSettings(address="inline")
    for output, single_file, make, overwrite in (
        (tmp_path / "one.safetensors", True, lambda p: p.write_bytes(b"theirs"), False),
        (tmp_path / "tree", False, lambda p: (p.mkdir(), (p / "a.safetensors").write_bytes(b"theirs")), False),
        (tmp_path / "two.safetensors", True, lambda p: p.write_bytes(b"theirs"), True),
        (tmp_path / "docs", False, lambda p: (p.mkdir(), (p / "a.safetensors").write_bytes(b"theirs")), True),
    ):

        def meanwhile(_blocks, output=output, make=make):
            if not output.exists():
                make(output)

        with pytest.raises(ArchiveExistsError, match=f"output {output} appeared while this command ran: not replacing it"):
            decompress_archive(
                str(arch), str(output), single_file=single_file, overwrite=overwrite, progress=meanwhile, pool=inline
            )
        theirs = output if single_file else output / "a.safetensors"
        assert theirs.read_bytes() == b"theirs"
        assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "a temporary left behind"

    # get: the file appears as the block is written.
    key = next(iter(open_archive(str(arch)).keys()))
    out = tmp_path / "got.safetensors"
    write = fp8ray.io.safetensors.SafetensorsWriter.write

    def write_meanwhile(self, data):
        out.write_bytes(b"theirs")
        return write(self, data)

    monkeypatch.setattr(fp8ray.io.safetensors.SafetensorsWriter, "write", write_meanwhile)
    code, err = run(capsys, "get", arch, key, "-o", out)
    assert (code, err) == (1, appeared(out))
    assert out.read_bytes() == b"theirs" and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert run(capsys, "get", arch, key, "-o", out, "--overwrite")[0] == 0 and out.read_bytes() != b"theirs"


def test_a_store_made_while_lmcache_compress_runs_is_never_replaced(tmp_path, capsys, monkeypatch):
    from fp8ray.engine import stores

    (store, _), out = one_chunk_store(tmp_path), tmp_path / "fp8"
    replace = stores.replace_directory

    def made_meanwhile(*args, **kwargs):
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")
        return replace(*args, **kwargs)

    monkeypatch.setattr(stores, "replace_directory", made_meanwhile)
    code, err = run(capsys, "lmcache-compress", store, out, "--layout", "bfloat16:2,2,16,64", "--address", "inline")
    assert (code, err) == (1, appeared(out))
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_parts_written_where_this_process_does_not_see_them_get_no_manifest(kvdir, tmp_path, capsys, monkeypatch):
    """On a cluster a worker on another node writes a local destination on its own disk:
    compress said "compressed ... into 1 part", exit 0, and wrote a manifest over no part.
    Here a worker whose part lands elsewhere (moved away as it is written), on a node."""
    import dataclasses

    from fp8ray.engine.worker import QuantWorker

    elsewhere = tmp_path / "other-node-disk"
    elsewhere.mkdir()
    write_part = QuantWorker.compress_part

    def on_another_node(self, blocks, codec, directory, index, lossless):
        result = write_part(self, blocks, codec, directory, index, lossless)
        shutil.move(Path(directory) / result.info.name, elsewhere / result.info.name)
        return dataclasses.replace(result, node_id="another-node")

    on_another_node.__name__ = "compress_part"  # the pool runs QuantWorker's own methods, by name
    monkeypatch.setattr(QuantWorker, "compress_part", on_another_node)
    arch = tmp_path / "arch"
    code, err = run(capsys, "compress", kvdir, arch, "--address", "inline")
    assert code == 1 and err.startswith("fp8ray: error: 1 part the workers wrote (part-00000.parquet) not in "), err
    assert "the workers ran on 1 Ray node: on a cluster, a local path must be on storage every node mounts" in err
    assert err.rstrip().endswith("no manifest was written") and not (arch / "_manifest.json").exists()
