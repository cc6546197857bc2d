"""The safetensors format as fp8ray reads and writes it, without Ray: a corpus of
malformed headers refused exactly as the ``safetensors`` package refuses them, files and
HTTP bodies checked by the same code, and the streaming writer."""

from __future__ import annotations

import errno
import json
import os
import struct

import numpy as np
import pyarrow.fs as pafs
import pytest
import safetensors
import torch
from _util import failing_fallocate
from safetensors.torch import load_file, save_file

import fp8ray.io.safetensors
from fp8ray.errors import MismatchError, SafetensorsFormatError
from fp8ray.io.safetensors import (
    ITEMSIZES,
    MAX_HEADER,
    HeaderTensors,
    RangeWriter,
    SafetensorsLayout,
    SafetensorsWriter,
    _checked_entries,
    _valid_columns,
    build_body,
    create_presized,
    header_prefix,
    parse_body,
    read_file_header,
)

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
    ("dtype a list", body({"a": {"dtype": ["U8"], "shape": [2], "data_offsets": [0, 2]}}, b"ab")),
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


def _tensor_members(data: bytes) -> tuple[dict, int] | None:
    """A corpus body's header members but ``__metadata__``, and its data size; ``None`` where
    the header is no JSON object (refused before any tensor is looked at)."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    header.pop("__metadata__", None)
    return header, len(data) - 8 - n


def _out_of_order(n: int = 200) -> bytes:
    """A body of ``n`` tensors of two dtypes, every fourth one empty, listed in reverse byte order."""
    members, begin = {}, 0
    for i in range(n):
        dtype, itemsize = ("BF16", 2) if i % 3 else ("F32", 4)
        end = begin + (i % 4) * 3 * itemsize
        members[f"k{i}"] = t(dtype, (i % 4, 3), begin, end)
        begin = end
    return body(dict(reversed(members.items())), bytes(begin))


TENSOR_CASES = [(name, data) for name, data in CORPUS + STRICTER if _tensor_members(data) is not None] + [
    ("200 tensors out of order", _out_of_order())
]


@pytest.mark.parametrize("name, data", TENSOR_CASES, ids=[name for name, _ in TENSOR_CASES])
def test_the_column_checks_accept_exactly_what_the_checks_one_by_one_accept(name, data):
    """A header's tensors are checked a column at a time, and one by one only where those
    checks fail (to name what is wrong): both must take the same tensors, in the same order."""
    header, data_size = _tensor_members(data)
    try:
        expected = HeaderTensors.of(_checked_entries(header, data_size, "x", ALL_DTYPES))
    except SafetensorsFormatError:
        expected = None
    got = _valid_columns(header, data_size, ALL_DTYPES)
    if expected is not None and not header:
        assert got is None  # no tensors: left to the checks one by one
    else:
        assert got == expected, name
    if got is not None:
        assert _valid_columns(header, data_size, ("I64",)) is None  # a dtype not allowed: named one by one


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


def test_a_presized_file_is_its_header_then_zeros_allocated_or_not(tmp_path, monkeypatch):
    layout = SafetensorsLayout.of([("a", "bfloat16", (3, 1000)), ("b", "float32", (5,))], {"m": "1"})
    path = tmp_path / "kv.safetensors"
    calls = []
    real = fp8ray.io.safetensors._fallocate or (lambda *args: 0)  # not Linux: as if allocated

    def recording(fd, mode, offset, length):
        calls.append((mode, offset, length))
        return real(fd, mode, offset, length)

    monkeypatch.setattr(fp8ray.io.safetensors, "_fallocate", recording)
    create_presized(str(path), layout)
    expected = layout.prefix + bytes(layout.file_bytes - len(layout.prefix))
    assert path.read_bytes() == expected
    assert calls == [(0, 0, layout.file_bytes)]  # the whole file asked for
    # A filesystem that cannot allocate leaves a hole: the same bytes.
    for code in (errno.EOPNOTSUPP, errno.EINVAL):
        monkeypatch.setattr(fp8ray.io.safetensors, "_fallocate", failing_fallocate(code))
        create_presized(str(path), layout)
        assert path.read_bytes() == expected


def test_a_full_disk_is_an_error_when_the_presized_file_is_created(tmp_path, monkeypatch):
    monkeypatch.setattr(fp8ray.io.safetensors, "_fallocate", failing_fallocate(errno.ENOSPC))
    with pytest.raises(OSError, match=os.strerror(errno.ENOSPC)) as caught:
        create_presized(str(tmp_path / "kv.safetensors"), SafetensorsLayout.of([("a", "float16", (8,))]))
    assert caught.value.errno == errno.ENOSPC


def test_a_range_writer_never_creates_its_file(tmp_path):
    """A shared file removed while its ranges are written is an error, not a new file."""
    with pytest.raises(FileNotFoundError):
        RangeWriter(str(tmp_path / "kv.safetensors"))
    assert list(tmp_path.iterdir()) == []


def test_files_written_by_the_package_read_back_in_file_order(tmp_path):
    path = tmp_path / "kv.safetensors"
    save_file({"z": torch.ones(2, dtype=torch.bfloat16), "a": torch.zeros(3, dtype=torch.float32)}, str(path), {"x": "y"})
    entries, metadata, start = read_file_header(pafs.LocalFileSystem(), str(path), str(path), ("BF16", "F32"))
    assert metadata == {"x": "y"} and start % 8 == 0
    assert sorted(e.key for e in entries) == ["a", "z"] and [e.begin for e in entries] == sorted(e.begin for e in entries)


def test_write_blocks_writes_the_file_write_writes(tmp_path):
    tensors = [(f"k{i}", "bfloat16", (i, 2)) for i in range(5)]
    data = np.arange(sum(i * 4 for i in range(5)), dtype=np.uint8)
    with SafetensorsWriter(str(tmp_path / "one.safetensors"), tensors) as w:
        start = 0
        for _, _, shape in tensors:
            w.write(data[start : start + shape[0] * 4])
            start += shape[0] * 4
    with SafetensorsWriter(str(tmp_path / "batched.safetensors"), tensors) as w:
        w.write_blocks(tensors[:2], data[:4])
        w.write_blocks(tensors[2:], data[4:])
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "batched.safetensors").read_bytes()


def test_write_blocks_refuses_other_tensors_or_sizes(tmp_path):
    tensors = [("a", "float16", (2,)), ("b", "float16", (3,))]
    with pytest.raises(MismatchError, match=r"expected tensor \('b', 'float16', \(3,\)\) next, got \('c'"):
        with SafetensorsWriter(str(tmp_path / "x.safetensors"), tensors) as w:
            w.write_blocks([("a", "float16", (2,)), ("c", "float16", (3,))], np.zeros(10, np.uint8))
    with pytest.raises(MismatchError, match="got 9 bytes, expected 10"):
        with SafetensorsWriter(str(tmp_path / "x.safetensors"), tensors) as w:
            w.write_blocks(tensors, np.zeros(9, np.uint8))
    with pytest.raises(MismatchError, match="3 more tensors, but 2 are left"):
        with SafetensorsWriter(str(tmp_path / "x.safetensors"), tensors) as w:
            w.write_blocks([*tensors, tensors[0]], np.zeros(14, np.uint8))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("metadata", [None, {}, {"k": "v", 'é"\\': "ü\n"}])
def test_header_prefix_is_json_dumps_text(metadata):
    """The header is written a tensor at a time, as the text ``json.dumps`` gives the whole."""
    tensors = [("a", "BF16", (2, 3), 12), ('q"uote\\', "F32", (), 4), ("ключ\u2028", "U8", (0, 7), 0), ("z", "F16", (5,), 10)]
    tensors += [("b", "BF16", (2, 3), 12), ("c", "BF16", [2, 3], 12), ("d", "F16", (2, 3), 12)]  # kinds again, a list
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, dtype, shape, nbytes in tensors:
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    assert header_prefix(tensors, metadata) == struct.pack("<Q", len(raw)) + raw
    with pytest.raises(SafetensorsFormatError, match="key 'a' appears twice"):
        header_prefix([*tensors, ("a", "U8", (1,), 1)], metadata)
    # With metadata or without (a Parquet source's key, written by get -o: the file did not load)
    with pytest.raises(SafetensorsFormatError, match=r"^key '__metadata__' is the name safetensors gives its header's metadata"):
        header_prefix([*tensors, ("__metadata__", "U8", (1,), 1)], metadata)


def test_a_header_nested_past_pythons_stack_is_refused_as_bad_json():
    """json.loads raises RecursionError, not ValueError, past about a thousand levels: a
    safetensors body or file doing so is refused as any malformed header is (the service's
    400, one line from the command), not a traceback or a 500."""
    text = ('{"__metadata__":' + "[" * 5000 + "]" * 5000 + "}").encode()
    text += b" " * (-len(text) % 8)
    with pytest.raises(SafetensorsFormatError, match="the header is not valid JSON text: maximum recursion depth"):
        parse_body(struct.pack("<Q", len(text)) + text, ALL_DTYPES)
