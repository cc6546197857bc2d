"""One compress at a time writes a directory: a second one, at the same moment, is refused
before it writes anything."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch
from safetensors.torch import save_file

from fp8ray import PoolSettings
from fp8ray.engine.archives import compress_archive
from fp8ray.errors import ArchiveExistsError
from fp8ray.io.destinations import hold_destination, make_work, prepare_destination


def test_a_compress_into_a_directory_another_one_holds_is_refused(tmp_path):
    src = tmp_path / "kv.safetensors"
    save_file({"k": torch.randn(4, 64).to(torch.bfloat16)}, str(src))
    dest = tmp_path / "arch"
    dest.mkdir()
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a compress running there holds it
        with pytest.raises(ArchiveExistsError, match="is being written by another compress right now"):
            compress_archive(str(src), str(dest), pool=PoolSettings(address="inline"))
        assert list(dest.iterdir()) == []
    finally:
        os.close(fd)
    assert compress_archive(str(src), str(dest), pool=PoolSettings(address="inline")).blocks == 1  # released: free


def test_a_running_compress_is_not_called_interrupted(tmp_path):
    """A second compress, started while the first ran (its plan written), was told the
    directory "holds an interrupted compress (pass --resume to continue, --overwrite to
    replace)": an --overwrite then would replace the first one's archive."""
    src = tmp_path / "kv.safetensors"
    save_file({"k": torch.randn(4, 64).to(torch.bfloat16)}, str(src))
    dest = tmp_path / "arch"
    dest.mkdir()
    (dest / "_plan.json").write_text("{}")  # the running one's plan
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ArchiveExistsError, match=r"^destination .*arch is being written by another compress right now"):
            compress_archive(str(src), str(dest), pool=PoolSettings(address="inline"))
    finally:
        os.close(fd)
    with pytest.raises(ArchiveExistsError, match="holds an interrupted compress"):  # once it is gone, it was interrupted
        compress_archive(str(src), str(dest), pool=PoolSettings(address="inline"))


def test_an_archive_being_written_is_not_replaced_by_an_overwrite_meanwhile(tmp_path):
    """--overwrite locked only its own new directory: it replaced the archive under a
    compress still running there, which then wrote its parts and manifest, by path, into
    the new archive (both exited 0; verify found damaged parts)."""
    src = tmp_path / "kv.safetensors"
    save_file({"k": torch.randn(4, 64).to(torch.bfloat16)}, str(src))
    dest = tmp_path / "arch"
    compress_archive(str(src), str(dest), pool=PoolSettings(address="inline"))
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a compress --resume (or another --overwrite's new archive) holds it
        with pytest.raises(ArchiveExistsError, match="is being written by another compress right now"):
            compress_archive(str(src), str(dest), overwrite=True, pool=PoolSettings(address="inline"))
    finally:
        os.close(fd)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch", "kv.safetensors"]  # its new directory is gone
    assert compress_archive(str(src), str(dest), overwrite=True, pool=PoolSettings(address="inline")).blocks == 1


def test_an_archive_finished_by_another_compress_meanwhile_is_not_written_over(tmp_path):
    dest = prepare_destination(str(tmp_path / "arch"), resume=False, overwrite=False, parents=False)
    make_work(dest)
    (tmp_path / "arch" / "_manifest.json").write_text("{}")  # the other one finished first
    with pytest.raises(ArchiveExistsError, match="now holds an archive another compress has just written"):
        with hold_destination(dest, str(tmp_path / "arch")):
            pass
