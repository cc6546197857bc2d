"""Paths and URIs: local paths or any filesystem ``pyarrow.fs`` knows (``s3://...``),
credentials kept out of messages, and files that appear only when complete."""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import stat
import time
import uuid
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit

import pyarrow.fs as pafs

from ..errors import ArchiveExistsError, BadInputError, DestinationError, Fp8rayError

# pyarrow's GCS client retries a failing call for 15 minutes, inside native code where
# neither Ctrl-C nor SIGTERM can land: fp8ray's gs:// calls give up after this long
# (``?retry_limit_seconds=N`` in the URI sets another).
GCS_RETRY_LIMIT_S = 30


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """A filesystem and path for a local path or a URI such as ``s3://bucket/key``."""
    if isinstance(uri, str) and not uri:  # abspath("") is the working directory, named "" in every message
        raise BadInputError("a path is empty: name a file or directory ('.' for the working directory)", field="path")
    if "://" in uri:
        parts = urlsplit(uri)
        # pyarrow drops both silently: the data would go to another path than the one typed
        if parts.fragment or (parts.scheme == "file" and parts.query):
            raise BadInputError(
                f"{redact(uri)}: a {'#fragment' if parts.fragment else '?query'} names no file "
                "(a local path may hold '#' and '?': give it without file://)",
                field="path",
            )
        if parts.scheme in ("gs", "gcs") and "retry_limit_seconds" not in parse_qs(parts.query):
            query = "&".join(filter(None, [parts.query, f"retry_limit_seconds={GCS_RETRY_LIMIT_S}"]))
            uri = urlunsplit(parts._replace(query=query))
        return pafs.FileSystem.from_uri(uri)
    try:
        path = os.path.abspath(uri)
    except FileNotFoundError:  # a relative path, from a working directory deleted since: os.getcwd()
        raise BadInputError(
            f"path {printable(uri)} is relative to the working directory, which no longer exists: "
            "cd to one that does, or give an absolute path",
            field="path",
        ) from None
    if not is_utf8(path):  # pyarrow's filesystems take UTF-8 paths only (its own error names no path)
        raise BadInputError(f"path {printable(path)} is not UTF-8, which fp8ray cannot open: rename it", field="path")
    return pafs.LocalFileSystem(), path


def write_all(stream, data) -> None:
    """Write all of ``data`` to ``stream``: an unbuffered one (``PYTHONUNBUFFERED``, ``-u``)
    writes what a pipe has room for and says how much, without an error (a reader that
    then leaves makes the next write raise); a non-blocking one says None while full."""
    import select

    view = memoryview(data).cast("B")
    while view:
        written = stream.write(view)
        if written is None:
            select.select([], [stream], [])
            continue
        view = view[written:]


def resolve_output(uri: str) -> tuple[pafs.FileSystem, str]:
    """:func:`resolve` of an output, through a symbolic link to something that exists: the
    output is written where the link points, as without ``--overwrite``, whose renames had
    put the new output in the link's place (on the link's filesystem) and left the old one
    where it was. A link to nothing stays itself (replaced only with ``--overwrite``)."""
    fs, path = resolve(uri)
    if isinstance(fs, pafs.LocalFileSystem) and os.path.islink(path) and os.path.exists(path):
        return fs, os.path.realpath(path)
    return fs, path


def uri_for(uri: str, path: str) -> str:
    """The URI of ``path`` on the filesystem ``uri`` names, keeping its scheme, credentials
    and options (``?endpoint_override=...``), so a worker's ``resolve`` finds the same file."""
    if "://" not in uri:
        return path
    parts = urlsplit(uri)
    if parts.scheme in ("s3", "gs", "gcs"):  # pyarrow's path is "bucket/key"
        userinfo, _, _ = parts.netloc.rpartition("@")
        bucket, _, key = path.partition("/")
        # pyarrow decodes %XX in a URI's path: a key holding '%', ' ', '?' or '#' must be quoted.
        return urlunsplit(
            (parts.scheme, f"{userinfo}@{bucket}" if userinfo else bucket, "/" + quote(key, safe="/"), parts.query, "")
        )
    return urlunsplit((parts.scheme, parts.netloc, "/" + quote(path.lstrip("/"), safe="/"), parts.query, ""))


def as_uri(value, what: str) -> str:
    """A path or URI argument as a string: a ``str``, or an ``os.PathLike`` (a
    ``pathlib.Path``) as its string; anything else is refused naming ``what`` it was for."""
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a path or URI (a str or os.PathLike), got {type(value).__name__}")
    return value


def redact(uri: str) -> str:
    """``uri`` as messages show it: without credentials (``s3://key:secret@bucket`` ->
    ``s3://***@bucket``), and with control characters escaped (:func:`printable`)."""
    parts = urlsplit(uri) if "://" in uri else None
    if parts is not None and "@" in parts.netloc:
        uri = urlunsplit((parts.scheme, "***@" + parts.netloc.rpartition("@")[2], parts.path, parts.query, ""))
    return printable(uri)


def temporary_name(path: str) -> str:
    """A hidden name beside ``path`` for writing it before the rename (``.NAME.tmp-<uuid>``),
    within the 255 bytes a file name may take: a long NAME is cut to fit (its file's own
    name, given at the rename, is whole)."""
    return temporary_prefix(path) + uuid.uuid4().hex


def temporary_prefix(path: str) -> str:
    """What every :func:`temporary_name` of ``path`` starts with: ``.NAME.tmp-``."""
    room = NAME_MAX_BYTES - 1 - len(TMP_MARK) - 32
    name = os.path.basename(path).encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")
    return f"{os.path.dirname(path)}/.{name}{TMP_MARK}"


NAME_MAX_BYTES = 255  # a file name's limit on Linux's filesystems and on macOS


TMP_MARK = ".tmp-"  # in every temporary name: a killed writer's leftovers are found by it
_TEMPORARY = re.compile(r"\..*" + re.escape(TMP_MARK) + r"[0-9a-f]{32}", re.DOTALL)


def is_temporary(name: str) -> bool:
    """Whether a file's own name is one :func:`temporary_name` gives (``.NAME.tmp-`` and 32
    hex digits): a source file that only holds ``.tmp-`` in its name is not one."""
    return _TEMPORARY.fullmatch(name) is not None


class CompleteOrNothing:
    """A writer whose output appears only when complete: ``close()`` renames it into
    place, ``abort()`` deletes it. As a context manager it closes when the block ends
    normally and aborts when it raises."""

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_atomic(fs: pafs.FileSystem, path: str, data) -> None:
    """Write ``data`` (bytes or an Arrow buffer) under a temporary name beside ``path``, then rename."""
    tmp = temporary_name(path)
    try:
        with fs.open_output_stream(tmp) as out:
            out.write(data)
        fs.move(tmp, path)
    except BaseException:  # an interrupt too: no temporary left beside the file
        delete_quietly(fs, tmp)
        raise


def move_into_place(fs: pafs.FileSystem, tmp: str, path: str, uri: str, replace: bool) -> None:
    """Rename the complete file ``tmp`` to ``path``. Without ``replace``, a file that
    appeared at ``path`` since the command checked it (another command writing the same
    output) is kept, and :class:`~fp8ray.errors.ArchiveExistsError` raised, ``tmp`` left
    to the caller: locally the move is a hard link, which fails where ``path`` exists,
    then the unlink of ``tmp``. Where links are not to be had (object stores, a filesystem
    without them) it is a check, then the rename."""
    if not replace and isinstance(fs, pafs.LocalFileSystem):
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise _appeared(uri) from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
                raise
        else:
            os.unlink(tmp)
            return
    if not replace and fs.get_file_info(path).type != pafs.FileType.NotFound:
        raise _appeared(uri)
    fs.move(tmp, path)


def _appeared(uri: str) -> ArchiveExistsError:
    return ArchiveExistsError(f"output {redact(uri)} appeared while this command ran: not replacing it")


def output_error(uri: str, exc: OSError) -> Fp8rayError:
    """The error of a command's output ``uri`` that could not be written (a full disk), as
    the user sees it: pyarrow's text names a temporary file and repeats its cause, so
    name what was typed, once. fp8ray's own errors (an output that appeared meanwhile)
    already name it."""
    if isinstance(exc, Fp8rayError):
        return exc
    return DestinationError(f"cannot write output {redact(uri)}: {os_reason(exc)}")


def write_output(uri: str, data: bytes) -> None:
    """Write a command's output file ``uri`` whole (:func:`write_atomic`), never in the
    place of a device or a FIFO (:func:`check_not_special`); a failure raises
    :func:`output_error`."""
    fs, path = resolve_output(uri)
    check_not_special(fs, path, uri)
    try:
        write_atomic(fs, path, data)
    except OSError as exc:
        raise output_error(uri, exc) from None


def delete_quietly(fs: pafs.FileSystem, path: str) -> None:
    """Delete the temporary file ``path`` after a failure, if it is there, without raising:
    an error here must not hide the one that caused the clean-up."""
    with contextlib.suppress(OSError):
        fs.delete_file(path)


def _location(uri: str) -> tuple[str, str]:
    """Where a path or URI points: its filesystem (scheme and host or bucket) and its
    normalised absolute path, symbolic links resolved for local paths. A local path is
    the one :func:`resolve` gives, which the command writes (``l/../x`` is ``./x`` there,
    not where a link ``l`` leads; ``file://`` paths percent-decoded, as pyarrow reads them)."""
    parts = urlsplit(uri) if "://" in uri else None
    if parts is None or parts.scheme == "file":
        return "file", os.path.realpath(resolve(uri)[1])
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}", posixpath.normpath("/" + unquote(parts.path).lstrip("/"))


def check_apart(source: str, destination: str) -> None:
    """Refuse a destination that is the source, lies inside it or holds it: writing or
    replacing it could destroy what is read. Local paths are compared after resolving
    symbolic links; URIs by scheme, bucket and path."""
    if not destination:  # it would resolve to the current directory
        raise DestinationError("the destination is an empty path: name the file or directory to write")
    if not source:
        raise BadInputError("the source is an empty path: name the file or directory to read", field="source")
    (src_fs, src), (dst_fs, dst) = _location(source), _location(destination)
    if src_fs != dst_fs:
        return
    if src == dst:
        raise DestinationError(f"destination {redact(destination)} is the source: fp8ray never writes over what it reads")
    sep = os.sep if src_fs == "file" else "/"
    if dst.startswith(src.rstrip(sep) + sep) or src.startswith(dst.rstrip(sep) + sep):
        raise DestinationError(f"source {redact(source)} and destination {redact(destination)} must not lie inside each other")


def printable(name: str) -> str:
    """A name from the outside world (a file name, a key) safe to print: control
    characters and escape codes shown as escapes, never sent to the terminal."""
    return name if name.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in name)


def is_utf8(name: str) -> bool:
    """Whether a string encodes to UTF-8: not a file name holding bytes that are not (as
    Python decodes them, escaped), which an archive's UTF-8 JSON cannot record, nor JSON
    text holding a lone surrogate (``\\ud800``)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def counted(count: int, word: str, plural: str | None = None) -> str:
    """``count`` of ``word``, in words: ``1 part``, ``3 parts`` (``plural`` where it is
    not the word and an s)."""
    return f"{count} {word if count == 1 else plural or word + 's'}"


def size_text(nbytes: int) -> str:
    """A size as a line shows it, in the binary unit that keeps it readable (an archive of
    a few KiB read "0.0 MiB")."""
    value, unit = float(nbytes), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1023.95:  # not shown as 1024.0 of the smaller unit
            break
        value, unit = value / 1024, larger
    return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"


def entries(count: int) -> str:
    """``count`` entries, in words: ``1 entry``, ``3 entries``."""
    return counted(count, "entry", "entries")


def name_list(names: list[str], limit: int = 10) -> str:
    """Names for a message, printable and comma-separated: the first ``limit``, then how
    many more."""
    shown = ", ".join(printable(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def prepare_parent(fs: pafs.FileSystem, path: str, uri: str, parents: bool) -> list[str]:
    """Make sure the directory that will hold ``path`` exists: create it (and its own
    parents) with ``parents``, else refuse naming it. Returns the local folders this call
    made, deepest first (:func:`remove_folders` takes them away after a failure), each
    made by ``mkdir``, so that one another process makes meanwhile is never counted as
    ours; if making them fails, those made are removed. Object stores have no directories
    below the bucket, so there only the bucket must exist."""
    if "://" in uri and urlsplit(uri).scheme in ("s3", "gs", "gcs"):
        bucket = path.split("/", 1)[0]
        if fs.get_file_info(bucket).type != pafs.FileType.Directory:
            raise DestinationError(f"bucket {bucket!r} of {redact(uri)} does not exist")
        return []
    parent = posixpath.dirname(path.rstrip("/")) or "/"
    kind = fs.get_file_info(parent).type
    if kind == pafs.FileType.Directory:
        return []
    if kind != pafs.FileType.NotFound:
        raise DestinationError(f"{redact(uri)}: its parent {parent} is not a directory")
    if not parents:
        raise DestinationError(f"directory {parent} does not exist (create it, or pass --parents) for {redact(uri)}")
    if not isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(parent, recursive=True)
        return []
    missing = []
    while parent and not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    made: list[str] = []
    try:
        for folder in reversed(missing):
            try:
                os.mkdir(folder)
            except FileExistsError:  # made meanwhile, by another: not ours to remove
                continue
            made.insert(0, folder)
    except BaseException:
        remove_folders(made)
        raise
    return made


def remove_folders(folders: list[str]) -> None:
    """Remove ``folders`` (deepest first) that are still empty, quietly: one a concurrent
    process has put something in stays, as does everything above it."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return


def check_not_special(fs: pafs.FileSystem, path: str, uri: str) -> None:
    """Refuse an output that is a device, a FIFO or a socket (or a link to one): an output
    appears by rename, which would put a plain file in its place (``/dev/null`` replaced
    by a file, for everyone), and such a node is not a file to be written whole."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return  # not there (or a link to nothing): nothing of the kind to break
    kinds = {
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
    }
    kind = next((name for test, name in kinds.items() if test(mode)), None)
    if kind is not None:
        raise DestinationError(f"output {redact(uri)} is {kind}, not a file: fp8ray writes files only, and never replaces one")


def output_exists(fs: pafs.FileSystem, path: str) -> bool:
    """Whether anything is at ``path`` (locally a link to nothing too: a rename there
    replaces it)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return os.path.lexists(path)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def replace_directory(fs: pafs.FileSystem, new: str, old: str, uri: str | None = None, *, replace: bool) -> None:
    """Put the complete directory ``new`` in the place of ``old`` (which may not exist),
    deleted only once ``new`` is in place (locally by renames; on object stores, which
    have no directories to rename, file by file). ``uri``: ``old`` as the user gave it,
    for messages. Without ``replace`` (no --overwrite), an ``old`` that appeared since the
    command checked it is kept, and :class:`~fp8ray.errors.ArchiveExistsError` raised."""
    exists = fs.get_file_info(old).type != pafs.FileType.NotFound
    if exists and not replace:
        raise _appeared(uri or old)
    if isinstance(fs, pafs.LocalFileSystem):
        if not exists:
            try:
                os.rename(new, old)
            except OSError as exc:  # made since the check, by another command: not an empty directory
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise _appeared(uri or old) from None
                raise
            return
        trash = temporary_name(old)
        try:
            os.rename(old, trash)
            os.rename(new, old)
            fs.delete_dir(trash)
        except BaseException as exc:  # an interrupt too, wherever it lands
            if not os.path.lexists(old):
                if os.path.lexists(trash):
                    os.rename(trash, old)  # put the old one back
                raise
            if os.path.lexists(trash):  # the new one is in place: the old one goes
                if isinstance(exc, OSError):
                    raise DestinationError(
                        f"{redact(uri or old)} is in place, but what it replaced could not be deleted "
                        f"({os_reason(exc)}): it is left at {trash}"
                    ) from None
                remove_quietly(fs, trash)
            raise
        return
    # No rename of a whole directory here: move file by file, names starting with "_"
    # (an archive's manifest) last, so that the directory reads as complete only once it
    # is; the old files the new ones do not replace go after every move succeeded.
    new_files = sorted(
        (e.path[len(new) :] for e in fs.get_file_info(pafs.FileSelector(new, recursive=True)) if e.type == pafs.FileType.File),
        key=lambda rel: (posixpath.basename(rel).startswith("_"), rel),
    )
    old_files = [e.path[len(old) :] for e in fs.get_file_info(pafs.FileSelector(old, recursive=True))] if exists else []
    for rel in old_files:
        if posixpath.basename(rel).startswith("_"):
            fs.delete_file(old + rel)  # the old manifest first: the old archive is no longer complete
    for rel in new_files:
        fs.move(new + rel, old + rel)
    for rel in set(old_files) - set(new_files):
        if fs.get_file_info(old + rel).type == pafs.FileType.File:
            fs.delete_file(old + rel)
    fs.delete_dir(new)


def remove_quietly(fs: pafs.FileSystem, directory: str, seconds: float = 5.0) -> None:
    """Remove a scratch directory after a failure, without raising: a worker being
    stopped may still be finishing a file in it, so try for a while. It holds nothing of
    the user's, and an error here must not hide the one that caused the cleanup."""
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(OSError):
            fs.delete_dir(directory)
        if fs.get_file_info(directory).type == pafs.FileType.NotFound or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def os_reason(exc: OSError) -> str:
    """What went wrong, in the system's own words and once (``Permission denied``):
    pyarrow's messages repeat the cause and name the path they were given, which may be
    an internal temporary one; the caller names the path the user gave."""
    if getattr(exc, "errno", None):
        return os.strerror(exc.errno)
    return str(exc)


def one_line(exc: BaseException) -> str:
    """An error's reason on one line (pyarrow's may run over several; an OSError's as
    :func:`os_reason` gives it)."""
    return " ".join((os_reason(exc) if isinstance(exc, OSError) else str(exc)).split())


@dataclass(frozen=True)
class TreeEntry:
    """One thing found under a directory. ``name`` is relative, with ``/`` between its
    parts; a folder's ends in ``/``. ``kind``: ``file``, ``file link`` (a symbolic link
    to a file), ``folder link`` (to a folder: not followed), ``broken link``, ``empty
    folder``, ``hidden folder`` (its name starts with ``.``: not entered), ``special``
    (a socket, a device, a pipe) or ``not utf-8`` (a name the filesystem holds as bytes
    that are not UTF-8, given escaped: not entered)."""

    name: str
    kind: str


def list_tree(fs: pafs.FileSystem, path: str) -> list[TreeEntry]:
    """Everything under the directory ``path``, sorted by name: every file in every
    folder, and what is not entered (symbolic links to folders, hidden folders), and
    empty folders. Locally, symbolic links are told apart and never followed into a
    folder; object stores have no links."""
    entries = _list_local(path, "") if isinstance(fs, pafs.LocalFileSystem) else _list_store(fs, path)
    return sorted(entries, key=lambda e: e.name)


def _list_local(root: str, prefix: str) -> list[TreeEntry]:
    out: list[TreeEntry] = []
    with os.scandir(os.path.join(root, prefix) if prefix else root) as it:
        children = list(it)
    if not children and prefix:
        return [TreeEntry(prefix, "empty folder")]
    for child in children:
        rel = prefix + child.name
        if not is_utf8(child.name):  # recorded escaped, never entered: no name under it could be archived
            out.append(TreeEntry(printable(rel) + ("/" if child.is_dir(follow_symlinks=False) else ""), "not utf-8"))
        elif child.is_symlink():
            kind = link_kind(child.path)
            out.append(TreeEntry(rel + "/" if kind == "folder link" else rel, kind))
        elif child.is_dir(follow_symlinks=False):
            if child.name.startswith("."):
                out.append(TreeEntry(rel + "/", "hidden folder"))
            else:
                out += _list_local(root, rel + "/")
        elif child.is_file(follow_symlinks=False):
            out.append(TreeEntry(rel, "file"))
        else:
            out.append(TreeEntry(rel, "special"))
    return out


def link_kind(path: str) -> str:
    """What the symbolic link ``path`` leads to: ``"folder link"``, ``"file link"``,
    ``"special"`` (a FIFO, a device), or ``"broken link"``: a target missing, a loop of
    links (ELOOP), or a folder on the way this user cannot search."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "broken link"
    if stat.S_ISDIR(mode):
        return "folder link"
    return "file link" if stat.S_ISREG(mode) else "special"


def _list_store(fs: pafs.FileSystem, path: str) -> list[TreeEntry]:
    base = path.rstrip("/") + "/"
    infos = [(e.path[len(base) :], e.type) for e in fs.get_file_info(pafs.FileSelector(path, recursive=True))]
    folders = {rel for rel, kind in infos if kind == pafs.FileType.Directory}
    parents = {posixpath.dirname(rel) for rel, _ in infos}
    out: dict[str, TreeEntry] = {}
    for rel, kind in infos:
        hidden = next((i for i, part in enumerate(rel.split("/")) if part.startswith(".")), None)
        if hidden is not None and (hidden < rel.count("/") or kind == pafs.FileType.Directory):
            name = "/".join(rel.split("/")[: hidden + 1]) + "/"
            out[name] = TreeEntry(name, "hidden folder")
        elif kind == pafs.FileType.File:
            out[rel] = TreeEntry(rel, "file")
        elif rel in folders and rel not in parents:
            out[rel + "/"] = TreeEntry(rel + "/", "empty folder")
    return list(out.values())
