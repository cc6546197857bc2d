"""Where numba caches the compiled kernels, where it cannot choose for itself.

The kernels are compiled with ``@njit(cache=True)``, and numba raises ``RuntimeError``
("cannot cache function ...: no locator available") as the module is imported where it
can write neither beside the sources (``__pycache__`` of a read-only install: a
container image, another user's site-packages) nor in the user's cache folder
(``~/.cache/numba``: no home, or a read-only one). There every fp8ray command failed with
a traceback. This module, run as :mod:`fp8ray.codec` is imported (before numba), points
``NUMBA_CACHE_DIR`` at a folder of the system's temporary directory that only this user
can write (numba's cache index is a pickle: a folder another user could write would
run their code). It touches nothing where numba finds a place itself, or where
``NUMBA_CACHE_DIR`` is set already.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import sys
import tempfile

# The folders of fp8ray's numba-compiled sources, whose __pycache__ numba tries first.
_SOURCE_FOLDERS = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "kernels")]


def _writable(folder: str) -> bool:
    """Whether ``folder`` can be made and a file made in it: numba's own test
    (``_CacheLocator.ensure_cache_path``), which permissions alone cannot answer (root
    passes them on a read-only mount's folders and in ``/proc``)."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def _user_cache(environ) -> str:
    """numba's per-user cache folder on Linux (``numba.misc.appdirs.user_cache_dir``)."""
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.join(environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "numba")


def private_folder() -> str:
    """A folder under the temporary directory that only this user can write: the same one
    each run where it can be (the kernels compiled once), else a new one, removed as the
    process exits (one was left per run, on a host where another user held the name)."""
    parent = tempfile.gettempdir()
    folder = os.path.join(parent, f"fp8ray-numba-{os.getuid()}")
    if _kept_apart(parent) and _own(folder):
        return folder
    folder = tempfile.mkdtemp(prefix="fp8ray-numba-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _kept_apart(parent: str) -> bool:
    """Whether a folder of ours in ``parent`` stays ours: others may not write there, or it
    is sticky (else they could rename it away and put theirs in its place)."""
    mode = os.stat(parent).st_mode
    return not mode & 0o022 or bool(mode & stat.S_ISVTX)


def _own(folder: str) -> bool:
    """Whether ``folder`` is (made now, or found) a folder of this user's alone: not another
    user's, not a link, not one others can write."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    info = os.lstat(folder)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def choose_cache_folder(environ=os.environ, source_folders=_SOURCE_FOLDERS) -> str | None:
    """Set ``NUMBA_CACHE_DIR`` in ``environ`` (and in a numba already imported) where numba
    would find no folder of its own; returns the folder set, or None."""
    if environ.get("NUMBA_CACHE_DIR"):
        return None
    if all(_writable(os.path.join(f, "__pycache__")) for f in source_folders) or _writable(_user_cache(environ)):
        return None
    folder = private_folder()
    environ["NUMBA_CACHE_DIR"] = folder
    numba = sys.modules.get("numba")
    if numba is not None and environ is os.environ:  # imported before fp8ray: its configuration is read already
        numba.config.CACHE_DIR = folder
    return folder
