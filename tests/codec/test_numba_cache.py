"""numba's kernel cache where numba finds no folder of its own: a read-only install and
no writable home (a container's image, a service user) failed every command with numba's
"cannot cache function ...: no locator available" traceback."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fp8ray.codec.numba_cache import choose_cache_folder, private_folder

REPO = Path(__file__).resolve().parents[2]
NOWHERE = "/proc/fp8ray-nowhere"  # no folder can be made there, root included


def test_a_private_folder_is_chosen_only_where_numba_has_none(tmp_path):
    import numba

    before = numba.config.CACHE_DIR
    environ = {"HOME": NOWHERE}
    folder = choose_cache_folder(environ, [NOWHERE])
    assert environ["NUMBA_CACHE_DIR"] == folder
    assert before == numba.config.CACHE_DIR  # another environment than the process's: numba's own left alone
    info = os.lstat(folder)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and info.st_mode & 0o077 == 0
    # numba's own places, where it can write, and a folder the user named: left alone
    for environ, sources in (
        ({"HOME": str(tmp_path)}, [NOWHERE]),  # ~/.cache/numba
        ({"HOME": NOWHERE, "XDG_CACHE_HOME": str(tmp_path)}, [NOWHERE]),
        ({"HOME": NOWHERE}, [str(tmp_path)]),  # beside the sources
        ({"HOME": NOWHERE, "NUMBA_CACHE_DIR": "/mine"}, [NOWHERE]),
    ):
        before = dict(environ)
        assert choose_cache_folder(environ, sources) is None and environ == before


def test_a_folder_of_that_name_another_could_write_is_not_used(tmp_path, monkeypatch):
    """numba's cache index is a pickle: a folder group or others can write (or a link
    planted in a shared /tmp, or one in a temporary directory others can write that is
    not sticky, where they could swap it) would run their code."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    tmp_path.chmod(0o777)  # not sticky: a new folder each time
    assert Path(private_folder()).parent == tmp_path and Path(private_folder()) != Path(private_folder())
    assert not (tmp_path / f"fp8ray-numba-{os.getuid()}").exists()
    tmp_path.chmod(0o700)
    shared = tmp_path / f"fp8ray-numba-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    assert Path(private_folder()) != shared
    shutil.rmtree(shared)
    shared.symlink_to(tmp_path)
    assert Path(private_folder()) != shared
    shared.unlink()
    assert Path(private_folder()) == shared  # made here, this user's alone: kept across runs
    assert Path(private_folder()) == shared


def test_a_new_folder_goes_as_the_process_exits(tmp_path):
    """Where the kept folder cannot be used, each run made a new one and left it behind."""
    tmp_path.chmod(0o777)  # not sticky: a new folder
    code = (
        "import tempfile; from fp8ray.codec.numba_cache import private_folder; "
        f"tempfile.tempdir = {str(tmp_path)!r}; print(private_folder())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    made = Path(result.stdout.strip())
    assert made.parent == tmp_path and made.name.startswith("fp8ray-numba-") and not made.exists()


def test_a_read_only_install_without_a_home_runs_its_commands(tmp_path):
    """The real case: the repository bound read-only in a mount namespace of its own, HOME
    a folder nobody can write in."""
    bind = f"mount --bind {REPO} {REPO} && mount -o remount,bind,ro {REPO}"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", bind], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("needs unshare -m and mount (root, CAP_SYS_ADMIN)")
    code = "import torch; from fp8ray import Fp8Codec, decode; x = torch.ones(64); "
    code += "assert torch.equal(decode(Fp8Codec().encode(x)), x)"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | {"HOME": NOWHERE, "PYTHONPATH": str(REPO)}
    env.pop("XDG_CACHE_HOME", None)
    command = f'{bind} && exec "{sys.executable}" -c "{code}"'
    result = subprocess.run(["unshare", "-m", "sh", "-c", command], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
