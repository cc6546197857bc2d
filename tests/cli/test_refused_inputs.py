"""Inputs that must be refused are refused, before anything is written: tensors no frame
can hold, sources without tensors, malformed safetensors, and a verify against a source
that is not the one compressed."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from _util import run_cli
from safetensors.torch import save_file

import fp8ray
from fp8ray.io import archive

pytestmark = pytest.mark.usefixtures("ray_session")


def raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_a_folder_whose_only_files_are_skipped_names_them_with_why(tmp_path, capsys):
    """Its only .safetensors files left (a hidden one, a name not UTF-8) gave "holds no
    .safetensors or .parquet files", naming neither."""
    src = tmp_path / "kv"
    src.mkdir()
    save_file({"k": torch.ones(4)}, str(src / ".hidden.safetensors"))
    os.rename(str(src / ".hidden.safetensors").encode(), os.path.join(str(src).encode(), b"x\xe9.safetensors"))
    save_file({"k": torch.ones(4)}, str(src / ".hidden.safetensors"))
    (src / "notes.txt").write_text("not a candidate: not named")
    code, _, err = run_cli(capsys, "compress", src, tmp_path / "arch")
    assert (code, err) == (
        1,
        f"fp8ray: error: source {src} holds no .safetensors or .parquet files, in any folder; skipped .hidden.safetensors "
        "(hidden file), x\\udce9.safetensors (a name that is not UTF-8, which an archive cannot record)\n",
    )


def test_a_relative_path_from_a_deleted_working_directory_says_so(tmp_path, capsys, monkeypatch):
    """os.getcwd()'s FileNotFoundError was the whole message: "[Errno 2] No such file or directory"."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    code, _, err = run_cli(capsys, "compress", "kv.safetensors", "arch")
    assert (code, err) == (
        1,
        "fp8ray: error: path kv.safetensors is relative to the working directory, which no longer exists: cd to one "
        "that does, or give an absolute path\n",
    )


@pytest.mark.parametrize("ndim", [65, 66, 300])
def test_the_encoder_refuses_what_the_decoder_would(ndim):
    with pytest.raises(ValueError, match=rf"a tensor of {ndim} dimensions exceeds the frame's limit of 64"):
        fp8ray.Fp8Codec().encode(torch.ones((1,) * ndim))


def test_a_block_size_an_archive_cannot_record_is_refused_before_any_work(tmp_path, capsys):
    """2**31 to 2**32 - 1 passed the codec's check (a frame's field is a uint32) and then
    failed on the parts' int32 column with a traceback (OverflowError)."""
    src = tmp_path / "kv.safetensors"
    save_file({"kv": torch.randn(4, 64).to(torch.bfloat16)}, str(src))
    code, out, err = run_cli(capsys, "compress", src, tmp_path / "arch", "--block-size", 2**31, "--address", "inline")
    assert (code, out) == (1, "") and err == (
        "fp8ray: error: block_size 2147483648: an archive records it in 32-bit signed integers, at most 2147483647\n"
    )
    assert not (tmp_path / "arch").exists()
    assert run_cli(capsys, "compress", src, tmp_path / "arch", "--block-size", 2**31 - 1, "--address", "inline")[0] == 0


def test_a_66_dimension_tensor_is_refused_by_compress(tmp_path, capsys):
    src = raw_safetensors(
        tmp_path / "deep.safetensors", {"deep": {"dtype": "F32", "shape": [1] * 66, "data_offsets": [0, 4]}}, b"\0\0\0\0"
    )
    code, _, err = run_cli(capsys, "compress", src, tmp_path / "arch")
    assert code == 1 and err.count("\n") == 1 and "block 'deep'" in err and "limit of 64" in err
    assert not (tmp_path / "arch").exists()


def test_an_empty_tensor_numpy_cannot_shape_is_refused_naming_its_dimensions(tmp_path, capsys):
    big = {"dtype": "BF16", "shape": [2**32, 2**32, 0], "data_offsets": [0, 0]}
    src = raw_safetensors(
        tmp_path / "h.safetensors", {"big": big, "k": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}, bytes(8)
    )
    code, _, err = run_cli(capsys, "compress", src, tmp_path / "arch", "--address", "inline")
    assert code == 1 and err.count("\n") == 1, err
    shape = "shape [4294967296, 4294967296, 0]"
    assert f"block 'big' of h.safetensors: {shape}: its non-zero dimensions multiply to 18446744073709551616" in err
    assert not (tmp_path / "arch").exists()


@pytest.mark.parametrize("options", [[], ["--scaling", "none"], ["--scaling", "channel", "--scale-dtype", "float32"]])
def test_a_tensor_whose_frame_no_part_can_hold_is_refused_before_any_work(tmp_path, capsys, options):
    """A value of a Parquet column holds less than 2 GiB: a tensor of about 2**31 elements
    (4 GiB of bfloat16) failed in the worker, after reading and encoding it, with
    pyarrow's "cannot store strings". Refused now at the scan, naming its file and key;
    the file's data is a hole, never read."""
    codec = fp8ray.CodecOptions.parse({"scaling": options[1]} if options else {})
    if options[2:]:
        codec = fp8ray.CodecOptions.parse({"scale_dtype": "float32"}, base=codec)
    rows = 4
    size = lambda n: fp8ray.Fp8Codec(options=codec).encoded_size((rows, n), "bfloat16")  # noqa: E731
    low, n = 1, archive.MAX_FRAME_BYTES  # the smallest row length past the limit: size(low) fits, size(n) not
    while n - low > 1:
        low, n = (low, (low + n) // 2) if size((low + n) // 2) > archive.MAX_FRAME_BYTES else ((low + n) // 2, n)
    header = json.dumps({"kv": {"dtype": "BF16", "shape": [rows, n], "data_offsets": [0, 2 * rows * n]}}).encode()
    src = tmp_path / "big.safetensors"
    with open(src, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 2 * rows * n)
    code, _, err = run_cli(capsys, "compress", src, tmp_path / "arch", "--address", "inline", *options)
    assert code == 1 and err.count("\n") == 1, err
    assert f"block 'kv' of big.safetensors: its frame would be {size(n)} bytes, more than an archive's part" in err
    assert not (tmp_path / "arch").exists()


def test_the_frame_limit_is_pyarrows_less_a_margin():
    archive.check_frame_fits(archive.MAX_FRAME_BYTES)
    with pytest.raises(
        fp8ray.errors.BadInputError, match=f"more than an archive's part holds in one block \\({archive.MAX_FRAME_BYTES} "
    ):
        archive.check_frame_fits(archive.MAX_FRAME_BYTES + 1)


def test_a_source_without_tensors_is_an_error_not_an_empty_archive(tmp_path, capsys):
    src = tmp_path / "meta.safetensors"
    save_file({}, str(src), {"only": "metadata"})
    code, _, err = run_cli(capsys, "compress", src, tmp_path / "arch")
    assert code == 1 and "holds no tensors" in err and not (tmp_path / "arch").exists()


@pytest.mark.parametrize(
    "header, data, message",
    [
        ({"a": {"dtype": "F32", "shape": [0, 1e30], "data_offsets": [0, 0]}}, b"", "shape [0, 1e+30]; expected a list of"),
        ({"a": {"dtype": "F32", "shape": ["4"], "data_offsets": [0, 16]}}, bytes(16), 'shape ["4"]; expected a list of integers'),
        # Non-negative but past 2**64 - 1 (it was called negative), and JSON's true not Python's True.
        (
            {"a": {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}},
            b"",
            f"shape [0, {2**70}]; expected a list of integers from",
        ),
        ({"a": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}}, bytes(16), "shape [true, 4]; expected a list"),
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            },
            bytes(16),
            "overlaps",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            bytes(12),
            "gap",
        ),
    ],
)
def test_malformed_safetensors_are_refused_in_one_line(tmp_path, capsys, header, data, message):
    src = raw_safetensors(tmp_path / "bad.safetensors", header, data)
    code, _, err = run_cli(capsys, "compress", src, tmp_path / "arch")
    assert code == 1 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "arch").exists()


def test_verify_against_another_source_with_the_same_keys_fails(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    same_keys = lambda: {f"layer{i}.k": torch.randn(4, 32, 64, generator=g).to(torch.bfloat16) for i in range(3)}  # noqa: E731
    save_file(same_keys(), str(tmp_path / "a.safetensors"))
    save_file(same_keys(), str(tmp_path / "b.safetensors"))  # same keys and shapes, other values
    assert run_cli(capsys, "compress", tmp_path / "a.safetensors", tmp_path / "arch")[0] == 0
    assert run_cli(capsys, "verify", tmp_path / "arch", "--against", tmp_path / "a.safetensors")[0] == 0
    code, out, err = run_cli(capsys, "verify", tmp_path / "arch", "--against", tmp_path / "b.safetensors")
    assert code == 1 and "3 problems" in out
    assert "block 'layer0.k' in part-00000.parquet: " in err and "elements out of their bound; the first, element [" in err


def test_verify_against_a_source_whose_metadata_differs_fails(tmp_path, capsys):
    """decompress gives the archive's __metadata__ back: a source with other metadata (the
    same tensors) is not what the archive holds. It passed before, naming nothing."""
    tensors = {"layer0.k": torch.ones(4, 64, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "a.safetensors"), metadata={"model": "x", "step": "1"})
    save_file(tensors, str(tmp_path / "b.safetensors"), metadata={"model": "y", "step": "1"})
    save_file(tensors, str(tmp_path / "c.safetensors"))
    assert run_cli(capsys, "compress", tmp_path / "a.safetensors", tmp_path / "arch", "--address", "inline")[0] == 0
    assert run_cli(capsys, "verify", tmp_path / "arch", "--against", tmp_path / "a.safetensors")[0] == 0
    save_file(tensors, str(tmp_path / "d.safetensors"), metadata={"model": "x", "step": "1\n" + "9" * 100})
    for other, says in (
        ("b", "'model' is 'x' in the archive, 'y' in the source"),
        ("c", "'model' is 'x' in the archive, absent in the source"),
        ("d", "'step' is '1' in the archive, '1\\n" + "9" * 53 + "... in the source"),  # escaped once, cut at 60
    ):
        code, out, err = run_cli(capsys, "verify", tmp_path / "arch", "--against", tmp_path / f"{other}.safetensors")
        assert code == 1 and "1 problem" in out, out
        assert f"source file {other}.safetensors: its __metadata__ differs from the archive's: {says}" in err, err
    # What decompress --single-file writes adds the archive's options to its metadata: still the archive's own
    single = tmp_path / "single.safetensors"
    assert run_cli(capsys, "decompress", tmp_path / "arch", single, "--single-file", "--address", "inline")[0] == 0
    header = single.read_bytes()[8 : 8 + struct.unpack("<Q", single.read_bytes()[:8])[0]]
    assert "fp8ray_archive" in json.loads(header)["__metadata__"]
    assert run_cli(capsys, "verify", tmp_path / "arch", "--against", single)[0] == 0


def test_a_non_finite_block_is_named_with_its_file(tmp_path, capsys):
    """Every file of a directory holds 'layer0.k': the error said only "block 'layer0.k'"."""
    src = tmp_path / "kv"
    src.mkdir()
    for i in range(3):
        x = torch.ones(8, 64, dtype=torch.bfloat16)
        if i == 2:
            x[1, 3] = float("nan")
        save_file({"layer0.k": x}, str(src / f"req{i}.safetensors"))
    code, _, err = run_cli(capsys, "compress", src, tmp_path / "arch", "--address", "inline")
    assert code == 1 and err.startswith("fp8ray: error: block 'layer0.k' of req2.safetensors: 1 non-finite value"), err


def test_a_file_of_service_frames_is_refused_not_archived_as_opaque_bytes(tmp_path, capsys):
    """The service's safetensors encode response saved as a file (U8 frames, marked in
    __metadata__) is fp8 already: compressing it would archive the frames as stored
    bytes, larger than they are. compress refuses it naming the file and what to do;
    the frames, decoded, compress as any tensors do."""
    from fp8ray.io.safetensors import FRAMES_BODY, FRAMES_MARK, build_body

    tensors = {"k": torch.randn(4, 64).to(torch.bfloat16), "v": torch.randn(4, 64).to(torch.bfloat16)}
    frames = [(key, "uint8", (len(f),), f) for key, f in ((k, bytes(fp8ray.Fp8Codec().encode(t))) for k, t in tensors.items())]
    src = tmp_path / "frames.safetensors"
    src.write_bytes(build_body(frames, {"model": "m", FRAMES_MARK: FRAMES_BODY}))
    code, out, err = run_cli(capsys, "compress", src, tmp_path / "arch", "--address", "inline")
    assert (code, out) == (1, "") and err.count("\n") == 1
    assert f"{src} holds fp8ray frames already" in err and "POST /v1/decode" in err
    assert not (tmp_path / "arch").exists()
    from safetensors.torch import load_file

    decoded = {key: fp8ray.decode(t.numpy()) for key, t in load_file(str(src)).items()}
    save_file(decoded, str(tmp_path / "kv.safetensors"))
    assert run_cli(capsys, "compress", tmp_path / "kv.safetensors", tmp_path / "arch", "--address", "inline")[0] == 0
