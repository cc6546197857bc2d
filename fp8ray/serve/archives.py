"""Which archives the service reads blocks from, and its open readers (no Serve).

The service reads archives only under the root directory it was started with
(``fp8ray serve --archives DIR``). A request names an archive by its path relative to
that root; a path that is absolute, or that resolves outside the root (``..``, or a
symbolic link pointing out), is refused before anything is opened, and an archive whose
manifest or a part is a symbolic link pointing out, before a block is read. Readers are opened
on the root itself (a ``SubTreeFileSystem``), so messages name the archive as the
request did, never the server's own paths.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import pyarrow.fs as pafs

from ..errors import RequestError
from ..io.archive import MANIFEST_NAME
from ..io.reader import ArchiveReader, open_archive

READERS_KEPT = 8  # open readers per replica: each keeps its manifest and the part indexes it read


class ArchiveRoot:
    """The archives under ``root`` (a local directory), and up to ``kept`` open readers,
    the least recently used closed first. Safe to use from several threads."""

    def __init__(self, root: str, kept: int = READERS_KEPT):
        self.root = os.path.realpath(root)
        self._fs = pafs.SubTreeFileSystem(self.root, pafs.LocalFileSystem())
        self._kept = kept
        self._readers: OrderedDict[tuple, ArchiveReader] = OrderedDict()
        self._lock = threading.Lock()

    def relative(self, archive: str | None) -> str:
        """The archive's normalised path below the root, or :class:`RequestError` (400 for
        a missing, empty or absolute path, 403 for one that resolves outside the root,
        404 for one that is not an archive), naming the parameter."""
        if not archive:
            raise RequestError("archive is required: an archive's path relative to the service's archives root", 400, "archive")
        if "\0" in archive or os.path.isabs(archive) or archive.startswith("~"):
            raise RequestError(f"archive {archive!r} must be a path relative to the archives root", 400, "archive")
        real = os.path.realpath(os.path.join(self.root, archive))  # ".." and symbolic links resolved
        if self._outside(real):
            raise RequestError(f"archive {archive!r} resolves outside the archives root", 403, "archive")
        inside = os.path.relpath(real, self.root)
        if not os.path.isfile(os.path.join(real, MANIFEST_NAME)):
            raise RequestError(f"no archive {archive!r} under the archives root", 404, "archive")
        return inside

    def _outside(self, real: str) -> bool:
        """Whether the resolved path ``real`` lies outside the root (the root itself is inside)."""
        return real != self.root and not real.startswith(self.root + os.sep)

    def _check_files_inside(self, archive: str, inside: str, names: list[str]) -> None:
        """Refuse (403) an archive whose manifest or a part is a symbolic link resolving
        outside the root: the folder inside it, its files read from elsewhere."""
        for name in names:
            if self._outside(os.path.realpath(os.path.join(self.root, inside, name))):
                raise RequestError(f"archive {archive!r}: its {name} resolves outside the archives root", 403, "archive")

    def reader(self, archive: str | None) -> ArchiveReader:
        """An open reader of ``archive`` (checked by :meth:`relative`), reused while kept."""
        inside = self.relative(archive)
        try:  # an archive replaced since (compress --overwrite) has a new manifest: open it again
            stat = os.stat(os.path.join(self.root, inside, MANIFEST_NAME))
        except OSError:
            raise RequestError(f"no archive {archive!r} under the archives root", 404, "archive") from None
        version = (inside, stat.st_mtime_ns, stat.st_size, stat.st_ino)
        with self._lock:
            reader = self._readers.pop(version, None)
            if reader is None:
                reader = open_archive(inside, filesystem=self._fs)
                self._check_files_inside(archive, inside, [MANIFEST_NAME, *(p.name for p in reader.manifest.parts)])
            self._readers[version] = reader  # most recently used last
            while len(self._readers) > self._kept:
                self._readers.popitem(last=False)
            return reader
