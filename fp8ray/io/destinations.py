"""Where compress and decompress write: checked before any work, made ready, and undone
after a failure. Nothing here deletes what fp8ray did not write."""

from __future__ import annotations

import fcntl
import os
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from ..errors import ArchiveExistsError, DestinationError
from . import archive
from .paths import (
    check_not_special,
    entries,
    is_temporary,
    list_tree,
    name_list,
    os_reason,
    prepare_parent,
    redact,
    remove_folders,
    remove_quietly,
    resolve_output,
    temporary_name,
)
from .restore import RestorePlan


@dataclass
class ArchiveDestination:
    """Where a compress writes: ``path`` itself, or, when ``--overwrite`` replaces an
    existing archive, a scratch directory beside it that takes its place at the end."""

    fs: pafs.FileSystem
    path: str  # the destination
    work: str  # where the parts go
    created: bool  # whether this run creates ``work`` (:func:`make_work`), and so may remove it
    made: list[str] = field(default_factory=list)  # folders above it that --parents makes (deepest first)
    work_made: bool = False  # whether make_work made ``work``: only then is it this run's to remove

    @property
    def replacing(self) -> bool:
        return self.work != self.path


def prepare_destination(uri: str, resume: bool, overwrite: bool, parents: bool) -> ArchiveDestination:
    """Check the destination before any work, and say where the parts go (made by
    :func:`make_work`, inside the caller's clean-up: an interrupt as it is made must not
    leave it behind). Nothing there is deleted: ``--overwrite`` builds the new archive
    beside the old one."""
    fs, path = resolve_output(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        raise ArchiveExistsError(f"destination {redact(uri)} exists and is a file")
    if info.type == pafs.FileType.Directory:
        names = {e.base_name for e in fs.get_file_info(pafs.FileSelector(path))}
        if not names:
            return ArchiveDestination(fs, path, path, False)
        # Only what fp8ray wrote is ever replaced or resumed: a directory of the user's
        # own files is left alone, whatever the flags.
        ours = archive.MANIFEST_NAME in names or archive.PLAN_NAME in names
        if not ours:
            raise DestinationError(
                f"destination {redact(uri)} exists and is not empty, and is not an fp8ray archive: not writing into it"
            )
        if overwrite:
            # Replacing the archive deletes the whole directory: never what fp8ray did not write there.
            foreign = sorted(name for name in names if not archive.is_archive_entry(name))
            if foreign:
                raise DestinationError(
                    f"destination {redact(uri)} holds {entries(len(foreign))} beside the "
                    f"archive that fp8ray did not write ({name_list(foreign)}): --overwrite replaces only an archive; "
                    "move them out first"
                )
            return ArchiveDestination(fs, path, temporary_name(path), True)
        if archive.MANIFEST_NAME in names:
            raise ArchiveExistsError(f"destination {redact(uri)} already holds an archive (pass --overwrite to replace it)")
        if not resume:
            if _held(fs, path):  # its plan is a running compress's, not an interrupted one's
                raise ArchiveExistsError(BEING_WRITTEN.format(redact(uri)))
            raise ArchiveExistsError(
                f"destination {redact(uri)} holds an interrupted compress (pass --resume to continue, --overwrite to replace)"
            )
        return ArchiveDestination(fs, path, path, False)
    if isinstance(fs, pafs.LocalFileSystem) and os.path.islink(path):  # to nothing: the user's, not a place to write
        raise DestinationError(f"destination {redact(uri)} is a symbolic link to nothing: point it at a directory, or remove it")
    made = prepare_parent(fs, path, uri, parents)
    return ArchiveDestination(fs, path, path, True, made)


def make_work(dest: ArchiveDestination) -> None:
    """Make the directory the parts go into, where this run creates it: locally by
    ``mkdir``, which fails where one was made meanwhile (pyarrow's ``create_dir`` takes it
    as made, and a failed run then removed another's directory)."""
    if not dest.created:
        return
    dest.work_made = True  # before the call: an interrupt that lands as it returns leaves it ours to remove
    try:
        if isinstance(dest.fs, pafs.LocalFileSystem):
            os.mkdir(dest.work)
        else:
            dest.fs.create_dir(dest.work)
    except FileExistsError:  # made meanwhile, by another
        dest.work_made = False
        raise


BEING_WRITTEN = "destination {} is being written by another compress right now: not writing it too"


def _held(fs: pafs.FileSystem, path: str) -> bool:
    """Whether a running compress holds the local directory ``path`` (:func:`hold_destination`)."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@contextmanager
def hold_destination(dest: ArchiveDestination, uri: str) -> Iterator[None]:
    """This run's hold on the directory its parts go into, and on the one it replaces
    (``--overwrite``): an advisory lock on each, which the kernel drops when the process
    ends, however it ends. A second compress into the same directory at the same time is
    refused, not let to write the same parts; so is one that would replace it meanwhile
    (the first would go on writing, by path, into its replacement). Object stores have no
    such lock: there, one compress at a time is the caller's to keep."""
    if not isinstance(dest.fs, pafs.LocalFileSystem):
        yield
        return
    fds = []
    try:
        for directory in dict.fromkeys((dest.path, dest.work)):  # the same one unless replacing
            fds.append(os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            try:
                fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ArchiveExistsError(BEING_WRITTEN.format(redact(uri))) from None
        # One that held it between this run's look at the directory and now may have finished.
        if not dest.replacing and dest.fs.get_file_info(f"{dest.work}/{archive.MANIFEST_NAME}").type != pafs.FileType.NotFound:
            raise ArchiveExistsError(f"destination {redact(uri)} now holds an archive another compress has just written")
        yield
    finally:
        for fd in fds:
            os.close(fd)


def remove_created(dest: ArchiveDestination) -> None:
    """Remove, quietly, the directory this run created and the folders --parents made
    for it: a failed run leaves the destination as it found it."""
    if dest.work_made:
        remove_quietly(dest.fs, dest.work)
    remove_folders(dest.made)


def undo_compress(dest: ArchiveDestination, todo: list[int]) -> None:
    """After a run in which no part finished before the failure, remove what it wrote
    (parts that ended while the run settled are its too): a directory it created goes
    whole; in one it found, its parts and the scratch files go. Quietly: an error here
    must not hide the one that caused it."""
    if dest.created:
        remove_created(dest)
        return
    ours = {archive.part_name(i) for i in todo}
    try:
        found = dest.fs.get_file_info(pafs.FileSelector(dest.work))
    except OSError:
        return
    for entry in found:
        if entry.base_name in ours or archive.is_scratch(entry.base_name):
            try:
                dest.fs.delete_file(entry.path)
            except OSError:
                pass


def check_output(
    fs: pafs.FileSystem, path: str, uri: str, plan: RestorePlan, overwrite: bool, force_replace: bool, parents: bool
) -> tuple[list[str], list[str]]:
    """Refuse, before any work, an output decompress cannot write as asked. Returns what
    an existing output directory holds that the archive does not describe (to be
    replaced only with ``force_replace``), and the folders ``parents`` made for it."""
    wanted = "directory" if plan.container == "directory" else "file"
    if wanted == "file":
        if uri.endswith("/"):
            raise DestinationError(f"output {redact(uri)} names a directory, but the archive gives back one file: name the file")
        kind = plan.files[0].kind
        suffix = posixpath.splitext(path)[1]
        if suffix in (".safetensors", ".parquet") and suffix != f".{kind}":
            raise DestinationError(
                f"output {redact(uri)} ends in {suffix}, but the archive gives back a {kind} file "
                f"(name it .{kind}, or pass --single-file for one .safetensors file)"
            )
    check_not_special(fs, path, uri)
    kind = fs.get_file_info(path).type
    if kind == pafs.FileType.NotFound and isinstance(fs, pafs.LocalFileSystem) and os.path.islink(path):
        kind = pafs.FileType.File  # a symbolic link to nothing: the user's, replaced only with --overwrite
    if kind == pafs.FileType.NotFound:
        return [], prepare_parent(fs, path, uri, parents)
    have = "directory" if kind == pafs.FileType.Directory else "file"
    if have != wanted:  # whatever --overwrite says: name another output
        raise DestinationError(
            f"output {redact(uri)} is a {have}, and the archive gives back a {wanted}: not replacing it; name another output"
        )
    if not overwrite:
        raise ArchiveExistsError(f"output {redact(uri)} exists (pass --overwrite to replace it with the archive's {wanted})")
    if have == "file":
        return [], []
    described = {f.name for f in plan.files}
    try:
        foreign = [e.name for e in list_tree(fs, path) if not (e.kind == "file" and e.name in described)]
    except OSError as exc:
        raise DestinationError(f"output {redact(uri)} cannot be listed: {os_reason(exc)}") from None
    if foreign and not force_replace:
        raise DestinationError(
            f"output {redact(uri)} holds {entries(len(foreign))} the archive does not "
            f"describe ({name_list(foreign)}): --overwrite replaces only the archive's own files; "
            "pass --force-replace to delete them too"
        )
    return foreign, []


def clean_temporaries(fs: pafs.FileSystem, directory: str) -> None:
    """Remove the temporary files (:func:`~fp8ray.io.paths.is_temporary`) left under
    ``directory`` by writers that were killed mid-file; the files themselves were written again."""
    for entry in fs.get_file_info(pafs.FileSelector(directory, recursive=True)):
        if is_temporary(entry.base_name) and entry.type == pafs.FileType.File:
            fs.delete_file(entry.path)
