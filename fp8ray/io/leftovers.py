"""The scratch folders of runs killed outright, found and removed by the next run.

A command builds its output in a hidden folder beside it (``.NAME.tmp-<32 hex digits>``,
:func:`~fp8ray.io.paths.temporary_name`) and renames it into place when complete; on a
failure or an interrupt it removes the folder. Killed outright (SIGKILL, the OOM killer)
it can do neither, and the folder, up to the size of the output, stays hidden.

So, on a local filesystem, the process that makes a scratch folder marks it: a file
``MARK`` inside it, on which it holds an exclusive ``flock`` while it lives. The kernel
drops the lock when the process dies, however it dies. A later command writing the same
output removes the siblings whose mark it can lock: their writer is gone. The embedded
Ray's folder (``fp8ray-*`` in ``RAY_TMPDIR`` or ``/tmp``: its logs and sockets) is marked
and swept alike, by the next embedded start. A folder without a mark (another program's,
an older fp8ray's, an output set aside while it is being replaced) is never touched.
Object stores have no locks: nothing is swept there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from collections.abc import Callable

import pyarrow.fs as pafs

from .paths import counted, is_temporary, name_list, redact, size_text, temporary_prefix

MARK = ".fp8ray-writing"  # starts with ".": an archive's readers leave it alone while it is there


class ScratchMark:
    """This process's mark on a scratch folder it has just made (a no-op off the local
    filesystem). :meth:`release` before the folder is renamed into place; removing the
    folder removes the mark too."""

    def __init__(self, directory: str, fs: pafs.FileSystem | None = None):
        """``fs``: the filesystem ``directory`` is in (None: the local one)."""
        self._fd: int | None = None
        self._path = f"{directory}/{MARK}"
        if fs is not None and not isinstance(fs, pafs.LocalFileSystem):
            return
        # Locked under another name, then renamed: a sweeper never sees the mark unlocked.
        pending = f"{self._path}.{os.getpid()}"
        fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(pending, self._path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(pending)
            raise
        self._fd = fd

    def release(self) -> None:
        """Take the mark away (it must not reach the output) and drop the lock."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
        finally:
            os.close(fd)


def sweep_leftovers(fs: pafs.FileSystem, path: str, shown: str, announce: Callable[[str], None] | None = None) -> None:
    """Remove the scratch folders beside the output ``path`` (``shown`` as the user gave
    it) whose writer has died, telling ``announce`` what went."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return
    prefix = os.path.basename(temporary_prefix(path))
    swept = remove_dead(os.path.dirname(path) or ".", lambda name: name.startswith(prefix) and is_temporary(name))
    if swept and announce:
        size = sum(size for _, size in swept)
        announce(
            f"removed {counted(len(swept), 'scratch folder')} left beside {redact(shown)} by killed runs "
            f"({name_list([name for name, _ in swept])}; {size_text(size)})"
        )


def remove_dead(parent: str, wanted: Callable[[str], bool]) -> list[tuple[str, int]]:
    """Remove the marked folders in the local folder ``parent`` whose names are ``wanted``
    and whose mark nobody holds; returns each one's name and the bytes it held on disk."""
    try:
        names = [n for n in os.listdir(parent) if wanted(n)]
    except OSError:  # a parent not there yet, or not readable: the command says so itself
        return []
    removed = []
    for name in sorted(names):
        folder = os.path.join(parent, name)
        with contextlib.suppress(OSError):
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                continue
            fd = os.open(os.path.join(folder, MARK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: its writer runs
                size = _bytes_under(folder)
                shutil.rmtree(folder)
                removed.append((name, size))
            finally:
                os.close(fd)
    return removed


def _bytes_under(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total
