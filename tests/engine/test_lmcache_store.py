"""LMCache filesystem stores: chunk names (against LMCache's own functions), the forms a
chunk file takes, and conversion between them on Ray: raw <-> LMCache's fp8 serde <->
fp8ray's serde, checked against the serializers LMCache runs and against LMCache's own
filesystem adapter reading and writing the same directories.

The fake store holds chunk files named as LMCache's FS adapter names them, in the small
layout bfloat16 [2, 2, 16, 64] with K about 8 and V about 1/64 in magnitude (so that V
reaches e4m3fn's subnormal range), plus files the conversion must leave alone.

Round-trip bound (docs/ACCURACY.md with scaling none, scale 1): x / 1 and q * 1 are
exact and every e4m3fn value is exact in bfloat16, so the only error is the fp8 rounding:

    |y - x| <= (u / (1 + u)) |x| + 2^(emin_sub - 1),   u = 2^-4, emin_sub = -9 (e4m3fn)

for |x| <= 448; beyond it the value saturates to +-448 by design.
"""

from __future__ import annotations

import hashlib
import json
import os
from types import SimpleNamespace

import pytest
import torch

import fp8ray
from fp8ray.cli import main
from fp8ray.codec import CodecOptions, Fp8Codec
from fp8ray.codec.frame import parse_header
from fp8ray.engine.stores import compress_store, decompress_store
from fp8ray.errors import (
    ArchiveExistsError,
    BadInputError,
    CorruptFrameError,
    DestinationError,
    MismatchError,
    NonFiniteError,
    SourceError,
)
from fp8ray.io import lmcache_store
from fp8ray.io.lmcache_store import (
    ChunkName,
    form_of,
    format_chunk_name,
    hash_folders,
    parse_chunk_name,
    parse_layout,
    scan_store,
)
from fp8ray.io.paths import TMP_MARK
from fp8ray.lmcache import Fp8QuantizationSerializer
from fp8ray.lmcache.store_files import StoreConversion, convert_files

pytestmark = pytest.mark.usefixtures("ray_session")

LAYOUT = "bfloat16:2,2,16,64"
SHAPE = (2, 2, 16, 64)
NUMEL = 2 * 2 * 16 * 64
RAW = NUMEL * 2
U, HALF_SUBNORMAL = 2.0**-4, 2.0**-10  # e4m3fn


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def kv_rank(world_size: int, rank: int) -> int:
    """LMCache's ObjectKey.ComputeKVRank with local == global."""
    return (world_size << 24) | (rank << 16) | (world_size << 8) | rank


CHUNKS = [
    ChunkName("meta-llama/Llama-3.1-8B-Instruct", kv_rank(1, 0), 0, bytes.fromhex("9f3a" * 16)),
    ChunkName("meta-llama/Llama-3.1-8B-Instruct", kv_rank(2, 1), 0, bytes.fromhex("0b17" * 16)),
    ChunkName("meta-llama/Llama-3.1-8B-Instruct", kv_rank(1, 0), 0x1F, bytes.fromhex("c4d5" * 16), "tenant-42"),
    ChunkName("Qwen/Qwen2.5-7B-Instruct", kv_rank(1, 0), 0, bytes.fromhex("77aa" * 16)),
    ChunkName("local-model", kv_rank(1, 0), 2, bytes.fromhex("01" * 8)),
]


def chunk_tensor(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(SHAPE, generator=g)
    kv[0] *= 8.0  # K
    kv[1] /= 64.0  # V: many values below e4m3fn's smallest normal 2^-6
    if seed == len(CHUNKS) - 1:  # the last chunk also has values beyond e4m3fn's range (+-448)
        kv[0, 0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 464.0])
    return kv.to(torch.bfloat16)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def store(tmp_path):
    src = tmp_path / "store"
    src.mkdir()
    tensors = {}
    for i, chunk in enumerate(CHUNKS):
        name = format_chunk_name(chunk)
        tensors[name] = chunk_tensor(i)
        (src / name).write_bytes(tensor_bytes(tensors[name]))
    short = format_chunk_name(ChunkName("meta-llama/Llama-3.1-8B-Instruct", kv_rank(1, 0), 0, b"\x01\x02"))
    (src / short).write_bytes(b"\0" * (RAW - 2))
    (src / "notes.data").write_bytes(b"\0" * RAW)  # right size, not a chunk name
    (src / "m@0x1@zz@00.data").write_bytes(b"\0" * RAW)  # object_group_id is not hex
    (src / "tmp").mkdir()  # e.g. LMCache's relative_tmp_dir
    skipped = {
        short: "bytes, the layout bfloat16:2,2,16,64 needs",
        "notes.data": "not an LMCache chunk name",
        "m@0x1@zz@00.data": "not an LMCache chunk name",
        "tmp/": "not a regular file",
    }
    return src, tensors, skipped


def digests(directory) -> dict[str, str]:
    return {p.name: sha(p.read_bytes()) for p in sorted(directory.iterdir()) if p.is_file()}


def test_chunk_names_follow_lmcache():
    name = ChunkName("meta-llama/Llama-3.1-8B", 0x01000100, 0x1F, bytes.fromhex("00ff10"), "tenant")
    assert format_chunk_name(name) == "meta-llama-SEP-Llama-3.1-8B@0x01000100@1f@00ff10@tenant.data"
    assert format_chunk_name(ChunkName("m", 1, 0, b"\xab")) == "m@0x00000001@0@ab.data"
    for chunk in CHUNKS:
        assert parse_chunk_name(format_chunk_name(chunk)) == chunk
    assert parse_chunk_name("a-SEP-b-SEP-c@0x2@A@FF.data") == ChunkName("a/b/c", 2, 10, b"\xff")
    bad = {
        "m@0x1@0@ab.bin": "does not end in .data",
        "m@0x1@ab.data": "3 '@'-separated fields",
        "m@0x1@0@ab@salt@x.data": "6 '@'-separated fields",
        "m@0x1@0@abc.data": "malformed",  # odd number of hex digits
        "m@rank@0@ab.data": "malformed",
        "m@0x1@-1@ab.data": "object_group_id must be >= 0",
        f"m@0x1@0@ab@{'s' * 129}.data": "at most 128",
        "m@0x1@0@ab@a\\b.data": "cache_salt must not contain",
    }
    for filename, reason in bad.items():
        with pytest.raises(ValueError, match=reason):
            parse_chunk_name(filename)
    with pytest.raises(ValueError, match="'@'"):
        ChunkName("a@b", 0, 0, b"")


def test_layout_parsing():
    assert parse_layout("bfloat16:2,30,256,192").shape == (2, 30, 256, 192)
    assert parse_layout("float32:4").raw_bytes == 16
    # int64 and the 1-byte dtypes frames store: not a KV layout (a raw int8 chunk is as long as its fp8 form)
    for text in ("bf16:2,3", "bfloat16", "bfloat16:2,x", "float16:2,0", "int64:2,4", "int8:4", "bool:4", "float8_e4m3fn:4"):
        with pytest.raises(ValueError, match="layout"):
            parse_layout(text)


def test_chunk_names_equal_lmcaches_own():
    """fp8ray writes and reads the names of lmcache 0.5.6's FS adapter (fs_l2_adapter.py's
    _object_key_to_filename / _filename_to_object_key): same name for every key, same
    fields for every name, and a name LMCache does not parse is not a chunk name here."""
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _filename_to_object_key, _object_key_to_filename

    keys = [
        ObjectKey(
            chunk_hash=c.chunk_hash,
            model_name=c.model,
            kv_rank=c.kv_rank,
            object_group_id=c.object_group_id,
            cache_salt=c.cache_salt,
        )
        for c in CHUNKS
    ] + [
        ObjectKey(chunk_hash=b"", model_name="", kv_rank=0),
        ObjectKey(
            chunk_hash=bytes(range(256)), model_name="a/b/c d_é", kv_rank=2**32 - 1, object_group_id=2**40, cache_salt="x" * 128
        ),
        ObjectKey(chunk_hash=b"\x00", model_name="m-SEP-n", kv_rank=7, cache_salt="tenant\x1b[31m"),
    ]
    for key in keys:
        name = _object_key_to_filename(key)
        ours = ChunkName(key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash, key.cache_salt)
        assert format_chunk_name(ours) == name
        theirs = _filename_to_object_key(name)
        parsed = parse_chunk_name(name)
        assert (parsed.model, parsed.kv_rank, parsed.object_group_id, parsed.chunk_hash, parsed.cache_salt) == (
            theirs.model_name,
            theirs.kv_rank,
            theirs.object_group_id,
            theirs.chunk_hash,
            theirs.cache_salt,
        )
    for name in (
        "m@0x1@0@ab.bin",
        "m@0x1@ab.data",
        "m@0x1@0@ab@s@x.data",
        "m@0x1@0@abc.data",
        "m@zz@0@ab.data",
        "m@0x1@-1@ab.data",
        f"m@0x1@0@ab@{'s' * 129}.data",
        "m@0x1@0@ab@a\\b.data",
        ".data",
    ):
        assert _filename_to_object_key(name) is None
        with pytest.raises(ValueError):
            parse_chunk_name(name)


def fp8_bytes(t: torch.Tensor, fp8=torch.float8_e4m3fn) -> bytes:
    """What LMCache's fp8 serde stores (fp8ray's drop-in pair: the same bytes where the cast is finite)."""
    out = torch.empty(t.numel(), dtype=torch.uint8)
    Fp8QuantizationSerializer(fp8).serialize(SimpleNamespace(tensor=t), SimpleNamespace(tensor=out))
    return out.numpy().tobytes()


def from_fp8(data: bytes) -> torch.Tensor:
    codes = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn).to(torch.bfloat16).reshape(SHAPE)


def from_raw(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).reshape(SHAPE)


def test_chunk_file_forms(tmp_path):
    layout = parse_layout(LAYOUT)
    x = chunk_tensor(0)
    frame_default = bytes(Fp8Codec().encode(x))
    frame_token = bytes(Fp8Codec(scaling="token", scale_dtype="float32").encode(x))
    assert form_of(layout, RAW, tensor_bytes(x)[:600]) == ("raw", "")
    assert form_of(layout, NUMEL, b"") == ("fp8", "")
    for data in (frame_default, frame_token):  # any options: the header says how long the frame is
        assert form_of(layout, len(data), data[:600]) == ("fp8ray", "")
    other = bytes(Fp8Codec().encode(x[:, :, :8]))
    assert form_of(layout, len(other), other) == (
        None,
        "an fp8ray frame of bfloat16:2,2,8,64, not of the layout bfloat16:2,2,16,64",
    )
    form, reason = form_of(layout, len(frame_default) - 3, frame_default[:600])
    assert form is None and "truncated or padded" in reason
    form, reason = form_of(layout, 100, b"\0" * 100)
    assert form is None and reason == (
        "100 bytes, the layout bfloat16:2,2,16,64 needs 8192 bytes (bfloat16), "
        "4096 (LMCache fp8) or an fp8ray frame of that shape"
    )
    for name, data in (  # no raw chunk beside the fp8 one (the next test)
        ("a@0x1@0@02.data", fp8_bytes(x)),
        ("a@0x1@0@03.data", frame_token),
        ("a@0x1@0@04.data", other),
    ):
        (tmp_path / name).write_bytes(data)
    scan = scan_store(str(tmp_path), layout)
    assert [(c.name, c.form, c.size) for c in scan.chunks] == [
        ("a@0x1@0@02.data", "fp8", NUMEL),
        ("a@0x1@0@03.data", "fp8ray", len(frame_token)),
    ]
    assert [s["name"] for s in scan.skipped] == ["a@0x1@0@04.data"]


def test_a_frame_as_long_as_a_plain_chunk_is_told_by_its_header(tmp_path):
    """Under token scaling the frame of a last, shorter chunk can be exactly numel bytes
    (2,13,31,64 against the layout 2,13,32,64: 48 + 806 * 2 + 51584 + 4 = 53248): it was
    read as LMCache fp8 codes, "converted" into garbage and archived, saying nothing."""
    layout = parse_layout("bfloat16:2,13,32,64")
    codec = Fp8Codec(scaling="token")
    full = bytes(codec.encode(torch.randn(2, 13, 32, 64).bfloat16()))
    short = bytes(codec.encode(torch.randn(2, 13, 31, 64).bfloat16()))
    assert len(short) == layout.numel
    reason = "an fp8ray frame of bfloat16:2,13,31,64, not of the layout bfloat16:2,13,32,64"
    assert form_of(layout, len(short), short[:600]) == (None, reason)
    (tmp_path / "m@0x1@0@01.data").write_bytes(full)
    (tmp_path / "m@0x1@0@ff.data").write_bytes(short)
    scan = scan_store(str(tmp_path), layout)
    assert [(c.name, c.form) for c in scan.chunks] == [("m@0x1@0@01.data", "fp8ray")]
    assert scan.skipped == [{"name": "m@0x1@0@ff.data", "reason": reason}]


def test_plain_files_of_both_sizes_are_read_as_the_store_says_never_guessed(tmp_path, capsys):
    """A raw bfloat16 chunk of half the tokens (save_unfull_chunk) has an fp8 chunk's size,
    and an fp8 chunk of twice the tokens a raw chunk's. Taken for raw before, a store of fp8
    chunks read with its half-token layout became frames of garbage (fp8 byte pairs read as
    bfloat16: values of 1e12); the half raw chunk had been copied as fp8 before that. Files
    of both sizes: refused until --plain-form says which the store holds."""
    layout = parse_layout(LAYOUT)
    full, half = chunk_tensor(0), chunk_tensor(1)[:, :, :8]
    assert len(tensor_bytes(half)) == NUMEL
    names = [format_chunk_name(c) for c in CHUNKS[:3]]
    src = tmp_path / "store"
    src.mkdir()
    for name, data in zip(names, (tensor_bytes(full), tensor_bytes(half), bytes(Fp8Codec().encode(full)))):
        (src / name).write_bytes(data)
    with pytest.raises(MismatchError, match=r"holds 1 file of 8192 bytes and 1 of 4096: .* say which with --plain-form"):
        scan_store(str(src), layout)
    assert main(["lmcache-compress", str(src), str(tmp_path / "refused"), "--layout", LAYOUT, "--address", "inline"]) == 1
    assert "--plain-form raw or fp8" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    raw_store = scan_store(str(src), layout, "raw")  # the half chunk is of another layout
    assert sorted((c.name, c.form) for c in raw_store.chunks) == sorted([(names[0], "raw"), (names[2], "fp8ray")])
    assert raw_store.skipped == [
        {
            "name": names[1],
            "reason": f"{NUMEL} bytes, a raw chunk of 1/2 of the tokens (save_unfull_chunk) in a store of raw chunks "
            "(--plain-form raw): a chunk of another layout",
        }
    ]
    fp8_store = scan_store(str(src), layout, "fp8")  # the 8192-byte file is an fp8 chunk of twice the tokens
    assert sorted((c.name, c.form) for c in fp8_store.chunks) == sorted([(names[1], "fp8"), (names[2], "fp8ray")])
    assert [s["name"] for s in fp8_store.skipped] == [names[0]] and "(--plain-form fp8)" in fp8_store.skipped[0]["reason"]
    for command in ("lmcache-compress", "lmcache-decompress"):
        out = tmp_path / command
        argv = [command, str(src), str(out), "--layout", LAYOUT, "--plain-form", "raw", "--address", "inline"]
        assert main(argv) == 0
        assert names[1] not in os.listdir(out) and f"skipped '{names[1]}'" in capsys.readouterr().err
    arch = tmp_path / "arch"
    argv = ["compress", str(src), str(arch), "--lmcache-layout", LAYOUT, "--plain-form", "raw", "--address", "inline"]
    assert main(argv) == 0 and names[1] in capsys.readouterr().out  # named as skipped
    (src / names[0]).unlink()  # no raw-sized file left: one of numel bytes is an fp8 chunk
    assert sorted((c.name, c.form) for c in scan_store(str(src), layout).chunks) == sorted(
        [(names[1], "fp8"), (names[2], "fp8ray")]
    )


def test_skipped_folders_end_in_a_slash(tmp_path):
    """As docs/FORMAT.md names them, so a summary counts them as folders, not files."""
    (tmp_path / "tmp").mkdir()  # not a hash-prefix folder
    (tmp_path / "9f").mkdir()  # an empty one
    (tmp_path / "link").symlink_to(tmp_path / "tmp")
    (tmp_path / "loop1").symlink_to("loop2")  # a loop of links (ELOOP) failed the whole scan
    (tmp_path / "loop2").symlink_to("loop1")
    (tmp_path / "notes.txt").write_text("x")
    scan = scan_store(str(tmp_path), parse_layout(LAYOUT))
    assert [s["name"] for s in scan.skipped] == ["9f/", "link/", "loop1", "loop2", "notes.txt", "tmp/"]


def test_unreadable_files_and_folders_are_skipped_whatever_their_size(tmp_path, monkeypatch):
    """An unreadable chunk file of the fp8 form's size was taken (the scan did not open
    it), and the whole conversion failed on it later with the system's "Permission
    denied"; an unreadable hash-prefix folder failed the scan with it. Both are skipped
    and named now, as an unreadable file of any other size was. As root nothing is
    unreadable, so the system's answers are stood in for."""
    x = chunk_tensor(0)
    names = [format_chunk_name(c) for c in CHUNKS[:2]]
    (tmp_path / names[0]).write_bytes(fp8_bytes(x))
    (tmp_path / names[1]).write_bytes(fp8_bytes(x))
    (tmp_path / "9f").mkdir()
    scandir = os.scandir
    locked = {str(tmp_path / names[1]), str(tmp_path / "9f")}

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    def locked_open(path, *args):
        return denied(path) if str(path) in locked else open(path, *args)  # noqa: SIM115 (the scan's open, closed by it)

    monkeypatch.setattr(lmcache_store, "open", locked_open, raising=False)
    monkeypatch.setattr(os, "scandir", lambda path=".": denied(path) if str(path).rstrip("/") in locked else scandir(path))
    scan = scan_store(str(tmp_path), parse_layout(LAYOUT))
    assert [(c.name, c.form) for c in scan.chunks] == [(names[0], "fp8")]
    assert scan.skipped == [
        {"name": "9f/", "reason": "unreadable: Permission denied"},
        {"name": names[1], "reason": "unreadable: Permission denied"},
    ]


def test_compress_writes_exactly_the_fp8_serde_files_and_decompress_restores_within_bound(store, tmp_path):
    src, tensors, skipped = store
    before = digests(src)
    dst = tmp_path / "store.fp8"
    report = compress_store(str(src), str(dst), LAYOUT, pool=fp8ray.PoolSettings(num_workers=2))

    assert digests(src) == before  # the source is never touched
    assert sorted(os.listdir(dst)) == sorted(tensors)  # same names; skipped files are not copied
    assert report.files == len(tensors) and report.converted_from == {"raw": len(tensors)} and report.unchanged == []
    assert report.bytes_before == len(tensors) * RAW and report.bytes_after == len(tensors) * NUMEL
    assert {s["name"]: s["reason"] for s in report.skipped}.keys() == skipped.keys()
    for s in report.skipped:
        assert skipped[s["name"]] in s["reason"], s
    for name, t in tensors.items():
        written = (dst / name).read_bytes()
        assert sha(written) == sha(fp8_bytes(t)), name
        if t.abs().max() <= 448:  # and LMCache's own serde, a plain cast, gives the same bytes
            assert sha(written) == sha(t.to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()), name

    back = tmp_path / "store.bf16"
    report = decompress_store(str(dst), str(back), LAYOUT, pool=fp8ray.PoolSettings(num_workers=2))
    assert report.files == len(tensors) and report.skipped == [] and report.bytes_after == len(tensors) * RAW
    assert sorted(os.listdir(back)) == sorted(tensors)
    for name, x in tensors.items():
        y = from_raw((back / name).read_bytes())
        # Exactly LMCache's deserializer, an fp8 -> bf16 cast of the stored bytes:
        assert torch.equal(y, from_fp8((dst / name).read_bytes()))
        x64, y64 = x.double(), y.double()
        in_range = x64.abs() <= 448
        bound = (U / (1 + U)) * x64.abs() + HALF_SUBNORMAL
        assert bool(((y64 - x64).abs() <= bound)[in_range].all()), name
        assert torch.equal(y64[~in_range], 448.0 * x64[~in_range].sign())  # saturated, by design
        assert bool((y64 != x64).any())  # lossy indeed: the bound is what is tested
    saturating = tensors[format_chunk_name(CHUNKS[-1])]
    assert int((saturating.double().abs() > 448).sum()) == 3  # 1000, -1000 and 464 (which rounds to 448 too)


def write_frames(src, directory, options=None) -> None:
    """The store the fp8ray serde would have written for a raw store (as lmcache-compress --serde fp8ray does)."""
    directory.mkdir()
    for p in src.iterdir():
        if p.is_file() and p.stat().st_size == RAW:
            (directory / p.name).write_bytes(bytes(Fp8Codec(options=options).encode(from_raw(p.read_bytes()))))


def convert_here(source, target: str, scratch, options=None):
    """What a conversion's workers do, run in this process: every chunk file of ``source`` to ``target``."""
    scratch.mkdir()
    conversion = StoreConversion(str(source), str(scratch), parse_layout(LAYOUT), target, options=options or CodecOptions())
    return convert_files(conversion, scan_store(str(source), parse_layout(LAYOUT)).chunks)


def test_every_form_converts_to_every_other_as_lmcaches_serializers_write(store, tmp_path):
    """raw -> fp8ray -> raw, and fp8 <-> fp8ray, each file exactly what the target serde
    writes for what the source holds (frames in the options asked for). The first on
    the engine, the others with the workers' own function in this process."""
    src, tensors, _ = store
    options = CodecOptions(scaling="token", scale_dtype="float32")
    frames = tmp_path / "frames"
    report = compress_store(
        str(src), str(frames), LAYOUT, serde="fp8ray", options=options, pool=fp8ray.PoolSettings(num_workers=2)
    )
    assert report.target == "fp8ray" and report.codec == options.as_dict() and report.files == len(tensors)
    for name, x in tensors.items():
        assert (frames / name).read_bytes() == bytes(Fp8Codec(options=options).encode(x)), name

    raw = tmp_path / "raw"
    assert {f.form for f in convert_here(frames, "raw", raw)} == {"fp8ray"}
    for name in tensors:
        assert torch.equal(from_raw((raw / name).read_bytes()), fp8ray.decode((frames / name).read_bytes())), name

    plain = tmp_path / "plain"
    assert len(convert_here(frames, "fp8", plain)) == len(tensors)
    for name in tensors:
        assert (plain / name).read_bytes() == fp8_bytes(fp8ray.decode((frames / name).read_bytes())), name

    again = tmp_path / "again"  # fp8 -> fp8ray, in the default mode
    assert {f.form for f in convert_here(plain, "fp8ray", again)} == {"fp8"}
    for name in tensors:
        assert (again / name).read_bytes() == bytes(Fp8Codec().encode(from_fp8((plain / name).read_bytes()))), name


@pytest.mark.parametrize("other", ["raw", "fp8"])
def test_a_mixed_store_converts_what_needs_it_and_copies_what_is_already_converted(tmp_path, other):
    """Frames beside raw chunks, or beside fp8 ones (raw and fp8 together: the test above)."""
    src = tmp_path / "mixed"
    src.mkdir()
    forms = {}
    for i, chunk in enumerate(CHUNKS):
        x, name = chunk_tensor(i), format_chunk_name(chunk)
        form = (other, "fp8ray")[i % 2]
        data = {"raw": tensor_bytes(x), "fp8": fp8_bytes(x), "fp8ray": bytes(Fp8Codec().encode(x))}[form]
        (src / name).write_bytes(data)
        forms[name] = (form, data)
    dst = tmp_path / "out"
    report = compress_store(str(src), str(dst), LAYOUT, serde="fp8ray", pool=fp8ray.PoolSettings(num_workers=1))
    converted = sum(f == other for f, _ in forms.values())
    assert report.converted_from == {other: converted} and report.files == converted
    assert report.unchanged == [n for n, (f, _) in sorted(forms.items()) if f == "fp8ray"]
    for name, (form, data) in forms.items():
        written = (dst / name).read_bytes()
        if form == "fp8ray":
            assert written == data
        else:
            x = from_raw(data) if form == "raw" else from_fp8(data)
            assert written == bytes(Fp8Codec().encode(x)), name


def test_frames_in_other_codec_options_are_encoded_again_in_those_asked(tmp_path):
    """The fp8ray serde in the options asked refuses a frame in other options: such a
    frame is converted (decoded, encoded in the options asked), not copied as done."""
    src = tmp_path / "store"
    src.mkdir()
    token, same, raw = (format_chunk_name(c) for c in CHUNKS[:3])
    (src / token).write_bytes(bytes(Fp8Codec(scaling="token").encode(chunk_tensor(0))))
    (src / same).write_bytes(bytes(Fp8Codec().encode(chunk_tensor(1))))
    (src / raw).write_bytes(tensor_bytes(chunk_tensor(2)))
    pool = fp8ray.PoolSettings(address="inline")
    report = compress_store(str(src), str(tmp_path / "out"), LAYOUT, serde="fp8ray", pool=pool)
    assert report.converted_from == {"fp8ray": 1, "raw": 1} and report.unchanged == [same]
    x = fp8ray.decode((src / token).read_bytes())
    assert (tmp_path / "out" / token).read_bytes() == bytes(Fp8Codec().encode(x))
    assert (tmp_path / "out" / same).read_bytes() == (src / same).read_bytes()
    # a store all of whose frames are in other options is re-encoded, not refused as done
    (src / raw).unlink()
    (src / same).write_bytes(bytes(Fp8Codec(scaling="token").encode(chunk_tensor(1))))
    options = CodecOptions(scaling="tensor")
    report = compress_store(str(src), str(tmp_path / "again"), LAYOUT, serde="fp8ray", options=options, pool=pool)
    assert report.converted_from == {"fp8ray": 2} and report.unchanged == []
    for name in (token, same):
        assert parse_header((tmp_path / "again" / name).read_bytes()).scaling == "tensor"
    # Or as keywords over them, as compress_archive takes them (a TypeError naming convert_store before).
    report = compress_store(str(src), str(tmp_path / "kw"), LAYOUT, serde="fp8ray", scaling="channel", pool=pool)
    for name in (token, same):
        x = fp8ray.decode((src / name).read_bytes())
        assert (tmp_path / "kw" / name).read_bytes() == bytes(Fp8Codec(scaling="channel").encode(x))


def test_a_store_already_in_the_target_form_is_reported_not_converted_again(store, tmp_path):
    src, tensors, _ = store
    with pytest.raises(BadInputError, match=rf"every chunk file .* \({len(tensors)}\) is already in the target form 'raw'"):
        decompress_store(str(src), str(tmp_path / "raw"), LAYOUT, pool=fp8ray.PoolSettings(num_workers=1))
    frames = tmp_path / "frames"
    write_frames(src, frames)
    with pytest.raises(BadInputError, match="already in the target form 'fp8ray'"):
        compress_store(str(frames), str(tmp_path / "twice"), LAYOUT, serde="fp8ray", pool=fp8ray.PoolSettings(num_workers=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frames", "store"]  # nothing else created


def test_a_wrong_layout_exits_non_zero_and_creates_nothing(store, tmp_path, capsys):
    src, tensors, skipped = store
    before = digests(src)
    for command in ("lmcache-compress", "lmcache-decompress"):
        assert main([command, str(src), str(tmp_path / "x"), "--layout", "bfloat16:2,2", "--workers", "1"]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "matches" not in err
        assert "no file of" in err and "layout bfloat16:2,2 in any form" in err and "is --layout right?" in err
    with pytest.raises(MismatchError) as info:
        compress_store(str(src), str(tmp_path / "x"), "float32:2,2,16,64")
    assert info.value.field == "layout"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"] and digests(src) == before


def test_many_skipped_files_are_listed_up_to_a_limit(tmp_path, capsys):
    """lmcache-compress printed a line per skipped file: 1500 lines for 1500 stray files."""
    from fp8ray.cli.common import LISTED_LINES

    src = tmp_path / "store"
    src.mkdir()
    (src / format_chunk_name(CHUNKS[0])).write_bytes(tensor_bytes(chunk_tensor(0)))
    for i in range(LISTED_LINES + 7):
        (src / f"stray{i:02d}.txt").write_bytes(b"x")
    assert main(["lmcache-compress", str(src), str(tmp_path / "out"), "--layout", LAYOUT, "--workers", "1"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == LISTED_LINES + 1 and all(line.startswith("fp8ray: skipped 'stray") for line in lines[:-1])
    assert lines[-1] == "fp8ray: ... and 7 more skipped (--json lists them all)"


def test_names_from_the_store_are_printed_escaped(tmp_path, capsys):
    src = tmp_path / "store"
    src.mkdir()
    (src / format_chunk_name(CHUNKS[0])).write_bytes(tensor_bytes(chunk_tensor(0)))
    hostile = ["evil\x1b[2J\x1b[31m.data", "line\nbreak@0x1@0@ab.data", "m@0x1@0@ab@salt\x1b]0;title\x07.data"]
    for name in hostile:
        (src / name).write_bytes(b"\0" * 10)
    assert main(["lmcache-compress", str(src), str(tmp_path / "out"), "--layout", LAYOUT, "--workers", "1"]) == 0
    out, err = capsys.readouterr()
    assert all(c == "\n" or c.isprintable() for c in out + err)  # no raw control characters reach the terminal
    assert err.count("fp8ray: skipped") == 3 and err.count("\n") == 3
    assert ascii(hostile[0]) in err and "\\x1b]0;title\\x07" in err
    assert main(["lmcache-compress", str(src), str(tmp_path / "out2"), "--layout", LAYOUT, "--workers", "1", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert out.isascii() and "\x1b" not in out and sorted(s["name"] for s in json.loads(out)["skipped"]) == sorted(hostile)


def test_a_damaged_frame_fails_the_run_naming_it_and_leaves_nothing(store, tmp_path):
    src, tensors, _ = store
    frames = tmp_path / "frames"
    write_frames(src, frames)
    bad = sorted(tensors)[1]
    data = bytearray((frames / bad).read_bytes())
    data[len(data) // 2] ^= 0x20
    (frames / bad).write_bytes(bytes(data))
    with pytest.raises(CorruptFrameError, match=rf"{bad}.*checksum mismatch"):
        decompress_store(str(frames), str(tmp_path / "out"), LAYOUT, pool=fp8ray.PoolSettings(num_workers=1))
    (frames / format_chunk_name(ChunkName("m", 1, 0, b"\x01"))).write_bytes(tensor_bytes(chunk_tensor(0)))  # a raw one
    with pytest.raises(CorruptFrameError, match=bad):  # a copy is checked too: nothing damaged is passed on
        compress_store(str(frames), str(tmp_path / "out"), LAYOUT, serde="fp8ray", pool=fp8ray.PoolSettings(num_workers=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frames", "store"]


def test_frame_options_need_the_fp8ray_serde(store, tmp_path, capsys):
    src, _, _ = store
    assert main(["lmcache-compress", str(src), str(tmp_path / "x"), "--layout", LAYOUT, "--scaling", "token"]) == 1
    _, err = capsys.readouterr()
    assert "--scaling apply to --serde fp8ray only" in err and not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="serde must be one of"):
        compress_store(str(src), str(tmp_path / "x"), LAYOUT, serde="raw")


def test_non_finite_source_fails_naming_the_file_and_leaves_no_destination(store, tmp_path):
    src, tensors, _ = store
    bad = sorted(tensors)[2]
    x = tensors[bad].clone()
    x[1, 0, 3, 5] = float("nan")
    (src / bad).write_bytes(tensor_bytes(x))
    dst = tmp_path / "out"
    with pytest.raises(NonFiniteError, match=rf"{bad}.*1 non-finite value"):
        compress_store(str(src), str(dst), LAYOUT, pool=fp8ray.PoolSettings(num_workers=2))
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no scratch left


def test_a_failing_chunk_files_path_reaches_the_terminal_escaped(tmp_path, capsys):
    """The block's name was escaped, the chunk file's path beside it was not: a name
    holding an escape code and a newline reached the terminal as they are."""
    src = tmp_path / "store"
    src.mkdir()
    x = chunk_tensor(0)
    x[0, 0, 0, 0] = float("nan")
    name = format_chunk_name(ChunkName("esc\x1b[31mred\nX", kv_rank(1, 0), 0, b"\x77\x79"))
    (src / name).write_bytes(tensor_bytes(x))
    for command in (
        ["lmcache-compress", str(src), str(tmp_path / "out"), "--layout", LAYOUT],
        ["compress", str(src), str(tmp_path / "out.fp8"), "--lmcache-layout", LAYOUT, "--address", "inline"],
    ):
        assert main(command) == 1
        _, err = capsys.readouterr()
        assert "non-finite" in err and err.count("\n") == 1 and "\x1b" not in err, err
        assert "esc\\x1b[31mred\\nX" in err.split("(", 1)[1]  # the path, escaped


def test_destination_rules(store, tmp_path):
    src, tensors, _ = store
    dst = tmp_path / "exists"
    dst.mkdir()
    (dst / "keep").write_bytes(b"x")
    with pytest.raises(ArchiveExistsError, match="exists"):
        compress_store(str(src), str(dst), LAYOUT)
    assert os.listdir(dst) == ["keep"]
    with pytest.raises(DestinationError, match="is the source"):
        compress_store(str(src), str(src), LAYOUT)
    with pytest.raises(DestinationError, match="inside each other"):
        compress_store(str(src), str(src / "fp8"), LAYOUT)
    with pytest.raises(SourceError, match="not a directory"):
        compress_store(str(tmp_path / "missing"), str(tmp_path / "x"), LAYOUT)
    # A symbolic link to nothing (planted in a shared folder, or left over) is the user's: the
    # store was written at its target, and --parents made the target's folders.
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere" / "store")
    with pytest.raises(ArchiveExistsError, match=r"destination .*link exists \(pass --overwrite"):
        compress_store(str(src), str(link), LAYOUT, parents=True)
    with pytest.raises(DestinationError, match="exists and is not a directory; not replacing it"):
        compress_store(str(src), str(link), LAYOUT, overwrite=True, parents=True)
    assert not (tmp_path / "elsewhere").exists() and link.is_symlink()


def test_cli_json_overwrite_and_errors(store, tmp_path, capsys):
    src, tensors, skipped = store
    dst = tmp_path / "dst"
    dst.mkdir()
    stale = format_chunk_name(ChunkName("m", 1, 0, b"\x05"))
    (dst / stale).write_bytes(b"x")  # an earlier store's chunk file
    argv = ["lmcache-compress", str(src), str(dst), "--layout", LAYOUT, "--workers", "2"]
    assert main(argv) == 1
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "exists (pass --overwrite" in err

    assert main([*argv, "--overwrite", "--json"]) == 0
    out, _ = capsys.readouterr()
    report = json.loads(out)
    assert report["files"] == len(tensors) and {s["name"] for s in report["skipped"]} == set(skipped)
    assert report["bytes_before"] == 2 * report["bytes_after"] and report["fp8"] == "e4m3fn" and report["target"] == "fp8"
    assert sorted(os.listdir(dst)) == sorted(tensors)  # the stale chunk went with the old store

    assert (
        main(["lmcache-compress", str(src), str(tmp_path / "f"), "--layout", LAYOUT, "--serde", "fp8ray", "--scaling", "token"])
        == 0
    )
    out, err = capsys.readouterr()
    assert f"compressed {len(tensors)} chunk files ({len(tensors)} raw) to fp8ray" in out
    assert err.count("fp8ray: skipped") == len(skipped)
    name = sorted(tensors)[0]
    assert (tmp_path / "f" / name).read_bytes() == bytes(Fp8Codec(scaling="token").encode(tensors[name]))


def test_overwrite_replaces_only_a_store(store, tmp_path, capsys):
    """--overwrite deletes the old destination: only one holding nothing but a store's
    files (chunk files, hash-prefix folders) is replaced; anything else is named and
    refused before any work, in both directions."""
    src, tensors, _ = store
    dst = tmp_path / "victim"
    (dst / "docs").mkdir(parents=True)
    (dst / "docs" / "thesis.txt").write_text("important")
    (dst / format_chunk_name(CHUNKS[0])).write_bytes(b"x")  # a store's file beside them changes nothing
    for command in ("lmcache-compress", "lmcache-decompress"):
        argv = [command, str(src), str(dst), "--layout", LAYOUT, "--address", "inline", "--overwrite"]
        assert main(argv) == 1
        _, err = capsys.readouterr()
        assert err.count("\n") == 1 and "holds 1 entry that is not an LMCache store's (docs/thesis.txt)" in err
        assert "--overwrite replaces only a store" in err
        assert (dst / "docs" / "thesis.txt").read_text() == "important"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store", "victim"]  # no scratch either
    chunk = CHUNKS[0]
    (dst / "docs" / "thesis.txt").unlink()
    (dst / "docs").rmdir()
    (dst / hash_folders(chunk, 2)).mkdir(parents=True)
    (dst / hash_folders(chunk, 2) / format_chunk_name(chunk)).write_bytes(b"x")  # in its hash's folders
    (dst / "ab").mkdir()  # an empty hash-prefix folder
    report = compress_store(str(src), str(dst), LAYOUT, overwrite=True, pool=fp8ray.PoolSettings(address="inline"))
    assert report.files == len(tensors) and sorted(os.listdir(dst)) == sorted(tensors)


def test_overwrite_keeps_the_old_store_if_the_swap_fails(store, tmp_path, monkeypatch):
    """--overwrite moves the old destination aside, then the new one in; if that second
    rename fails, the old destination is put back and no scratch is left."""
    import fp8ray.engine.stores as lmcache_store

    src, _, _ = store
    dst = tmp_path / "previous"
    dst.mkdir()
    keep = format_chunk_name(ChunkName("m", 1, 0, b"\x05"))
    (dst / keep).write_bytes(b"x")
    real_rename = os.rename
    failed = []

    def failing_rename(a, b):
        if str(b) == str(dst) and not failed:  # the new store moving into place (the old one went aside first)
            failed.append(a)
            raise OSError("simulated failure of the swap")
        return real_rename(a, b)

    monkeypatch.setattr(lmcache_store.os, "rename", failing_rename)
    with pytest.raises(DestinationError, match=f"^cannot write destination {dst}: simulated failure of the swap$"):
        compress_store(str(src), str(dst), LAYOUT, overwrite=True)
    assert os.listdir(dst) == [keep] and (dst / keep).read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous", "store"]  # no scratch left


def test_an_interrupt_as_the_scratch_directory_is_made_leaves_nothing(store, tmp_path, monkeypatch):
    """A Ctrl-C that arrives while the scratch directory is being made (raised as the
    call returns): the directory goes too."""
    import fp8ray.engine.stores as lmcache_store

    src, _, _ = store
    real_mkdir = os.mkdir

    def mkdir_then_interrupt(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        if TMP_MARK in os.path.basename(path):
            raise KeyboardInterrupt

    monkeypatch.setattr(lmcache_store.os, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        compress_store(str(src), str(tmp_path / "fp8"), LAYOUT, pool=fp8ray.PoolSettings(address="inline"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


# --- with LMCache's own filesystem adapter, serde wrapper and L1 manager ----------------


def lmcache_fs_adapter(base_path, serde: dict):
    """LMCache's fs L2 adapter wrapped with a serde, as LMCache builds it from
    ``--l2-adapter '{"type": "fs", "base_path": ..., "serde": ...}'``; and its L1 manager."""
    import argparse

    from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
    from lmcache.v1.distributed.l1_manager import L1Manager
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
    from lmcache.v1.distributed.serde import create_serde_processor

    fp8ray.lmcache.register()
    spec = json.dumps({"type": "fs", "base_path": str(base_path), "serde": serde})
    (config,) = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec])).adapters
    l1 = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=32 << 20, use_lazy=False, shm_name="")))
    return SerdeL2AdapterWrapper(create_l2_adapter(config), create_serde_processor(config.serde_config), l1), l1


def wait(fd: int) -> None:
    import select

    from lmcache.v1.platform import consume_fd

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(120_000), "LMCache's adapter did not signal completion"
    consume_fd(fd)


def object_key(chunk: ChunkName):
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk.chunk_hash, chunk.model, chunk.kv_rank, chunk.object_group_id, chunk.cache_salt)


def test_stores_of_lmcaches_fs_adapter_with_the_fp8ray_serde_convert_both_ways(tmp_path):
    """LMCache writes a store through its fs adapter and the fp8ray serde; lmcache-decompress
    turns it into raw chunk files (the frames' decoded values); lmcache-compress --serde
    fp8ray turns those back into a store LMCache loads through the same adapter."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    import fp8ray.lmcache

    layout = MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16])
    written = tmp_path / "written"
    adapter, l1 = lmcache_fs_adapter(written, {"type": "fp8ray"})
    try:
        keys = [object_key(c) for c in CHUNKS]
        reserved = l1.reserve_write(keys, [False] * len(keys), layout, tag="test")
        objs = [reserved[k][1] for k in keys]
        for i, obj in enumerate(objs):
            obj.tensor.copy_(chunk_tensor(i))
        l1.finish_write_and_reserve_read(keys, tag="test")
        task = adapter.submit_store_task(keys, objs)
        wait(adapter.get_store_event_fd())
        assert adapter.pop_completed_store_tasks()[task].is_successful()
    finally:
        adapter.close()
    names = sorted(format_chunk_name(c) for c in CHUNKS)
    assert sorted(os.listdir(written)) == names

    raw = tmp_path / "raw"
    assert decompress_store(str(written), str(raw), LAYOUT, pool=fp8ray.PoolSettings(num_workers=1)).converted_from == {
        "fp8ray": len(names)
    }
    for name in names:
        assert torch.equal(from_raw((raw / name).read_bytes()), fp8ray.decode((written / name).read_bytes()))

    back = tmp_path / "back"
    assert compress_store(str(raw), str(back), LAYOUT, serde="fp8ray", pool=fp8ray.PoolSettings(num_workers=1)).files == len(
        names
    )
    adapter, l1 = lmcache_fs_adapter(back, {"type": "fp8ray"})
    try:
        dsts = l1.reserve_write(
            [object_key(ChunkName("load", 1, 0, bytes([i]))) for i in range(len(names))], [True] * len(names), layout, tag="load"
        )
        objs = [v[1] for v in dsts.values()]
        keys = [object_key(c) for c in CHUNKS]
        task = adapter.submit_load_task(keys, objs)
        wait(adapter.get_load_event_fd())
        bitmap = adapter.query_load_result(task)
        assert [bitmap.test(i) for i in range(len(keys))] == [True] * len(keys)
        for chunk, obj in zip(CHUNKS, objs):
            name = format_chunk_name(chunk)
            stored = (back / name).read_bytes()
            assert stored == bytes(Fp8Codec().encode(from_raw((raw / name).read_bytes())))  # what the serde writes
            assert torch.equal(obj.tensor, fp8ray.decode(stored))  # and LMCache loads it as fp8ray decodes it
    finally:
        adapter.close()
