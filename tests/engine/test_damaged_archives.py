"""What decompress, verify and open_archive make of an archive damaged or edited by hand:
each says what is wrong with the archive, in one line, before it writes anything, never
a traceback of the values it was given (found by probing: a flipped byte in a part's
metadata columns reached the writers before any CRC was checked)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import crc32c
import pyarrow.parquet as pq
import pytest
import torch
from _util import record_entry, rewrite_column, run_cli
from safetensors.torch import save_file

import fp8ray
from fp8ray.engine.archives import compress_archive, decompress_archive, inspect_archive, verify_archive
from fp8ray.errors import CorruptArchiveError
from fp8ray.io import archive

INLINE = fp8ray.PoolSettings(num_workers=1, address="inline")
ALL_CRCS = ("crc32c", "file_bytes", "footer_crc32c", "columns_crc32c", "frames_crc32c")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A source of two files (small blocks of three dtypes, one large block) and its
    archive: part 0 holds a.safetensors' blocks, part 1 the large one."""
    root = tmp_path_factory.mktemp("damaged")
    g = torch.Generator().manual_seed(3)
    (root / "src" / "sub").mkdir(parents=True)
    save_file(
        {
            "layer0.k": torch.randn(4, 64, generator=g).bfloat16(),
            "layer0.v": torch.randn(4, 64, generator=g).half(),
            "layer1.k": torch.randn(3, 32, generator=g),
            "empty": torch.empty(0, 8, dtype=torch.bfloat16),
        },
        str(root / "src" / "a.safetensors"),
    )
    save_file({"big": torch.randn(256, 1024, generator=g).bfloat16()}, str(root / "src" / "sub" / "b.safetensors"))
    compress_archive(str(root / "src"), str(root / "arch"), part_bytes=4096, lossless="none", pool=INLINE)
    return root / "arch"


def _copy(made, tmp_path, name="arch"):
    return shutil.copytree(made, tmp_path / name)


def _metadata_byte_ranges(path) -> list[range]:
    """Where a part's metadata columns (all but the frames) lie in its file."""
    metadata = pq.ParquetFile(path).metadata
    ranges = []
    for g in range(metadata.num_row_groups):
        for c in range(metadata.num_columns):
            chunk = metadata.row_group(g).column(c)
            if chunk.path_in_schema != "frame":
                start = chunk.dictionary_page_offset or chunk.data_page_offset
                ranges.append(range(start, start + chunk.total_compressed_size))
    return ranges


def test_a_flipped_byte_in_a_parts_metadata_columns_is_named_as_damage(made, tmp_path):
    """Every such byte (of one part, one in three): decompress, to a tree or to one file,
    says the part is damaged and writes nothing. The columns are checked against their
    CRC as the driver reads them, before they size a file or key a header."""
    arch = _copy(made, tmp_path)
    path = arch / "part-00000.parquet"
    original = path.read_bytes()
    positions = [at for r in _metadata_byte_ranges(path) for at in r][::3]
    assert len(positions) > 50
    for i, at in enumerate(positions):
        damaged = bytearray(original)
        damaged[at] ^= 0x5A
        path.write_bytes(damaged)
        out = tmp_path / ("one.safetensors" if i % 2 else "tree")
        with pytest.raises(CorruptArchiveError, match=r"part part-00000\.parquet of .* is damaged") as caught:
            decompress_archive(str(arch), str(out), single_file=bool(i % 2), pool=INLINE)
        assert "\n" not in str(caught.value), at
        assert not out.exists(), at


def test_a_damaged_archive_leaves_no_folders_that_parents_made(made, tmp_path):
    """The folders --parents made for the output stayed behind a decompress that failed
    on a damaged frame (README: a damaged archive leaves nothing behind)."""
    arch = _copy(made, tmp_path)
    path = arch / "part-00001.parquet"  # the large block's frame: found damaged by its worker, as it decodes
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x5A
    path.write_bytes(damaged)
    (tmp_path / "kept").mkdir()
    for out in (tmp_path / "new" / "deep" / "out", tmp_path / "kept" / "deep" / "out"):
        with pytest.raises(CorruptArchiveError, match="damaged"):
            decompress_archive(str(arch), str(out), parents=True, pool=INLINE)
        assert not (tmp_path / "new").exists() and list((tmp_path / "kept").iterdir()) == []


def test_edited_columns_with_their_crcs_made_again_are_refused_before_they_size_anything(made, tmp_path):
    """Columns rewritten with every CRC recorded anew (by hand, or a tool): a dtype no
    block has, or a shape far larger than its frame can hold, is refused as the plan is
    made, before any file is sized (2 TiB: numpy's MemoryError, or fallocate's, before)."""
    arch = _copy(made, tmp_path)
    path = arch / "part-00000.parquet"
    table = pq.read_table(path)
    dtypes, shapes = table.column("dtype").to_pylist(), table.column("shape").to_pylist()
    record_entry(arch, rewrite_column(path, "dtype", ["bfloat17", *dtypes[1:]]), *ALL_CRCS)
    with pytest.raises(CorruptArchiveError, match=r"part part-00000\.parquet, row 0: .*dtype 'bfloat17'.*not a block's"):
        decompress_archive(str(arch), str(tmp_path / "out"), pool=INLINE)
    assert verify_archive(str(arch), pool=INLINE).errors  # what decompress refuses, verify reports
    for single_file in (False, True):
        shutil.copy(made / "part-00000.parquet", path)
        record_entry(arch, rewrite_column(path, "shape", [[2**40], *shapes[1:]]), *ALL_CRCS)
        with pytest.raises(CorruptArchiveError, match=r"row 0: .*shape \[1099511627776\].*more than a frame of \d+ bytes"):
            decompress_archive(str(arch), str(tmp_path / "out.safetensors"), single_file=single_file, pool=INLINE)
        assert not (tmp_path / "out.safetensors").exists()


def test_a_frame_shorter_than_its_row_says_is_refused_before_its_bytes_are_allocated(made, tmp_path, monkeypatch):
    """The columns agree with themselves and the entry (shape and frame_bytes both
    edited, every CRC and total made again), but the frame is the one written. The plan
    refuses the part, as its footer's size of the frame column holds less than the rows
    claim: before, a file of blocks from several parts (one output file, here) had the
    claimed bytes reserved on disk (fallocate) first, and a claim larger than the disk
    failed as "No space left on device". Where the footer agrees (a hand-made one, stood
    in for by skipping that check), the worker refuses the block by its frame's own
    length before it allocates its bytes."""
    arch = _copy(made, tmp_path)
    path = arch / "part-00000.parquet"
    table = pq.read_table(path)
    key, dtype = table.column("key")[0].as_py(), table.column("dtype")[0].as_py()
    frames, shapes = table.column("frame_bytes").to_pylist(), table.column("shape").to_pylist()
    nbytes = 2**40 * torch.empty(0, dtype=getattr(torch, dtype)).element_size()  # far more than any disk here
    rewrite_column(path, "shape", [[2**40], *shapes[1:]])
    rewrite_column(path, "raw_bytes", [nbytes, *table.column("raw_bytes").to_pylist()[1:]])
    entry = rewrite_column(path, "frame_bytes", [nbytes // 4 + 1, *frames[1:]])
    record_entry(arch, entry, *ALL_CRCS, "raw_bytes", "frame_bytes")
    claimed = nbytes // 4 + 1 + sum(frames[1:])
    for single_file in (False, True):
        with pytest.raises(
            CorruptArchiveError,
            match=rf"part part-00000\.parquet of .* is damaged: its rows' frame_bytes add up to {claimed}, more than "
            rf"its frames' \d+ bytes hold",
        ):
            decompress_archive(str(arch), str(tmp_path / "out"), single_file=single_file, pool=INLINE)
        assert not (tmp_path / "out").exists()
    assert verify_archive(str(arch), pool=INLINE).errors
    # Claims whose int64 sum wraps (4 x 2**62 is 0 to pyarrow's sum) are added as Python's integers.
    record_entry(arch, rewrite_column(path, "frame_bytes", [2**62] * len(frames)), *ALL_CRCS, "frame_bytes")
    with pytest.raises(CorruptArchiveError, match=rf"frame_bytes add up to {2**64}, more than its frames' \d+ bytes hold"):
        decompress_archive(str(arch), str(tmp_path / "out"), pool=INLINE)
    entry = rewrite_column(path, "frame_bytes", [nbytes // 4 + 1, *frames[1:]])
    record_entry(arch, entry, *ALL_CRCS, "raw_bytes", "frame_bytes")
    monkeypatch.setattr(archive.part_checks, "check_frame_bytes", lambda *args: None)
    with pytest.raises(
        CorruptArchiveError, match=rf"block '{key}' of a\.safetensors .*more than its frame of {frames[0]} bytes holds"
    ):
        decompress_archive(str(arch), str(tmp_path / "out"), pool=INLINE)
    assert not (tmp_path / "out").exists()


def test_a_row_whose_shape_is_another_of_the_same_size_is_damage_to_decompress_as_to_verify(made, tmp_path):
    """A row edited to another shape of the same bytes (every CRC made again) passes the
    plan; its intact frame disagrees. Decompress reports the part damaged, as verify and
    open_archive do (it raised MismatchError, "expected a ... tensor", as if the caller's
    tensor were at fault)."""
    arch = _copy(made, tmp_path)
    path = arch / "part-00000.parquet"
    table = pq.read_table(path)
    shapes, keys = table.column("shape").to_pylist(), table.column("key").to_pylist()
    row = next(r for r, shape in enumerate(shapes) if len(shape) == 2 and shape[0] != shape[1] and shape[0])
    swapped = shapes[:row] + [shapes[row][::-1]] + shapes[row + 1 :]
    record_entry(arch, rewrite_column(path, "shape", swapped), *ALL_CRCS)
    said = rf"block '{keys[row]}'.* the frame holds \({shapes[row][0]}, {shapes[row][1]}\).*"
    for single_file in (False, True):
        with pytest.raises(CorruptArchiveError, match=said + "its row and its frame disagree, the part is damaged"):
            decompress_archive(str(arch), str(tmp_path / "out"), single_file=single_file, pool=INLINE)
        assert not (tmp_path / "out").exists()
    report = verify_archive(str(arch), pool=INLINE)
    dtype, raw, framed = (table.column(name)[row].as_py() for name in ("dtype", "raw_bytes", "frame_bytes"))
    assert report.errors == [
        f"block 'a.safetensors:{keys[row]}' in part-00000.parquet: columns say {swapped[row]} {dtype} of {raw} bytes in "
        f"a frame of {framed}, the frame holds {shapes[row]} {dtype} of {raw} bytes in {framed}"
    ]
    with pytest.raises(
        CorruptArchiveError, match=rf"block 'a.safetensors:{keys[row]}' in part part-00000.parquet of .* is damaged: its row says"
    ):
        fp8ray.open_archive(str(arch)).get(keys[row])


def test_sizes_edited_in_a_row_or_a_part_entry_fail_verify_as_they_fail_decompress(made, tmp_path):
    """A row's raw_bytes or frame_bytes, or a part entry's totals (the manifest's made to
    follow), that are not its frames' are damage to verify too: it checked only a row's
    dtype and shape, so these archives passed verify and failed decompress."""
    for edit in ("row", "entry"):
        arch = _copy(made, tmp_path, edit)
        path = arch / "part-00000.parquet"
        if edit == "row":
            raw = pq.read_table(path, columns=["raw_bytes"]).column("raw_bytes").to_pylist()
            record_entry(arch, rewrite_column(path, "raw_bytes", [raw[0] + 2, *raw[1:]]), *ALL_CRCS)
            said = r"block '.*' in part-00000.parquet: columns say \[.*\] \w+ of \d+ bytes in a frame of \d+, the frame holds"
        else:
            _edit_manifest(arch, lambda m: m["parts"][0].update(raw_bytes=m["parts"][0]["raw_bytes"] + 2))
            _edit_manifest(arch, lambda m: m.update(raw_bytes=m["raw_bytes"] + 2))
            said = (
                r"part part-00000.parquet of .* is damaged: its rows hold (\d+) bytes in \d+ of frames, its entry records (?!\1)"
            )
        errors = verify_archive(str(arch), pool=INLINE).errors
        assert len(errors) == 1 and re.search(said, errors[0]), errors
        if edit == "entry":  # decompress plans from the columns, which the row edit left consistent
            with pytest.raises(CorruptArchiveError, match=r"part-00000.parquet: its rows hold \d+ bytes"):
                decompress_archive(str(arch), str(tmp_path / "out"), pool=INLINE)


def test_what_the_directory_holds_beside_the_listed_parts_fails_verify_and_inspect(made, tmp_path):
    """A part the manifest does not list (an older archive synced over this one without
    deleting), another file or a folder: fp8ray reads only the listed parts, so its
    decompress is right, but pyarrow and Ray Data read the directory and took the stray
    part's rows as the archive's; verify and inspect said ok."""
    arch = _copy(made, tmp_path)
    shutil.copy(arch / "part-00000.parquet", arch / "part-00007.parquet")
    assert pq.read_table(arch, columns=["key"]).num_rows > inspect_archive(str(arch)).manifest.blocks  # rows read twice
    (arch / "notes.txt").write_text("mine")
    (arch / "old").mkdir()
    said = (
        f"archive {arch} holds 3 entries its manifest does not list (notes.txt, old/, part-00007.parquet): fp8ray "
        "reads only the listed parts, but Parquet readers of the directory (pyarrow, Ray Data) read those too, "
        "or fail on them; remove them"
    )
    assert verify_archive(str(arch), pool=INLINE).errors == [said]
    assert inspect_archive(str(arch)).problems == [said]
    for name in ("part-00007.parquet", "notes.txt", "old"):
        shutil.rmtree(arch / name) if name == "old" else (arch / name).unlink()
    (arch / "_mine.json").write_text("{}")  # names Parquet readers skip are left alone
    (arch / ".hidden").write_text("")
    assert verify_archive(str(arch), pool=INLINE).ok and not inspect_archive(str(arch)).problems


def test_a_part_without_its_size_columns_is_reported_damaged_by_verify(made, tmp_path):
    """A part with no raw_bytes (or frame_bytes) column, its entry of an fp8ray before the
    column CRCs: verify raised KeyError once it compared each row's sizes with its frame."""
    for dropped in ("raw_bytes", "frame_bytes"):
        arch = _copy(made, tmp_path, dropped)
        path = arch / "part-00000.parquet"
        pq.write_table(pq.read_table(path).drop_columns([dropped]), path)
        data = path.read_bytes()

        def older_entry(m, data=data):
            entry = m["parts"][0]
            for crc in ("footer_crc32c", "columns_crc32c", "frames_crc32c"):
                entry.pop(crc)
            entry.update(crc32c=crc32c.crc32c(data), file_bytes=len(data))
            m["archive_bytes"] = sum(e["file_bytes"] for e in m["parts"])

        _edit_manifest(arch, older_entry)
        assert verify_archive(str(arch), pool=INLINE).errors == [
            f"part part-00000.parquet of {arch} is damaged: it has no {dropped!r} column"
        ]


def test_a_key_twice_in_one_file_fails_verify_as_it_fails_decompress(made, tmp_path):
    arch = _copy(made, tmp_path)
    path = arch / "part-00000.parquet"
    keys = pq.read_table(path, columns=["key"]).column("key").to_pylist()
    record_entry(arch, rewrite_column(path, "key", [keys[0], keys[0], *keys[2:]]), *ALL_CRCS)
    twice = rf"the parts hold block '{keys[0]}' of a\.safetensors twice"
    assert any(re.search(twice, e) for e in verify_archive(str(arch), pool=INLINE).errors)
    with pytest.raises(CorruptArchiveError, match=twice):
        decompress_archive(str(arch), str(tmp_path / "out"), pool=INLINE)


def _edit_manifest(arch, edit) -> None:
    path = arch / archive.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "edit, refusal",
    [
        (lambda m: m["layout"].update(container="file"), r"'container' is 'file', but it records 2 files, not one"),
        (lambda m: m.pop("layout"), r"'layout'"),  # version 2 and 3 record it: read without, as version 1, one file
        (
            lambda m: m["layout"]["files"][0].update(name="sub/b.safetensors/a.safetensors"),
            r"lists sub/b\.safetensors as a file and as the folder of sub/b\.safetensors/a\.safetensors",
        ),
        # A field fp8ray does not write, anywhere in the manifest (the layout's were ignored,
        # a file entry's refused as "SourceFile.__init__() got an unexpected keyword").
        (lambda m: m.update(checked=True), r"the manifest holds 'checked', not one of \['format', 'version', 'codec'"),
        (lambda m: m["layout"].update(order="sorted"), r"the manifest's layout holds 'order', not one of \['kind'"),
        (lambda m: m["layout"]["files"][1].update(mode=420), r"layout, file 1 holds 'mode', not one of \['name'"),
        (lambda m: m["parts"][1].update(rows=1), r"part entry 1 holds 'rows', not one of \['name'"),
    ],
    ids=["one-file-of-two", "no-layout", "file-and-folder", "manifest-field", "layout-field", "file-field", "part-field"],
)
def test_a_manifest_edited_to_say_what_cannot_be_is_refused(made, tmp_path, edit, refusal):
    arch = _copy(made, tmp_path)
    _edit_manifest(arch, edit)
    with pytest.raises(CorruptArchiveError, match=refusal):
        decompress_archive(str(arch), str(tmp_path / "out"), pool=INLINE)
    try:
        errors = verify_archive(str(arch), pool=INLINE).errors
    except CorruptArchiveError as exc:  # a manifest refused as it is read
        errors = [str(exc)]
    assert any(re.search(refusal, e) for e in errors), errors
    assert not (tmp_path / "out").exists()


def test_a_size_read_without_the_parts_crc_must_agree_with_its_row(made, tmp_path):
    """nbytes reads one row group (keys from the footer: one block a group): a raw_bytes
    value that is not its dtype and shape's is damage, not a size (it returned 2**56 or
    None, and the service answered 413 or 500)."""
    arch = _copy(made, tmp_path)
    path = arch / "part-00001.parquet"
    assert fp8ray.open_archive(str(arch)).nbytes("big") == 256 * 1024 * 2
    raw = pq.read_table(path, columns=["raw_bytes"]).column("raw_bytes").to_pylist()
    entry = rewrite_column(path, "raw_bytes", [raw[0] + 2**56])
    record_entry(arch, entry, "crc32c", "file_bytes", "footer_crc32c", "frames_crc32c")  # the columns' CRC is not read
    with pytest.raises(CorruptArchiveError, match=r"part-00001\.parquet .* is damaged: its row says 'bfloat16' \[256, 1024\]"):
        fp8ray.open_archive(str(arch)).nbytes("big")


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_part_that_is_not_a_regular_file_is_refused_at_once(made, tmp_path, kind):
    """A FIFO blocked every reader in open(), deaf to SIGINT and SIGTERM; /dev/zero read
    forever. Run as the command, with a timeout: a regression fails, it does not hang."""
    arch = _copy(made, tmp_path)
    part = arch / "part-00000.parquet"
    part.unlink()
    if kind == "fifo":
        os.mkfifo(part)
    else:
        part.symlink_to("/dev/zero")
    fp8ray_cli = [sys.executable, "-m", "fp8ray.cli"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    inline = ["--address", "inline"]
    for argv in (
        ["verify", arch, *inline],
        ["decompress", arch, tmp_path / "out", *inline],
        ["get", arch, "layer0.k", "-o", tmp_path / "g"],
    ):
        done = subprocess.run(
            [*fp8ray_cli, *map(str, argv)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
        )
        assert done.returncode == 1, (argv, done.stdout, done.stderr)
        assert "part part-00000.parquet of" in done.stderr and "is not a regular file" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "edit, refusal",
    [
        (lambda m: m.update(lossless="bogus"), r"'lossless' is 'bogus', not a lossless stage"),
        (lambda m: m.update(version=float(m["version"])), r"version 2\.0, expected"),
    ],
    ids=["unknown-lossless", "float-version"],
)
def test_manifest_fields_read_as_fp8ray_writes_them(made, tmp_path, edit, refusal):
    arch = _copy(made, tmp_path)
    _edit_manifest(arch, edit)
    with pytest.raises(CorruptArchiveError, match=refusal):
        fp8ray.open_archive(str(arch))


def test_a_lossless_stage_recorded_as_typed_reads_in_its_canonical_spelling(made, tmp_path):
    """Archives of 2026-12-03 recorded --lossless as typed: they read, as zstd:3 and zstd."""
    for typed, canonical in (("zstd:03", "zstd:3"), ("zstd:", "zstd"), ("none", "none")):
        arch = _copy(made, tmp_path, typed.replace(":", "_"))
        _edit_manifest(arch, lambda m, typed=typed: m.update(lossless=typed))
        assert fp8ray.open_archive(str(arch)).manifest.lossless == canonical


def test_inspect_shows_a_manifests_version_string_escaped(made, tmp_path, capsys):
    """The manifest's fp8ray_version was printed as it was: escape codes in it cleared the
    user's screen or retitled the terminal, as any other string from an archive must not."""
    arch = _copy(made, tmp_path)
    _edit_manifest(arch, lambda m: m.update(fp8ray_version="0.1.0\x1b[2J\x1b]0;title\x07"))
    code, out, _ = run_cli(capsys, "inspect", arch)
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert out.rstrip("\n").endswith("fp8ray 0.1.0\\x1b[2J\\x1b]0;title\\x07"), out


def test_a_manifest_larger_than_any_archives_is_refused_unread(made, tmp_path, capsys):
    """A 3 GB _manifest.json was read whole: a MemoryError traceback where memory is
    limited. (A sparse file here: no disk is used.)"""
    arch = _copy(made, tmp_path)
    os.truncate(arch / archive.MANIFEST_NAME, archive.MAX_RECORD_BYTES + 1)
    code, out, err = run_cli(capsys, "inspect", arch)
    assert (code, out) == (1, "") and err == (
        f"fp8ray: error: {arch}/_manifest.json is {archive.MAX_RECORD_BYTES + 1} bytes, more than an archive's record "
        f"may hold ({archive.MAX_RECORD_BYTES})\n"
    )
