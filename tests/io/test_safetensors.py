"""The safetensors format as fp8ray reads and writes it, without Ray: a corpus of
malformed headers refused exactly as the ``safetensors`` package refuses them, files and
HTTP bodies checked by the same code, and the streaming writer."""

from __future__ import annotations

import json
import struct

import numpy as np
import pyarrow.fs as pafs
import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

from fp8ray.errors import SafetensorsFormatError
from fp8ray.io.safetensors import ITEMSIZES, MAX_HEADER, SafetensorsWriter, build_body, parse_body, read_file_header

ALL_DTYPES = tuple(ITEMSIZES)


def body(header, data: bytes = b"", raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + data


def t(dtype="U8", shape=(2,), begin=0, end=2, **extra) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end], **extra}


# (name, body bytes). Each is run through the safetensors package and through fp8ray.
CORPUS = [
    ("valid", body({"a": t()}, b"ab")),
    ("valid, two tensors in reverse key order", body({"b": t(begin=2, end=4), "a": t()}, b"abcd")),
    ("valid, metadata", body({"__metadata__": {"k": "v"}, "a": t()}, b"ab")),
    ("valid, null metadata", body(None, b"ab", raw=b'{"__metadata__":null,"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}')),
    ("valid, empty", body({})),
    ("valid, empty tensor first", body({"e": t(shape=(0,), end=0), "a": t()}, b"ab")),
    ("valid, 0-d tensor", body({"s": t("F32", (), 0, 4)}, b"abcd")),
    ("valid, extra entry field", body({"a": t(extra=1)}, b"ab")),
    ("valid, whitespace around", body(None, b"ab", raw=b' {"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}  ')),
    ("too short", b"\x01\x00"),
    ("header longer than the body", struct.pack("<Q", 100) + b"{}"),
    ("header over the cap", struct.pack("<Q", MAX_HEADER + 1) + b"{}"),
    ("header length 2**64-1", struct.pack("<Q", 2**64 - 1) + b"{}"),
    ("not UTF-8", body(None, raw=b'{"\xff":1}')),
    ("not JSON", body(None, raw=b"{nope")),
    ("JSON array", body(None, raw=b"[]")),
    ("NaN literal", body(None, b"ab", raw=b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":NaN}')),
    ("lone surrogate key", body(None, b"ab", raw=b'{"a\\ud800":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}')),
    ("gap between tensors", body({"a": t(), "b": t(begin=3, end=5)}, b"abcde")),
    ("overlapping tensors", body({"a": t(), "b": t()}, b"ab")),
    ("1024 tensors on the same bytes", body({f"k{i}": t("U8", (1024,), 0, 1024) for i in range(1024)}, bytes(1024))),
    ("data not covered", body({"a": t()}, b"abc")),
    ("data short", body({"a": t()}, b"a")),
    ("offsets reversed", body({"a": t(begin=2, end=0)}, b"ab")),
    ("size does not match shape", body({"a": t(shape=(3,))}, b"ab")),
    ("float shape", body({"a": {"dtype": "U8", "shape": [2.0], "data_offsets": [0, 2]}}, b"ab")),
    ("fractional shape", body({"a": {"dtype": "U8", "shape": [4.9], "data_offsets": [0, 2]}}, b"ab")),
    ("string shape", body({"a": {"dtype": "U8", "shape": ["2"], "data_offsets": [0, 2]}}, b"ab")),
    ("boolean shape", body({"a": {"dtype": "U8", "shape": [True, True], "data_offsets": [0, 2]}}, b"ab")),
    ("negative shape", body({"a": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}}, b"ab")),
    ("shape over 2**64", body({"a": {"dtype": "U8", "shape": [2**64], "data_offsets": [0, 2]}}, b"ab")),
    ("shape not a list", body({"a": {"dtype": "U8", "shape": 2, "data_offsets": [0, 2]}}, b"ab")),
    ("float offset", body({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2.0]}}, b"ab")),
    ("three offsets", body({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2, 2]}}, b"ab")),
    ("missing dtype", body({"a": {"shape": [2], "data_offsets": [0, 2]}}, b"ab")),
    ("unknown dtype", body({"a": t("X9")}, b"ab")),
    ("dtype not a string", body({"a": {"dtype": 1, "shape": [2], "data_offsets": [0, 2]}}, b"ab")),
    ("entry not an object", body({"a": "U8"}, b"ab")),
    ("metadata value not a string", body({"__metadata__": {"k": 1}, "a": t()}, b"ab")),
    ("metadata not an object", body({"__metadata__": "k", "a": t()}, b"ab")),
    ("duplicate field in an entry", body(None, b"ab", raw=b'{"a":{"dtype":"U8","shape":[2],"shape":[2],"data_offsets":[0,2]}}')),
    (
        "duplicate __metadata__",
        body(None, b"ab", raw=b'{"__metadata__":{},"__metadata__":{},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'),
    ),
]
# Where fp8ray refuses on purpose what the package accepts: a key given twice. The
# package keeps the last one silently; for fp8ray that would lose a tensor without a word.
STRICTER = [
    (
        "duplicate tensor key",
        body(
            None,
            b"ab",
            raw=b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}',
        ),
    ),
    (
        "duplicate metadata key",
        body(None, b"ab", raw=b'{"__metadata__":{"k":"1","k":"2"},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'),
    ),
]


def package_accepts(data: bytes) -> bool:
    try:
        safetensors.deserialize(data)
        return True
    except Exception:  # the package raises SafetensorError or its own parse errors
        return False


def fp8ray_accepts_body(data: bytes) -> bool:
    try:
        parse_body(data, ALL_DTYPES)
        return True
    except SafetensorsFormatError:
        return False


def fp8ray_accepts_file(data: bytes, path) -> bool:
    path.write_bytes(data)
    try:
        read_file_header(pafs.LocalFileSystem(), str(path), str(path), ALL_DTYPES)
        return True
    except SafetensorsFormatError:
        return False


@pytest.mark.parametrize("name, data", CORPUS, ids=[name for name, _ in CORPUS])
def test_fp8ray_refuses_what_the_safetensors_package_refuses(name, data, tmp_path):
    expected = package_accepts(data)
    assert fp8ray_accepts_body(data) == expected, f"{name}: the package {'accepts' if expected else 'refuses'} it"
    assert fp8ray_accepts_file(data, tmp_path / "x.safetensors") == expected


@pytest.mark.parametrize("name, data", STRICTER, ids=[name for name, _ in STRICTER])
def test_keys_given_twice_are_refused(name, data, tmp_path):
    assert package_accepts(data)
    with pytest.raises(SafetensorsFormatError, match="appears twice"):
        parse_body(data, ALL_DTYPES)
    assert not fp8ray_accepts_file(data, tmp_path / "x.safetensors")


def test_the_header_cap_is_named_as_such(tmp_path):
    """A header length under the file's size but over the format's cap is reported as the
    cap, not as running past the file."""
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 200_000_000))
        f.truncate(250_000_000)
    with pytest.raises(SafetensorsFormatError, match=r"they read as 200000000, the format allows at most 100000000$"):
        read_file_header(pafs.LocalFileSystem(), str(path), str(path), ALL_DTYPES)


def test_errors_name_the_key_and_the_numbers():
    with pytest.raises(SafetensorsFormatError, match=r"key 'b' at bytes \[0, 2\) overlaps the tensor before it") as exc:
        parse_body(body({"a": t(), "b": t()}, b"ab"), ALL_DTYPES)
    assert exc.value.field == "b"
    with pytest.raises(SafetensorsFormatError, match=r"key 'a' has dtype I32; expected one of \['BF16'\]"):
        parse_body(body({"a": t("I32", (1,), 0, 4)}, b"abcd"), ("BF16",))


def test_bodies_round_trip_and_agree_with_the_package():
    tensors = {"k": torch.randn(3, 4, dtype=torch.bfloat16), "v": torch.randn(5, dtype=torch.float32)}
    data = build_body(
        [(k, str(v.dtype).removeprefix("torch."), tuple(v.shape), v.view(torch.uint8).numpy()) for k, v in tensors.items()],
        {"m": "1"},
    )
    loaded = safetensors.torch.load(data)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    entries, metadata = parse_body(data, ("BF16", "F32"))
    assert metadata == {"m": "1"} and [e.key for e, _ in entries] == ["k", "v"]
    for e, raw in entries:
        assert bytes(raw) == tensors[e.key].view(torch.uint8).numpy().tobytes()


def test_writer_streams_a_file_the_package_reads(tmp_path):
    tensors = {"layer0.k": torch.randn(2, 8, dtype=torch.float16), "layer0.v": torch.randn(2, 8, dtype=torch.float16)}
    path = tmp_path / "out.safetensors"
    with SafetensorsWriter(str(path), [(k, "float16", tuple(v.shape)) for k, v in tensors.items()], {"a": "b"}) as w:
        for v in tensors.values():
            w.write(v.view(torch.uint8).numpy())
    loaded = load_file(str(path))
    assert list(loaded) == list(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]


def test_writer_leaves_nothing_when_it_fails(tmp_path):
    path = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match=r"got 3 bytes, expected 4"):
        with SafetensorsWriter(str(path), [("a", "float16", (2,))]) as w:
            w.write(np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="only 0 of 1 tensors"), SafetensorsWriter(str(path), [("a", "float16", (2,))]):
        pass
    assert list(tmp_path.iterdir()) == []


def test_files_written_by_the_package_read_back_in_file_order(tmp_path):
    path = tmp_path / "kv.safetensors"
    save_file({"z": torch.ones(2, dtype=torch.bfloat16), "a": torch.zeros(3, dtype=torch.float32)}, str(path), {"x": "y"})
    entries, metadata, start = read_file_header(pafs.LocalFileSystem(), str(path), str(path), ("BF16", "F32"))
    assert metadata == {"x": "y"} and start % 8 == 0
    assert sorted(e.key for e in entries) == ["a", "z"] and [e.begin for e in entries] == sorted(e.begin for e in entries)
