"""The archive's records (manifest, plan, part entries) as dataclasses: archives written
before them read unchanged and their JSON comes back byte for byte; every field a reader
needs is checked once, and a bad one is named with its file."""

from __future__ import annotations

import base64
import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from safetensors.torch import load_file

from fp8ray.engine.archives import decompress_archive, inspect_archive, verify_archive
from fp8ray.engine.pool import PoolSettings
from fp8ray.errors import CorruptArchiveError
from fp8ray.io import archive
from fp8ray.io.records import Manifest, Part, Plan

FS = pafs.LocalFileSystem()
DATA = Path(__file__).parent / "data"  # how each was made: data/README.md
V2, V1, SCRATCH, SOURCE = DATA / "v2_archive", DATA / "v1_archive", DATA / "v2_scratch", DATA / "v2_source"
SOURCE_FILES = ["req0.safetensors", "tenant_b/req1.safetensors"]
INLINE = {"pool": PoolSettings(num_workers=1, address="inline")}


def manifest_json(directory: Path = V2) -> dict:
    return json.loads((directory / archive.MANIFEST_NAME).read_text())


@pytest.mark.parametrize("directory", [V2, V1], ids=["v2", "v1"])
def test_a_kept_manifest_is_written_back_byte_for_byte(directory, tmp_path):
    manifest = archive.read_manifest(FS, str(directory))
    archive.write_manifest(FS, str(tmp_path), manifest)
    assert (tmp_path / archive.MANIFEST_NAME).read_bytes() == (directory / archive.MANIFEST_NAME).read_bytes()
    assert Manifest.from_json(manifest.to_json(), "again") == manifest


def test_the_kept_plan_and_sidecars_are_written_back_byte_for_byte(tmp_path):
    plan = archive.read_plan(FS, str(SCRATCH))
    assert plan.source == "v2_source" and [len(p) for p in plan.parts] == [2, 2]
    assert plan.parts[1][0] == ("tenant_b/req1.safetensors", "layer0.kv")
    assert plan.files is None  # written before the source files' sizes and times were recorded
    archive.write_plan(FS, str(tmp_path), plan)
    assert (tmp_path / archive.PLAN_NAME).read_bytes() == (SCRATCH / archive.PLAN_NAME).read_bytes()
    for part in V2.glob("part-*.parquet"):  # a sidecar reads only beside its part
        shutil.copy(part, tmp_path)
    shutil.copy(SCRATCH / archive.sidecar_name(1), tmp_path)
    sidecar = archive.read_sidecar(FS, str(tmp_path), 1)
    assert sidecar == archive.read_manifest(FS, str(V2)).parts[1]
    (tmp_path / archive.sidecar_name(1)).unlink()
    archive.write_sidecar(FS, str(tmp_path), 1, sidecar)
    assert (tmp_path / archive.sidecar_name(1)).read_bytes() == (SCRATCH / archive.sidecar_name(1)).read_bytes()


def test_a_version_2_archive_written_before_reads_unchanged(tmp_path):
    """Inspected, verified against its source and given back byte for byte."""
    manifest = archive.read_manifest(FS, str(V2))
    assert manifest.version == 2 and [f.name for f in manifest.layout.files] == SOURCE_FILES
    assert [s.name for s in manifest.layout.skipped] == ["README.txt"] and manifest.lossless == "zstd:3"
    report = inspect_archive(str(V2))
    assert report.problems == [] and report.manifest == manifest
    # inspect --json: the manifest as its file holds it (keys in the file's order), then ratio and problems
    text = (V2 / archive.MANIFEST_NAME).read_text()
    as_printed = json.dumps(report.as_dict(), indent=1)
    assert as_printed.startswith(text.rstrip("\n}")) and list(report.as_dict())[-2:] == ["ratio", "problems"]
    verified = verify_archive(str(V2), against=str(SOURCE), **INLINE)
    assert verified.ok and verified.blocks == manifest.blocks == 4, verified.errors
    decompress_archive(str(V2), str(tmp_path / "out"), **INLINE)
    assert sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*.safetensors")) == SOURCE_FILES
    for name in SOURCE_FILES:
        assert (tmp_path / "out" / name).read_bytes() == (SOURCE / name).read_bytes(), name


def test_a_version_1_archive_reads_as_before(tmp_path):
    """No layout, lossless stage, error bound or file column: one safetensors file back."""
    manifest = archive.read_manifest(FS, str(V1))
    assert (manifest.version, manifest.layout, manifest.lossless, manifest.error_bound) == (1, None, None, None)
    assert manifest.options.scale_dtype == "float32" and manifest.options.scale_choice == "amax"
    assert inspect_archive(str(V1)).problems == []
    assert verify_archive(str(V1), **INLINE).ok
    decompress_archive(str(V1), str(tmp_path / "one.safetensors"), **INLINE)
    restored = load_file(tmp_path / "one.safetensors")
    originals = {k: v for name in SOURCE_FILES for k, v in load_file(SOURCE / name).items()}
    assert list(restored) == list(originals)
    assert all(restored[k].equal(originals[k]) for k in originals)


def without(obj: dict, path: tuple) -> dict:
    out = copy.deepcopy(obj)
    *inner, last = path
    target = out
    for step in inner:
        target = target[step]
    del target[last]
    return out


def replaced(obj: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(obj)
    *inner, last = path
    target = out
    for step in inner:
        target = target[step]
    target[last] = value
    return out


REQUIRED = ["fp8ray_version", "codec", "source", "blocks", "raw_bytes", "frame_bytes", "archive_bytes", "parts"]
PART_FIELDS = ["name", "blocks", "raw_bytes", "frame_bytes", "file_bytes", "crc32c", "first_key", "last_key"]


@pytest.mark.parametrize("name", REQUIRED)
def test_a_manifest_missing_a_field_names_it(name):
    with pytest.raises(CorruptArchiveError, match=rf"^m.json: the manifest's '{name}' is missing$"):
        Manifest.from_json(without(manifest_json(), (name,)), "m.json")


@pytest.mark.parametrize(
    "total, of_part",
    [("blocks", "blocks"), ("raw_bytes", "raw_bytes"), ("frame_bytes", "frame_bytes"), ("archive_bytes", "file_bytes")],
)
def test_a_manifest_whose_totals_are_not_its_parts_is_refused(total, of_part):
    """inspect said nothing of "blocks": 21 over no parts (and decompress went by the
    parts), nor of sizes edited by hand, which it printed as the archive's."""
    obj = manifest_json()
    summed = sum(p[of_part] for p in obj["parts"])
    assert obj[total] == summed  # as fp8ray writes it
    for recorded, parts in ((summed + 1, obj["parts"]), (summed, [])):
        edited = {**obj, total: recorded, "parts": parts}
        if not parts:
            edited |= {t: 0 for t in ("blocks", "raw_bytes", "frame_bytes", "archive_bytes") if t != total}
        said = rf"^m.json: the manifest records {total} {recorded}, but its parts' entries' {of_part} add up to"
        with pytest.raises(CorruptArchiveError, match=said):
            Manifest.from_json(edited, "m.json")


@pytest.mark.parametrize("name", PART_FIELDS)
def test_a_part_entry_missing_a_field_names_it(name):
    with pytest.raises(CorruptArchiveError, match=rf"^m.json: part entry 1's '{name}' is missing$"):
        Manifest.from_json(without(manifest_json(), ("parts", 1, name)), "m.json")


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("blocks",), "4", r"the manifest's 'blocks' is '4', not a non-negative integer"),
        (("raw_bytes",), -1, r"the manifest's 'raw_bytes' is -1, not a non-negative integer"),
        (("archive_bytes",), True, r"the manifest's 'archive_bytes' is True, not a non-negative integer"),
        (("source",), None, r"the manifest's 'source' is None, not a string"),
        (("codec",), [], r"the manifest's 'codec' is \[\], not an object"),
        (("codec", "fp8"), "e9m9", r"the manifest's 'codec' is not valid: .*e9m9"),
        (("lossless",), 3, r"the manifest's 'lossless' is 3, not a string"),
        (("error_bound",), {"relative": 0.1}, r"'error_bound' is .*, not numbers for \['clamp', 'per_scale', 'relative'\]"),
        (("error_bound", "clamp"), "0", r"'error_bound' is .*, not numbers for"),
        (("error_bound", "relative"), 1e6, r"'error_bound' is .*, not its codec's \(e4m3fn, "),
        (("error_bound", "clamp"), -1.0, r"'error_bound' is .*, not its codec's"),
        (("layout", "files", 1, "name"), "../x.safetensors", r"'../x.safetensors', which is not a plain relative file name"),
        (("parts",), {}, r"the manifest's 'parts' is \{\}, not a list"),
        (("parts", 0), [], r"part entry 0 is a JSON list, not an object"),
        (("parts", 0, "crc32c"), 1 << 32, r"part entry 0's 'crc32c' is 4294967296, more than 32 bits"),
        (("parts", 0, "first_key"), 7, r"part entry 0's 'first_key' is 7, not a string or null"),
        (("parts", 1, "name"), "../part-00001.parquet", r"part entry 1 names '../part-00001.parquet', not a part of this"),
        (("parts", 1, "name"), "_manifest.json", r"part entry 1 names '_manifest.json', not a part"),
        (("layout", "kind"), "numpy", r"layout's 'kind' is 'numpy', not one of \['parquet', 'safetensors'\]"),
        (("layout", "container"), "zip", r"layout's 'container' is 'zip'"),
        (("layout", "kind"), "parquet", r"layout, file 0 records no Parquet schema, which a layout of 'kind' 'parquet' needs"),
        (("layout", "files", 1, "schema"), "AAAA", r"layout, file 1 records a Parquet schema, but the layout's 'kind' is 'safe"),
        (("layout", "files", 1, "blocks"), 2.5, r"layout, file 1's 'blocks' is 2.5, not a non-negative integer"),
        (("layout", "files", 0, "metadata", "request"), 0, r"file 0's metadata's 'request' is 0, not a string"),
        (("layout", "files", 0, "owner"), "x", r"layout, file 0 holds 'owner', not one of \['name'"),
        (("layout", "skipped", 0, "reason"), None, r"skipped entry 0's 'reason' is None, not a string"),
        (("version",), True, r"format 'fp8ray-archive' version True, expected 'fp8ray-archive' version 1 or 2"),
        (("format",), "other", r"format 'other' version 2"),
    ],
)
def test_a_manifest_field_of_the_wrong_kind_is_named(path, value, message):
    with pytest.raises(CorruptArchiveError, match=rf"^m\.json: .*{message}"):
        Manifest.from_json(replaced(manifest_json(), path, value), "m.json")


def encoded(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


RAW = [("key", pa.string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("data", pa.binary())]


@pytest.mark.parametrize(
    "schema, message",
    [
        ("not base64!", "a base64 Arrow schema: "),
        ("AAAA", "a base64 Arrow schema: "),
        (base64.b64encode(b"\xff" * 40).decode(), "a base64 Arrow schema: "),
        (encoded(pa.schema([("x", pa.int32())])), r"a raw-block source's: .* needs columns .*; missing \['key'"),
        (encoded(pa.schema([*RAW[:3], ("data", pa.string())])), r"a raw-block source's: column 'data' is string; expected bin"),
        (encoded(pa.schema([*RAW, ("note", pa.string())])), r"a raw-block source's: columns \['note'\] are not archived"),
    ],
)
def test_a_parquet_layout_whose_schema_is_not_a_sources_is_refused(schema, message):
    """A decompress would write the Parquet file back with this schema (a tampered one
    crashed the writer)."""
    obj = replaced(manifest_json(), ("layout", "kind"), "parquet")
    good = encoded(pa.schema(RAW))
    for i, file in enumerate(obj["layout"]["files"]):
        file["schema"] = schema if i == 1 else good
    with pytest.raises(CorruptArchiveError, match=rf"^m\.json: the manifest's layout, file 1's 'schema' is not {message}"):
        Manifest.from_json(obj, "m.json")
    obj["layout"]["files"][1]["schema"] = good
    assert Manifest.from_json(obj, "m.json").layout.kind == "parquet"


def test_a_damaged_manifest_file_names_the_file_and_field(tmp_path):
    shutil.copytree(V2, tmp_path / "a")
    (tmp_path / "a" / archive.MANIFEST_NAME).write_text(json.dumps(without(manifest_json(), ("parts", 0, "file_bytes"))))
    with pytest.raises(CorruptArchiveError, match=rf"^{tmp_path}/a/_manifest.json: part entry 0's 'file_bytes' is missing$"):
        inspect_archive(str(tmp_path / "a"))


def test_a_plan_records_its_source_files_and_reads_them_back(tmp_path):
    plan = replace(archive.read_plan(FS, str(SCRATCH)), files=(("a.safetensors", 10, 123), ("b.safetensors", 0, None)))
    archive.write_plan(FS, str(tmp_path), plan)
    written = json.loads((tmp_path / archive.PLAN_NAME).read_text())
    assert written["files"] == [["a.safetensors", 10, 123], ["b.safetensors", 0, None]]
    assert archive.read_plan(FS, str(tmp_path)) == plan


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: without(p, ("lossless",)), r"the plan's 'lossless' is missing"),
        (lambda p: replaced(p, ("parts", 1, 0), ["a", 1]), r"the plan's part 1 is .*, not a list of \[file, key\] pairs"),
        (lambda p: replaced(p, ("codec",), "e4m3fn"), r"the plan's 'codec' is 'e4m3fn', not an object"),
        (lambda p: {**p, "files": [["a", -1, None]]}, r"the plan's file 0 is .*, not \[name, size, mtime_ns or null\]"),
        (lambda p: {**p, "files": [["a", 1, "x"]]}, r"the plan's file 0 is .*, not \[name, size, mtime_ns or null\]"),
    ],
)
def test_a_damaged_plan_is_refused_by_name(tmp_path, change, message):
    plan = json.loads((SCRATCH / archive.PLAN_NAME).read_text())
    (tmp_path / archive.PLAN_NAME).write_text(json.dumps(change(plan)))
    with pytest.raises(
        CorruptArchiveError, match=rf"_plan.json: {message}; pass --overwrite instead of --resume to start again$"
    ):
        archive.read_plan(FS, str(tmp_path))
    assert Plan.from_json(plan, "p") == archive.read_plan(FS, str(SCRATCH))


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "part-00001.parquet"}',  # cut short
        json.dumps({**json.loads((SCRATCH / "_part-00001.json").read_text()), "blocks": -2}),
        (SCRATCH / "_part-00000.json").read_text(),  # another part's entry
        "{",
    ],
)
def test_a_damaged_sidecar_means_the_part_is_redone(tmp_path, text):
    shutil.copy(V2 / archive.part_name(1), tmp_path)
    (tmp_path / archive.sidecar_name(1)).write_text(text)
    assert archive.read_sidecar(FS, str(tmp_path), 1) is None


def test_a_part_entry_that_is_not_an_object_is_named():
    with pytest.raises(CorruptArchiveError, match=r"^s.json: the part entry is a JSON list, not an object$"):
        Part.from_json([], "s.json: the part entry")
