"""Archives on S3: sources, parts and manifest through pyarrow.fs against a real S3 API
(moto's server on 127.0.0.1), with the workers reading and writing the bucket themselves."""

from __future__ import annotations

import hashlib

import pyarrow.fs as pafs
import pytest
from _util import moto_s3

from fp8ray.engine.archives import compress_archive, decompress_archive, verify_archive
from fp8ray.errors import SourceError
from fp8ray.io.blocks import list_blocks
from fp8ray.io.paths import resolve

pytestmark = pytest.mark.usefixtures("ray_session")
BUCKET = "kvcache"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server (tests/_util.py); yields a function of a key that gives its s3:// URI."""
    with moto_s3(BUCKET) as uri:
        yield uri


def test_compress_verify_decompress_on_s3(s3, kv_source, tmp_path):
    src, tensors = kv_source
    fs, path = resolve(s3("src/kv.safetensors"))
    with fs.open_output_stream(path) as f:
        f.write(src.read_bytes())
    assert sorted(r.key for r in list_blocks(s3("src/kv.safetensors"))) == sorted(tensors)

    report = compress_archive(s3("src/kv.safetensors"), s3("arch"), scaling="token", part_bytes=200_000)
    local = compress_archive(str(src), str(tmp_path / "arch"), scaling="token", part_bytes=200_000)
    assert report.parts == local.parts > 1 and report.archive_bytes == local.archive_bytes
    afs, apath = resolve(s3("arch"))
    for part in sorted((tmp_path / "arch").glob("part-*.parquet")):  # the same bytes as a local run
        with afs.open_input_file(f"{apath}/{part.name}") as f:
            assert hashlib.sha256(f.read()).hexdigest() == hashlib.sha256(part.read_bytes()).hexdigest(), part.name

    with afs.open_input_stream(f"{apath}/_manifest.json") as f:
        manifest = f.read().decode()
    assert "testing:testing" not in manifest and "***@kvcache" in manifest  # no credentials stored
    assert "testing:testing" not in report.source

    checked = verify_archive(s3("arch"), against=s3("src/kv.safetensors"))
    assert checked.ok and checked.blocks == len(tensors) and set(checked.metrics) == set(tensors)

    out = tmp_path / "back.safetensors"
    decompress_archive(s3("arch"), str(out))
    from safetensors.torch import load_file

    back = load_file(str(out))
    assert sorted(back) == sorted(tensors)
    for key, t in tensors.items():
        assert back[key].dtype == t.dtype and back[key].shape == t.shape

    # --overwrite on an object store (no directory rename there): the new archive, whole.
    again = compress_archive(s3("src/kv.safetensors"), s3("arch"), scaling="block", part_bytes=400_000, overwrite=True)
    names = sorted(f.base_name for f in afs.get_file_info(pafs.FileSelector(apath)))
    assert names == ["_manifest.json", *(f"part-{i:05d}.parquet" for i in range(again.parts))]
    assert verify_archive(s3("arch"), against=s3("src/kv.safetensors")).ok
    # the source file given back onto the object store (the worker streams it there)
    decompress_archive(s3("arch"), s3("back/kv.safetensors"))
    bfs, bpath = resolve(s3("back/kv.safetensors"))
    with bfs.open_input_file(bpath) as f:
        assert load_file_bytes(f.read()).keys() == back.keys()


def load_file_bytes(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


def test_missing_s3_source_is_a_clear_error_without_credentials(s3):
    with pytest.raises(SourceError, match=r"s3://\*\*\*@kvcache/no/such/thing.safetensors\?.* does not exist") as info:
        list_blocks(s3("no/such/thing.safetensors"))
    assert "testing" not in str(info.value)
