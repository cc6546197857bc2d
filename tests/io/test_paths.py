"""Paths and URIs, without Ray: resolving, credentials kept out of messages, atomic
writes, and the check that no destination overlaps its source."""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest
from _util import InterruptedAfter

from fp8ray.errors import BadInputError, DestinationError
from fp8ray.io.paths import TMP_MARK, check_apart, redact, replace_directory, resolve, temporary_name, uri_for, write_atomic


def test_local_paths_resolve_to_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs, path = resolve("kv.safetensors")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path / "kv.safetensors")


@pytest.mark.parametrize(
    "uri, path, expected",
    [
        ("/data/kv", "/data/kv/a.safetensors", "/data/kv/a.safetensors"),
        ("s3://bucket/kv", "bucket/kv/a.safetensors", "s3://bucket/kv/a.safetensors"),
        (
            "s3://key:secret@bucket/kv?endpoint_override=127.0.0.1:9000",
            "bucket/kv/a",
            "s3://key:secret@bucket/kv/a?endpoint_override=127.0.0.1:9000",
        ),
        ("file:///data/kv", "/data/kv/a", "file:///data/kv/a"),
    ],
)
def test_uri_for_keeps_scheme_credentials_and_options(uri, path, expected):
    assert uri_for(uri, path) == expected


@pytest.mark.parametrize(
    "uri, expected",
    [
        ("s3://key:secret@bucket/kv?endpoint_override=x", "s3://***@bucket/kv?endpoint_override=x"),
        ("s3://bucket/kv", "s3://bucket/kv"),
        ("/local/path@with-at", "/local/path@with-at"),
    ],
)
def test_redact_hides_credentials_only(uri, expected):
    assert redact(uri) == expected


def test_write_atomic_leaves_only_the_complete_file(tmp_path):
    fs = pafs.LocalFileSystem()
    target = tmp_path / "out.bin"
    write_atomic(fs, str(target), b"complete")
    assert target.read_bytes() == b"complete"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
    name = temporary_name(str(target))
    assert os.path.dirname(name) == str(tmp_path) and os.path.basename(name).startswith(".out.bin" + TMP_MARK)


def test_an_empty_destination_is_refused_as_such(tmp_path):
    with pytest.raises(DestinationError, match="^the destination is an empty path: name the file or directory to write$"):
        check_apart(str(tmp_path / "kv"), "")


@pytest.mark.parametrize("name", ["x" * 250 + ".bin", "ключ" * 30 + "й.bin"], ids=["ascii", "two-byte"])
def test_a_file_of_the_longest_name_is_written_through_its_temporary(tmp_path, name):
    """A name of up to 255 bytes is legal; its temporary (a hidden name with a mark and a
    uuid) is cut to fit, so such a file can be written at all."""
    target = tmp_path / name
    assert len(name.encode()) <= 255
    temporary = os.path.basename(temporary_name(str(target)))
    assert len(temporary.encode()) <= 255 and TMP_MARK in temporary and temporary.startswith("." + name[:50])
    write_atomic(pafs.LocalFileSystem(), str(target), b"complete")
    assert target.read_bytes() == b"complete" and [p.name for p in tmp_path.iterdir()] == [name]


@pytest.mark.parametrize(
    "source, destination, message",
    [
        ("{t}/kv", "{t}/kv", "is the source"),
        ("{t}/kv", "{t}/kv/", "is the source"),
        ("{t}/kv", "{t}/kv/archive", "inside each other"),
        ("{t}/nest/src", "{t}/nest", "inside each other"),
        ("{t}/kv", "{t}/link", "is the source"),  # a symbolic link to the source
        ("{t}/kv", "{t}/link/inner", "inside each other"),
        ("s3://bucket/kv", "s3://bucket/kv/out", "inside each other"),
        ("s3://key:secret@bucket/kv", "s3://bucket/kv", "is the source"),
        # Spelled as the check did not read them, as the command does (the source was destroyed):
        ("{t}/kv", "file://{t}/k%76", "is the source"),  # pyarrow decodes %XX
        ("{t}/kv", "{t}/deep/../kv", "is the source"),  # `deep` a link elsewhere: `..` is textual where written
        ("s3://bucket/kv", "s3://bucket/k%76/out", "inside each other"),
    ],
)
def test_overlapping_destinations_are_refused(tmp_path, source, destination, message):
    (tmp_path / "kv").mkdir()
    (tmp_path / "nest" / "src").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "kv")
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "deep").symlink_to(tmp_path / "a" / "b")
    with pytest.raises(DestinationError, match=message) as exc:
        check_apart(source.format(t=tmp_path), destination.format(t=tmp_path))
    assert "secret" not in str(exc.value)


@pytest.mark.parametrize(
    "source, destination",
    [
        ("{t}/kv", "{t}/kv2"),  # a shared prefix is not containment
        ("{t}/kv", "{t}/other/kv"),
        ("s3://bucket/kv", "s3://other/kv"),
        ("s3://bucket/kv", "{t}/kv"),
    ],
)
def test_separate_destinations_pass(tmp_path, source, destination):
    check_apart(source.format(t=tmp_path), destination.format(t=tmp_path))


def test_a_tree_is_listed_alike_on_a_local_disk_and_on_a_store_without_folders(tmp_path):
    """list_tree: every file in every folder, empty and hidden folders named once (a
    hidden one not entered), the same whether the filesystem has real folders or only
    keys (pyarrow's mock filesystem stands in for an object store)."""
    import pyarrow.fs as pafs

    from fp8ray.io.paths import TreeEntry, list_tree

    names = ["a.safetensors", "sub/b.safetensors", "sub/deep/c.txt", ".cache/x/y.bin", ".h.safetensors"]
    mock = pafs._MockFileSystem()
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
        mock.create_dir(f"root/{name}".rsplit("/", 1)[0], recursive=True)
        with mock.open_output_stream(f"root/{name}") as f:
            f.write(b"x")
    (tmp_path / "empty" / "inner").mkdir(parents=True)
    mock.create_dir("root/empty/inner", recursive=True)
    expected = [
        TreeEntry(".cache/", "hidden folder"),
        TreeEntry(".h.safetensors", "file"),
        TreeEntry("a.safetensors", "file"),
        TreeEntry("empty/inner/", "empty folder"),
        TreeEntry("sub/b.safetensors", "file"),
        TreeEntry("sub/deep/c.txt", "file"),
    ]
    assert list_tree(pafs.LocalFileSystem(), str(tmp_path)) == expected
    assert list_tree(mock, "root") == expected
    (tmp_path / "link").symlink_to(tmp_path / "sub")
    (tmp_path / "file_link").symlink_to(tmp_path / "a.safetensors")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop1.safetensors").symlink_to("loop2.safetensors")  # a loop: ELOOP aborted the listing
    (tmp_path / "loop2.safetensors").symlink_to("loop1.safetensors")
    local = list_tree(pafs.LocalFileSystem(), str(tmp_path))
    assert [e for e in local if e not in expected] == [
        TreeEntry("broken", "broken link"),
        TreeEntry("file_link", "file link"),
        TreeEntry("link/", "folder link"),
        TreeEntry("loop1.safetensors", "broken link"),
        TreeEntry("loop2.safetensors", "broken link"),
    ]


@pytest.mark.parametrize("method", ["open_output_stream", "move"])
def test_an_interrupted_write_atomic_leaves_no_temporary(tmp_path, method):
    target = tmp_path / "f.bin"
    with pytest.raises(KeyboardInterrupt):
        write_atomic(InterruptedAfter(method), str(target), b"complete")
    left = [p.name for p in tmp_path.iterdir()]
    # Interrupted as the rename returned, the file is complete in place; before it, absent.
    assert left == (["f.bin"] if method == "move" else []), left
    if method == "move":
        assert target.read_bytes() == b"complete"


def _dir(path, text: str):
    path.mkdir()
    (path / "a").write_text(text)
    return path


@pytest.mark.parametrize("renames", [1, 2])
def test_an_interrupt_as_a_directory_is_replaced_leaves_one_whole_directory_and_no_temporary(tmp_path, monkeypatch, renames):
    """Interrupted after the old directory is moved aside (1) or the new one moved in (2):
    the old one is put back, or the new one stays and the old one goes; either way one
    whole directory at the path and nothing hidden beside it."""
    old, new = _dir(tmp_path / "out", "old"), _dir(tmp_path / ".out.tmp-new", "new")
    rename, done = os.rename, []

    def rename_then_interrupt(src, dst):
        rename(src, dst)
        done.append(dst)
        if len(done) == renames:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", rename_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        replace_directory(pafs.LocalFileSystem(), str(new), str(old), replace=True)
    monkeypatch.undo()
    assert (old / "a").read_text() == ("old" if renames == 1 else "new")
    hidden = sorted(p.name for p in tmp_path.iterdir() if TMP_MARK in p.name)
    assert hidden == ([new.name] if renames == 1 else []), hidden  # the caller removes its own new one


@pytest.mark.parametrize("uri", ["file:///tmp/x#v2", "file:///tmp/x?y=1", "s3://bucket/kv#v2"])
def test_a_uri_part_that_names_no_file_is_refused(uri):
    """pyarrow drops a URI's #fragment (and a file:// URI's ?query): the data went to
    another path than the one typed, and every message showed the typed one."""
    with pytest.raises(BadInputError, match=r"names no file"):
        resolve(uri)


def test_a_gs_uri_gives_up_in_seconds_not_fifteen_minutes():
    """pyarrow's GCS client retried for 15 minutes in native code, deaf to Ctrl-C and
    SIGTERM; fp8ray asks for GCS_RETRY_LIMIT_S unless the URI says otherwise."""
    from datetime import timedelta

    from fp8ray.io.paths import GCS_RETRY_LIMIT_S

    for uri, limit in (("gs://bucket/kv", GCS_RETRY_LIMIT_S), ("gs://bucket/kv?retry_limit_seconds=5", 5)):
        fs, path = resolve(uri)
        assert path == "bucket/kv" and isinstance(fs, pafs.GcsFileSystem)
        assert fs.__reduce__()[1][0]["retry_time_limit"] == timedelta(seconds=limit)  # the options it was made with
