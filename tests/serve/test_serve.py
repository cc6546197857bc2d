"""The Ray Serve service over real HTTP on 127.0.0.1, and through its Python handle."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from _util import free_port

from fp8ray import Fp8Codec, decode
from fp8ray.codec import CodecOptions
from fp8ray.eval.sample import sample_kv_chunk
from fp8ray.io.blocks import tensor_to_bytes
from fp8ray.io.safetensors import SOURCE_DTYPES, parse_body
from fp8ray.io.safetensors import build_body as build_safetensors

REPO = Path(__file__).resolve().parents[2]
MAX_BODY_MB = 32
BODY_TIMEOUT_S = 3.0  # the service's wait for a stalled body, short for the test (30 s by default)


def digest(data) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


ARCHIVE_FILES = ["a.safetensors", "deep/b.safetensors"]


@pytest.fixture(scope="module")
def archives_root(tmp_path_factory):
    """A root directory holding one two-file archive (``kv.fp8``; the key ``shared`` in
    both files), and what decompress gives back of it, by file."""
    from safetensors.torch import load_file, save_file

    from fp8ray.engine.archives import compress_archive, decompress_archive

    base = tmp_path_factory.mktemp("archives")
    for i, name in enumerate(ARCHIVE_FILES):
        (base / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        tensors = {"shared": sample_kv_chunk(layers=1, tokens=16, seed=i), f"only{i}": torch.randn(3, 40, dtype=torch.float16)}
        save_file(tensors, str(base / "src" / name), metadata={"request": str(i)})
    (base / "root").mkdir()
    compress_archive(str(base / "src"), str(base / "root" / "kv.fp8"), pool=fp8ray_inline())
    decompress_archive(str(base / "root" / "kv.fp8"), str(base / "out"), pool=fp8ray_inline())
    return base / "root", {name: load_file(base / "out" / name) for name in ARCHIVE_FILES}


def fp8ray_inline():
    from fp8ray.engine.pool import PoolSettings

    return PoolSettings(num_workers=1, address="inline")


@pytest.fixture(scope="module")
def service(ray_session, archives_root):
    """One Serve app on the session Ray: 2 QuantWorkers, answering on 127.0.0.1, reading
    the archives under ``archives_root``."""
    from ray import serve

    from fp8ray.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = {"workers": 2, "max_body_mb": MAX_BODY_MB, "archives": str(archives_root[0]), "body_timeout_s": BODY_TIMEOUT_S}
    handle = serve.run(build_app(options), name="fp8ray", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client, handle
    serve.shutdown()


def service_codec(**given) -> Fp8Codec:
    """The codec the service uses for these request options (strings, as in a query):
    the default mode, each option given overriding only itself."""
    return Fp8Codec(options=CodecOptions.parse(given))


def parse_safetensors(body: bytes, allowed: tuple[str, ...]) -> tuple[list, dict]:
    """``(key, dtype, shape, bytes)`` of each tensor of a safetensors body, and its metadata."""
    entries, metadata = parse_body(body, allowed)
    return [(e.key, e.fp8ray_dtype, e.shape, data) for e, data in entries], metadata


def encode_params(t: torch.Tensor, **options) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": ",".join(map(str, t.shape)), **options}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"fp8": "e5m2", "scaling": "token"},
        {"scaling": "block", "block_size": "32", "scale_dtype": "bfloat16", "scale_choice": "mse"},
    ],
)
def test_http_round_trip_equals_the_codec(service, dtype, options):
    client, _ = service
    t = sample_kv_chunk(layers=2, tokens=32, seed=3, dtype=dtype)
    expected = service_codec(**options).encode(t)
    r = client.post("/v1/encode", params=encode_params(t, **options), content=tensor_to_bytes(t).tobytes())
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    assert digest(r.content) == digest(expected)
    back = client.post("/v1/decode", content=r.content)
    assert back.status_code == 200, back.text
    assert back.headers["x-fp8ray-dtype"] == str(dtype).removeprefix("torch.")
    assert back.headers["x-fp8ray-shape"] == ",".join(map(str, t.shape))
    assert digest(back.content) == digest(tensor_to_bytes(decode(expected)))


def test_safetensors_bodies_carry_many_blocks(service):
    client, _ = service
    blocks = {
        f"chunk{i}": sample_kv_chunk(layers=2, tokens=16, seed=i, dtype=dt)
        for i, dt in enumerate([torch.bfloat16, torch.float16, torch.float32] * 2)
    }
    body = build_safetensors(
        [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape), tensor_to_bytes(t)) for k, t in blocks.items()], {"a": "b"}
    )
    r = client.post(
        "/v1/encode", params={"scaling": "token"}, content=body, headers={"Content-Type": "application/x-safetensors"}
    )
    assert r.status_code == 200, r.text
    frames, metadata = parse_safetensors(r.content, ("U8",))
    assert metadata == {"a": "b", "fp8ray": "frames"} and [k for k, *_ in frames] == list(blocks)
    codec = service_codec(scaling="token")
    for key, dtype, _shape, data in frames:
        assert dtype == "uint8" and digest(data) == digest(codec.encode(blocks[key])), key
    back = client.post("/v1/decode", content=r.content, headers={"Content-Type": "application/x-safetensors"})
    assert back.status_code == 200, back.text
    tensors, metadata = parse_safetensors(back.content, ("BF16", "F16", "F32"))
    assert [k for k, *_ in tensors] == list(blocks) and metadata == {"a": "b"}  # the file's own __metadata__ back
    for key, dtype, shape, data in tensors:
        expected = decode(codec.encode(blocks[key]))
        assert (dtype, shape) == (str(expected.dtype).removeprefix("torch."), tuple(expected.shape))
        assert digest(data) == digest(tensor_to_bytes(expected)), key


def test_tensors_fp8_does_not_encode_travel_in_stored_frames(service):
    """A body holding positions and a mask beside the cache: every tensor comes back, the
    stored ones bit for bit, as from a raw body with their dtype."""
    client, _ = service
    blocks = {
        "layer0.k": sample_kv_chunk(layers=1, tokens=16, seed=1),
        "positions": torch.arange(16, dtype=torch.int64) - 3,
        "mask": torch.tensor([True, False, True]),
        "rope": torch.tensor([float("nan"), -0.0, 1e300], dtype=torch.float64),
    }
    body = build_safetensors(
        [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape), tensor_to_bytes(t)) for k, t in blocks.items()]
    )
    st = {"Content-Type": "application/x-safetensors"}
    r = client.post("/v1/encode", content=body, headers=st)
    assert r.status_code == 200, r.text
    frames = dict((k, data) for k, _, _, data in parse_safetensors(r.content, ("U8",))[0])
    assert digest(frames["positions"]) == digest(service_codec().encode(blocks["positions"]))
    back = client.post("/v1/decode", content=r.content, headers=st)
    assert back.status_code == 200, back.text
    tensors = {k: (dtype, shape, data) for k, dtype, shape, data in parse_safetensors(back.content, tuple(SOURCE_DTYPES))[0]}
    for key in ("positions", "mask", "rope"):
        t = blocks[key]
        assert tensors[key][:2] == (str(t.dtype).removeprefix("torch."), tuple(t.shape))
        assert digest(tensors[key][2]) == digest(tensor_to_bytes(t)), key
    raw = client.post(
        "/v1/encode", params=encode_params(blocks["positions"]), content=tensor_to_bytes(blocks["positions"]).tobytes()
    )
    assert raw.status_code == 200 and digest(raw.content) == digest(frames["positions"])


def test_python_handle_returns_what_the_codec_returns(service):
    _, handle = service
    t = sample_kv_chunk(layers=1, tokens=16, seed=5)
    frame = handle.encode.remote(t, fp8="e4m3fn", scaling="channel").result()
    assert isinstance(frame, bytes) and digest(frame) == digest(Fp8Codec(scaling="channel").encode(t))
    default = handle.encode.remote(t).result()  # no option: the KV default mode
    assert digest(default) == digest(Fp8Codec("e4m3fn", "block", 32, scale_dtype="bfloat16", scale_choice="mse").encode(t))
    # None is an option's default, as Fp8Codec takes it (it was sent as "None" and refused)
    assert handle.encode.remote(t, scale_choice=None, block_size=None).result() == default
    back = handle.decode.remote(frame).result()
    assert torch.equal(back, decode(frame))
    empty = torch.empty(3, 0, 8, dtype=torch.float16)
    back_empty = handle.decode.remote(handle.encode.remote(empty).result()).result()
    assert back_empty.dtype == torch.float16 and back_empty.shape == (3, 0, 8)
    as_array = handle.encode.remote(t.float().numpy()).result()
    assert digest(as_array) == digest(service_codec().encode(t.float()))
    with pytest.raises(Exception, match="unknown scaling"):
        handle.encode.remote(t, scaling="sideways").result()
    # Refused as Fp8Codec.encode refuses them ("got torch.complex128" for an array; torch's
    # NotImplementedError for a meta tensor, before).
    for given, message in [
        (np.zeros(4, np.complex128), r"unsupported numpy dtype complex128; expected one of"),
        (torch.empty(4, device="meta"), r"cannot encode a meta tensor: it has no data"),
    ]:
        with pytest.raises(Exception, match=message):
            handle.encode.remote(given).result()


def error_of(r: httpx.Response) -> dict:
    assert r.headers["content-type"] == "application/json", r.text
    return r.json()


@pytest.mark.parametrize(
    "params, body_len, field",
    [
        ({"dtype": "int7", "shape": "4"}, 8, "dtype"),
        ({"shape": "4"}, 8, "dtype"),
        ({"dtype": "bfloat16", "shape": "4,4"}, 8, "shape"),
        ({"dtype": "bfloat16", "shape": "4,x"}, 8, "shape"),
        ({"dtype": "bfloat16"}, 8, "shape"),
        ({"dtype": "bfloat16", "shape": "4", "colour": "red"}, 8, "colour"),
        ({"dtype": "bfloat16", "shape": "4", "scaling": "sideways"}, 8, "scaling"),
        ({"dtype": "bfloat16", "shape": "4", "fp8": "e3m4"}, 8, "fp8"),
        ({"dtype": "bfloat16", "shape": "4", "block_size": "0"}, 8, "block_size"),
        ({"dtype": "bfloat16", "shape": "4", "scale_dtype": "float8"}, 8, "scale_dtype"),
        (
            {"dtype": "bfloat16", "shape": "4", "scaling": "tensor", "scale_choice": "mse"},
            8,
            "scale_choice",
        ),  # needs token or block
    ],
)
def test_bad_encode_requests_answer_400_naming_the_field(service, params, body_len, field):
    client, _ = service
    r = client.post("/v1/encode", params=params, content=b"\0" * body_len)
    assert r.status_code == 400
    assert error_of(r)["field"] == field


@pytest.mark.parametrize("shape, scaling", [((0, 1000), "channel"), ((1000, 0), "token"), ((3, 0, 1000), "channel")])
def test_an_empty_tensor_is_encoded_whatever_its_frames_scales_take(service, shape, scaling):
    """An empty tensor's frame still holds a scale per channel or row: more bytes than
    the 0-byte body and short query that ask for it (this answered 500, 'the response
    would exceed its bound'); raw and safetensors bodies alike."""
    client, _ = service
    t = torch.empty(shape, dtype=torch.float16)
    expected = service_codec(scaling=scaling).encode(t)
    assert len(expected) > 5 * 40 + 1024  # over the old bound
    r = client.post("/v1/encode", params=encode_params(t, scaling=scaling), content=b"")
    assert r.status_code == 200, r.text
    assert digest(r.content) == digest(expected)
    body = build_safetensors([("kv", "float16", shape, np.empty(0, np.uint8))], None)
    headers = {"Content-Type": "application/x-safetensors"}
    r = client.post("/v1/encode", params={"scaling": scaling}, content=body, headers=headers)
    assert r.status_code == 200, r.text
    [(key, _, _, frame)], _ = parse_safetensors(r.content, ("U8",))
    assert key == "kv" and digest(frame) == digest(expected)


def test_frames_over_the_limit_are_refused_413_before_any_work(service):
    """A few bytes of query can ask for gigabytes of scales: refused from the shape alone
    (a worker built a 200 MB frame, or ran out of memory, and the answer was 500)."""
    client, _ = service
    for shape in ("0,100000000", "0,1099511627776"):
        r = client.post("/v1/encode", params={"dtype": "float16", "shape": shape, "scaling": "channel"}, content=b"")
        assert r.status_code == 413 and error_of(r)["field"] == "shape", r.text
        assert f"over the service's limit of {MAX_BODY_MB * 2**20} (--max-body-mb)" in error_of(r)["error"]


@pytest.mark.parametrize("route", ["/v1/encode", "/v1/decode", "/v1/archive/block"])
def test_a_query_parameter_given_twice_is_refused_naming_it(service, route):
    """Only one of them would be read, and the body misread under it (float32 bytes
    decoded as float16 before)."""
    client, _ = service
    query = [("dtype", "float32"), ("shape", "2"), ("dtype", "float16"), ("key", "a"), ("key", "b")]
    if route == "/v1/archive/block":
        r = client.get(route, params=query)
    else:
        r = client.post(route, params=query, content=b"\0" * 8)
    assert r.status_code == 400 and error_of(r)["field"] == "dtype", r.text
    assert error_of(r)["error"] == "query parameter 'dtype' is given 2 times; give it once"


def test_unknown_paths_and_methods_answer_in_the_services_json(service):
    """They answered FastAPI's {"detail": "Not Found"}, not the shape every refusal has."""
    client, _ = service
    r = client.get("/v1/nope")
    assert r.status_code == 404 and error_of(r) == {"error": "Not Found: GET /v1/nope", "status": 404}
    r = client.get("/v1/encode")
    assert r.status_code == 405 and error_of(r) == {"error": "Method Not Allowed: GET /v1/encode", "status": 405}
    assert r.headers["allow"] == "POST"


def test_corrupt_and_truncated_frames_answer_422(service):
    client, _ = service
    frame = bytearray(Fp8Codec().encode(torch.randn(64, 64)))
    for bad in (bytes(frame[:-1]), bytes(frame[:10]), b"", b"garbage!" * 8):
        r = client.post("/v1/decode", content=bad)
        assert r.status_code == 422, (len(bad), r.text)
    frame[200] ^= 0x10
    r = client.post("/v1/decode", content=bytes(frame))
    assert r.status_code == 422 and "checksum" in error_of(r)["error"].lower()


def test_non_finite_input_and_bad_safetensors_are_refused(service):
    client, _ = service
    t = torch.ones(4, 8)
    t[1, 2] = float("nan")
    r = client.post("/v1/encode", params=encode_params(t), content=tensor_to_bytes(t).tobytes())
    # The hint is not the CLI's (nonfinite='keep', an option the service refuses)
    assert r.status_code == 422 and error_of(r)["error"].endswith(
        "non-finite value(s) in a (4, 8) float32 tensor; the first is nan at index [1, 2] (the service stores none)"
    )
    st = {"Content-Type": "application/x-safetensors"}
    assert client.post("/v1/encode", content=b"\x10\0\0\0\0\0\0\0{not json}", headers=st).status_code == 400
    frames = build_safetensors([("a", "float32", (2,), np.zeros(2, np.float32).view(np.uint8))])
    r = client.post("/v1/decode", content=frames, headers=st)
    assert r.status_code == 400 and error_of(r)["field"] == "a"
    r = client.post("/v1/encode", params={"dtype": "float32"}, content=frames, headers=st)
    assert r.status_code == 400 and error_of(r)["field"] == "dtype"
    for route in ("/v1/encode", "/v1/decode"):  # a safetensors body with no tensors
        r = client.post(route, content=build_safetensors([]), headers=st)
        assert r.status_code == 400 and "no tensors" in error_of(r)["error"]
    ok, deep = ("a", "float16", (2,), np.zeros(4, np.uint8)), ("b", "float16", (1,) * 65, np.zeros(2, np.uint8))
    r = client.post("/v1/encode", content=build_safetensors([ok, deep]), headers=st)  # which tensor: it was not said
    assert r.status_code == 400 and error_of(r) == {
        "error": "block 'b': a tensor of 65 dimensions exceeds the frame's limit of 64",
        "field": "b",
        "status": 400,
    }, r.text


def expected_answer(route: str, params: dict, body: bytes, safetensors_body: bool) -> bytes | None:
    """What the service must answer, computed here with fp8ray's own functions: the
    response body, or None where it must refuse."""
    from fp8ray.errors import Fp8rayError
    from fp8ray.serve.requests import codec_options, raw_layout

    try:
        if route == "/v1/decode":
            if params:
                return None
            if safetensors_body:
                entries, metadata = parse_body(body, ("U8",))
                if not entries:
                    return None
                decoded = [(e.key, decode(data)) for e, data in entries]
                kept = {k: v for k, v in metadata.items() if k != "fp8ray"} or None
                return build_safetensors(
                    [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape), tensor_to_bytes(t)) for k, t in decoded], kept
                )
            return tensor_to_bytes(decode(body)).tobytes()
        if safetensors_body:
            if "dtype" in params or "shape" in params:
                return None
            codec = Fp8Codec(options=codec_options(params))
            entries, metadata = parse_body(body, ("BF16", "F16", "F32"))
            if not entries or "fp8ray" in metadata:
                return None
            frames = []
            for e, data in entries:
                t = torch.frombuffer(bytearray(data), dtype=getattr(torch, e.fp8ray_dtype)).reshape(e.shape)
                frames.append((e.key, "uint8", None, bytes(codec.encode(t))))
            return build_safetensors([(k, d, (len(f),), f) for k, d, _, f in frames], {**metadata, "fp8ray": "frames"})
        codec = Fp8Codec(options=codec_options(params, ignore=("dtype", "shape")))
        dtype, shape = raw_layout(params.get("dtype"), params.get("shape"), len(body))
        t = (
            torch.frombuffer(bytearray(body), dtype=getattr(torch, dtype)).reshape(shape)
            if body
            else torch.empty(shape, dtype=getattr(torch, dtype))
        )
        return bytes(codec.encode(t))
    except (Fp8rayError, ValueError, TypeError):
        return None


def test_fuzzed_requests_get_the_right_answer_or_a_json_refusal(service, capsys):
    """Random and mutated bodies, frames and queries: each answer is what fp8ray computes
    for it locally, or a JSON refusal naming what was wrong (400, 413 or 422; never 500),
    and no answer is larger than its request allows."""
    import random

    from fp8ray.serve.requests import response_limit

    client, _ = service
    rng = random.Random(7)
    st = {"Content-Type": "application/x-safetensors"}
    t = sample_kv_chunk(layers=1, tokens=8, seed=1, dtype=torch.bfloat16)[0, 0]
    frame = bytes(Fp8Codec().encode(t))
    st_body = build_safetensors(
        [("a", "bfloat16", tuple(t.shape), tensor_to_bytes(t)), ("b", "float32", (3,), np.ones(3, np.float32))]
    )
    frames_body = client.post("/v1/encode", content=st_body, headers=st).content
    seeds = [
        ("/v1/decode", {}, frame, False),
        ("/v1/encode", {"dtype": "bfloat16", "shape": "8,64"}, tensor_to_bytes(t).tobytes(), False),
        ("/v1/encode", {"scaling": "token"}, st_body, True),
        ("/v1/decode", {}, frames_body, True),
    ]
    outcomes: dict[int, int] = {}
    requests = 300
    for _ in range(requests):
        route, params, body, is_st = rng.choice(seeds)
        params, body = dict(params), bytearray(body)
        kind = rng.randrange(4)
        if kind == 0 and body:
            for _ in range(rng.randint(1, 4)):
                body[rng.randrange(len(body))] = rng.getrandbits(8)
        elif kind == 1:
            body = body[: rng.randrange(len(body) + 1)]
        elif kind == 2:
            name = rng.choice(["dtype", "shape", "scaling", "block_size", "fp8", "scale_choice", "nonfinite", "x"])
            params[name] = rng.choice(["bfloat16", "8,64", "0", "-1", "token", "block", "e5m2", "mse", "1,1,1", "", "64"])
        # kind 3: the seed unchanged
        r = client.post(route, params=params, content=bytes(body), headers=st if is_st else None)
        outcomes[r.status_code] = outcomes.get(r.status_code, 0) + 1
        query = len(str(r.request.url.query))
        assert len(r.content) <= response_limit(len(body) + query)
        expected = expected_answer(route, params, bytes(body), is_st)
        if expected is None:
            assert r.status_code in (400, 422), (route, params, r.status_code, r.text[:300])
            answer = r.json()
            assert answer["error"] and answer.get("field"), answer
        else:
            assert r.status_code == 200, (route, params, r.text[:300])
            assert digest(r.content) == digest(expected), (route, params)
    with capsys.disabled():
        print(f"\nfuzzed service requests: {requests}, by status {dict(sorted(outcomes.items()))}")
    assert outcomes.get(200, 0) > 30 and sum(v for k, v in outcomes.items() if k >= 400) > 100


def test_archive_blocks_over_http_equal_decompress(service, archives_root):
    """GET /v1/archive/block answers each block as a safetensors body with its file's
    __metadata__: the same tensor decompress gives; a key in one file needs no file."""
    client, _ = service
    _, restored = archives_root
    for name, tensors in restored.items():
        for key, tensor in tensors.items():
            r = client.get("/v1/archive/block", params={"archive": "kv.fp8", "key": key, "file": name})
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "application/x-safetensors"
            [(got_key, dtype, shape, data)], metadata = parse_safetensors(r.content, ("BF16", "F16", "F32"))
            assert (got_key, dtype, shape) == (key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
            assert digest(data) == digest(tensor_to_bytes(tensor)) and metadata == {"request": str(ARCHIVE_FILES.index(name))}
    r = client.get("/v1/archive/block", params={"archive": "./kv.fp8/", "key": "only1"})
    assert r.status_code == 200 and digest(parse_safetensors(r.content, ("F16",))[0][0][3]) == digest(
        tensor_to_bytes(restored["deep/b.safetensors"]["only1"])
    )


@pytest.mark.parametrize(
    "params, status, field, fragment",
    [
        ({"archive": "kv.fp8", "key": "shared"}, 400, "file", "a.safetensors, deep/b.safetensors"),  # in both files
        ({"archive": "kv.fp8", "key": "nope", "file": "a.safetensors"}, 404, "key", "no block 'nope' in file 'a.safetensors'"),
        ({"archive": "kv.fp8", "key": "shared", "file": "c.safetensors"}, 404, "file", "holds no file 'c.safetensors'"),
        ({"archive": "kv.fp8"}, 400, "key", "key is required"),
        ({"archive": "kv.fp8", "key": "only0", "colour": "red"}, 400, "colour", "unknown parameter"),
        ({"key": "only0"}, 400, "archive", "archive is required"),
        ({"archive": "other.fp8", "key": "only0"}, 404, "archive", "no archive 'other.fp8'"),
    ],
)
def test_archive_block_refusals_name_the_parameter(service, params, status, field, fragment):
    client, _ = service
    r = client.get("/v1/archive/block", params=params)
    assert r.status_code == status, r.text
    answer = error_of(r)
    assert answer["field"] == field and fragment in answer["error"], answer


def test_archive_paths_outside_the_root_are_refused(service, archives_root, tmp_path):
    """``..``, an absolute path and a symbolic link pointing out of the root are refused,
    naming the parameter, although an archive is there; a link inside the root is followed."""
    client, _ = service
    root, _ = archives_root
    outside = tmp_path / "outside.fp8"
    shutil.copytree(root / "kv.fp8", outside)
    (root / "escape").symlink_to(outside)
    (root / "alias").symlink_to(root / "kv.fp8")
    relative_out = os.path.relpath(outside, root)
    try:
        for archive, status in [
            (relative_out, 403),
            ("kv.fp8/../../" + relative_out, 403),
            (str(outside), 400),
            (str(root / "kv.fp8"), 400),
            ("escape", 403),
            ("escape/", 403),
        ]:
            r = client.get("/v1/archive/block", params={"archive": archive, "key": "only0"})
            assert r.status_code == status, (archive, r.text)
            answer = error_of(r)
            assert answer["field"] == "archive", answer
            assert os.path.isabs(archive) or str(root) not in answer["error"], answer  # the server's paths stay its own
        assert client.get("/v1/archive/block", params={"archive": "alias", "key": "only0"}).status_code == 200
        # A folder inside the root whose files are links out of it: they were read and served.
        (root / "links").mkdir()
        for entry in outside.iterdir():
            (root / "links" / entry.name).symlink_to(entry)
        r = client.get("/v1/archive/block", params={"archive": "links", "key": "only0"})
        assert r.status_code == 403 and error_of(r)["field"] == "archive", r.text
        assert "resolves outside the archives root" in error_of(r)["error"] and str(outside) not in r.text
    finally:
        (root / "escape").unlink()
        (root / "alias").unlink()
        shutil.rmtree(root / "links", ignore_errors=True)


def test_body_over_the_limit_answers_413_before_it_is_read(service):
    client, _ = service
    limit = MAX_BODY_MB * 2**20
    # Declared too long: answered from the header alone; the client sends the body anyway.
    r = client.post("/v1/encode", params={"dtype": "bfloat16", "shape": str(limit)}, content=b"\0" * (limit + 2))
    assert r.status_code == 413 and error_of(r)["field"] == "body"

    # Chunked with no length: refused once the running total passes the limit.
    def chunks():
        for _ in range(MAX_BODY_MB + 1):
            yield b"\0" * 2**20

    r = client.post("/v1/encode", params={"dtype": "bfloat16", "shape": "1"}, content=chunks())
    assert r.status_code == 413


def test_health_stats_and_prometheus_metrics(service, ray_session, archives_root):
    client, _ = service
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json()["workers_alive"] == 2
    # Where the block route reads, and that it is there (nothing said so).
    assert (r.json()["archives"], r.json()["archives_present"]) == (str(archives_root[0]), True)
    before = client.get("/v1/stats").json()
    t = torch.randn(8, 64)
    body = tensor_to_bytes(t).tobytes()
    ok = client.post("/v1/encode", params=encode_params(t), content=body)
    bad = client.post("/v1/encode", params={"dtype": "float32", "shape": "3"}, content=body)
    assert (ok.status_code, bad.status_code) == (200, 400)
    deadline = time.monotonic() + 10
    while True:  # replicas report counters without waiting for them
        after = client.get("/v1/stats").json()
        if after["requests"] >= before["requests"] + 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert after["requests"] - before["requests"] >= 3  # two posts and the stats read before
    assert after["errors"] - before["errors"] == 1
    assert after["bytes_in"] - before["bytes_in"] == 2 * len(body)
    assert after["bytes_out"] - before["bytes_out"] >= len(ok.content) + len(bad.content)
    assert after["workers"] == 2 and after["archives"] == str(archives_root[0])

    port = ray_session.nodes()[0]["MetricsExportPort"]
    names = ("fp8ray_serve_requests", "fp8ray_serve_errors", "fp8ray_serve_bytes", "fp8ray_serve_latency_seconds_bucket")
    deadline = time.monotonic() + 60
    text = ""
    while not all(n in text for n in names) and time.monotonic() < deadline:
        time.sleep(2)  # metrics are exported every few seconds
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for name in names:
        assert name in text, name
    assert 'status="400"' in text


def app_actor(ray, name: str):
    """The app's deployment-scoped actor ``name``, found by name as a replica would."""
    from ray.util import list_named_actors

    [found] = [a for a in list_named_actors(all_namespaces=True) if a["name"].endswith(name)]
    return ray.get_actor(found["name"], namespace=found["namespace"])


def test_no_per_request_call_to_another_actor_than_the_quantworkers(service, ray_session):
    """The replica counts its requests itself: the stats actor hears from it now and then
    (REPORT_INTERVAL_S), not once per request, and the app has no other actor to call."""
    from ray.util import list_named_actors

    from fp8ray.serve.deployment import STATS_ACTOR, WORKER_PREFIX
    from fp8ray.serve.stats import REPORT_INTERVAL_S

    client, _ = service
    # The actors the app made beside its replicas: the QuantWorkers and the stats actor.
    named = [a["name"] for a in list_named_actors(all_namespaces=True)]
    actors = {n for n in named if n.startswith("SERVE_DEPLOYMENT_ACTOR::fp8ray::")}
    assert len(actors) == 3 and {n for n in actors if WORKER_PREFIX not in n and not n.endswith(STATS_ACTOR)} == set(), actors
    stats = app_actor(ray_session, STATS_ACTOR)
    t = torch.randn(8, 64)
    body = tensor_to_bytes(t).tobytes()
    requests = 80
    before = ray_session.get(stats.report_count.remote())
    start = time.monotonic()
    for _ in range(requests):
        assert client.post("/v1/encode", params=encode_params(t), content=body).status_code == 200
    elapsed = time.monotonic() - start
    reports = ray_session.get(stats.report_count.remote()) - before
    # One report per interval at most (and one in flight at either end), whatever the requests.
    assert reports <= elapsed / REPORT_INTERVAL_S + 2 < requests, (reports, elapsed)
    counts = client.get("/v1/stats").json()  # and the read has them all: it reports first
    assert counts["requests"] >= requests


def test_concurrent_requests_each_get_their_own_answer_or_error(service):
    """Raw requests that arrive together are encoded (and decoded) together: a bad block
    among them (non-finite values, another mode, a corrupt frame) is refused alone, and
    every other request gets its own right answer."""
    client, _ = service
    requests = []
    for i in range(24):
        t = torch.randn(16, 64, generator=torch.Generator().manual_seed(i))
        options = {"scaling": "token"} if i % 3 else {"fp8": "e5m2"}
        if i % 4 == 1:
            t[3, 5] = float("inf")
        expected = None if i % 4 == 1 else bytes(service_codec(**options).encode(t))
        requests.append(("/v1/encode", encode_params(t, **options), tensor_to_bytes(t).tobytes(), expected))
    frame = bytes(service_codec().encode(torch.randn(8, 8)))
    for i in range(8):
        corrupt = i % 2 == 1
        body = frame[:40] + bytes([frame[40] ^ 1]) + frame[41:] if corrupt else frame
        requests.append(("/v1/decode", {}, body, None if corrupt else tensor_to_bytes(decode(frame)).tobytes()))

    async def send_all():
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120) as c:
            return await asyncio.gather(*(c.post(route, params=params, content=body) for route, params, body, _ in requests))

    for (route, params, _, expected), r in zip(requests, asyncio.run(send_all())):
        if expected is None:
            assert r.status_code == 422, (route, params, r.text)
        else:
            assert r.status_code == 200 and digest(r.content) == digest(expected), (route, params, r.status_code, r.text[:300])


def test_no_access_log_line_per_request(service, ray_session):
    """Serve writes an access-log line per request in the replica's log unless told not
    to; the deployment tells it not to."""
    from ray._private.worker import _global_node

    client, _ = service
    logs = Path(_global_node.get_logs_dir_path()) / "serve"
    replica_logs = sorted(logs.glob("replica_fp8ray_Fp8Service_*.log"))
    assert replica_logs, sorted(p.name for p in logs.iterdir())  # the replica logs there

    def route_lines() -> int:
        return sum(p.read_text(errors="replace").count("/v1/encode") for p in replica_logs)

    before = route_lines()
    t = torch.randn(4, 32)
    for _ in range(20):
        assert client.post("/v1/encode", params=encode_params(t), content=tensor_to_bytes(t).tobytes()).status_code == 200
    assert route_lines() == before


def test_a_client_hanging_up_mid_body_is_recorded_not_logged_as_a_failure(service, ray_session):
    """Logged with a traceback as 'POST /v1/encode failed' (a 500) before; now recorded
    with status 499, as Serve's proxy records it, and counted apart from the errors (it
    was counted as one: no failure of the service)."""
    from ray._private.worker import _global_node

    client, _ = service
    logs = Path(_global_node.get_logs_dir_path()) / "serve"

    def failures() -> list[str]:
        """The replica's own line for a request that raised (logger.exception), not Serve's
        'Request failed.' for a handle call that raised, which earlier tests make and Serve
        may write late."""
        text = "".join(p.read_text(errors="replace") for p in logs.glob("replica_fp8ray_Fp8Service_*.log"))
        return [line for line in text.splitlines() if "POST /v1/encode failed" in line]

    before, stats = failures(), client.get("/v1/stats").json()
    port = int(str(client.base_url).rstrip("/").rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/encode?dtype=float32&shape=256 HTTP/1.1\r\nHost: x\r\nContent-Length: 1024\r\n\r\n" + b"\0" * 10)
        time.sleep(1)  # the replica is reading the body when the client hangs up
    deadline = time.monotonic() + 20
    while (after := client.get("/v1/stats").json()).get("client_closed") == stats.get("client_closed"):
        assert time.monotonic() < deadline, (stats, after)  # until the hung-up request is recorded
        time.sleep(0.2)
    assert after["client_closed"] == stats["client_closed"] + 1 and after["bytes_in"] == stats["bytes_in"], (stats, after)
    assert after["errors"] == stats["errors"], (stats, after)
    assert failures() == before, failures()[len(before) :]


def read_response(s: socket.socket) -> tuple[bytes, bytes]:
    """An HTTP/1.1 response's status line and headers, and its body (of Content-Length bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, data  # closed before its answer
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, (head, body)
        body += chunk
    return head, body


def test_stalled_bodies_are_answered_408_and_free_the_replica(service):
    """As many clients as the replica takes at a time each send part of a body, then
    nothing: every request waited for ever behind them, /healthz too. Each is answered
    408 once its body has been silent for body_timeout_s, and the service answers again."""
    from fp8ray.serve.deployment import Fp8Service

    client, _ = service
    port = client.base_url.port
    stalled = []
    try:
        for _ in range(Fp8Service.max_ongoing_requests):
            s = socket.create_connection(("127.0.0.1", port))
            s.settimeout(20 * BODY_TIMEOUT_S)  # only so that a failure ends: the answer comes after BODY_TIMEOUT_S
            s.sendall(b"POST /v1/encode?dtype=bfloat16&shape=64 HTTP/1.1\r\nHost: x\r\nContent-Length: 128\r\n\r\n" + b"\0" * 8)
            stalled.append(s)
        r = client.get("/healthz")  # queued behind them until they time out
        assert r.status_code == 200, r.text
        for s in stalled:
            head, body = read_response(s)
            assert head.startswith(b"HTTP/1.1 408 "), head
            assert b'"field":"body"' in body and b"no byte of the body came for 3 s (after 8 bytes)" in body, body
    finally:
        for s in stalled:
            s.close()


async def _load(url: str, clients: int, requests: int, blocks: list[tuple[dict, bytes, str]], kill=None) -> dict:
    """``clients`` concurrent clients, ``requests`` each; every answer checked against the
    codec's own frame. Returns counts of each outcome."""
    outcome = {"ok": 0, "503": 0, "wrong": 0, "other": 0}

    async def client_loop(c: int):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for i in range(requests):
                params, body, expected = blocks[(c + i) % len(blocks)]
                r = await client.post("/v1/encode", params=params, content=body)
                if r.status_code == 200:
                    outcome["ok" if digest(r.content) == expected else "wrong"] += 1
                elif r.status_code == 503:
                    outcome["503"] += 1
                else:
                    outcome["other"] += 1
                if kill is not None and c == 0 and i == requests // 4:
                    kill()

    await asyncio.gather(*(client_loop(c) for c in range(clients)))
    return outcome


def one_mib_blocks(n: int) -> list[tuple[dict, bytes, str]]:
    codec = service_codec(scaling="token")
    out = []
    for seed in range(n):
        t = torch.randn(8, 256, 256, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)  # 1 MiB
        out.append((encode_params(t, scaling="token"), tensor_to_bytes(t).tobytes(), digest(codec.encode(t))))
    return out


@pytest.mark.slow
def test_load_16_clients_50_requests_of_1_mib(service):
    client, _ = service
    outcome = asyncio.run(_load(str(client.base_url), clients=16, requests=50, blocks=one_mib_blocks(8)))
    assert outcome == {"ok": 800, "503": 0, "wrong": 0, "other": 0}


@pytest.mark.slow
def test_sigkill_of_a_worker_under_load_gives_no_wrong_answer(service, ray_session):
    client, _ = service
    victim = serve_worker_info(ray_session)[0].pid
    retries_before = client.get("/v1/stats").json()["retries"]
    outcome = asyncio.run(
        _load(
            str(client.base_url), clients=8, requests=20, blocks=one_mib_blocks(4), kill=lambda: os.kill(victim, signal.SIGKILL)
        )
    )
    assert outcome["wrong"] == 0 and outcome["other"] == 0, outcome
    assert outcome["ok"] + outcome["503"] == 160 and outcome["ok"] >= 80, outcome
    # The controller recreates the worker; the service answers again with both.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = client.get("/healthz")
        if r.status_code == 200 and r.json()["workers_alive"] == 2:
            break
        time.sleep(1)
    assert r.status_code == 200 and r.json()["workers_alive"] == 2, r.text
    assert victim not in {i.pid for i in serve_worker_info(ray_session)}
    assert client.get("/v1/stats").json()["retries"] > retries_before  # the retry path ran
    params, body, expected = one_mib_blocks(1)[0]
    r = client.post("/v1/encode", params=params, content=body)
    assert r.status_code == 200 and digest(r.content) == expected


def serve_worker_info(ray) -> list[dict]:
    """``info()`` of each QuantWorker of the app, found by name as a replica would."""
    from ray.util import list_named_actors

    names = [a for a in list_named_actors(all_namespaces=True) if "quant-worker-" in a["name"]]
    return [ray.get(ray.get_actor(a["name"], namespace=a["namespace"]).info.remote()) for a in names]


def readme_handle_snippet() -> str:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    (snippet,) = [b for b in blocks if "get_app_handle" in b]
    return snippet


def start_serve(tmp_path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """`fp8ray serve ARGS` on a free port, in a session (process group) of its own, once
    it says it listens; its output in tmp_path/serve.log."""
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
    env.pop("RAY_ADDRESS", None)
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fp8ray.cli", "serve", "--port", str(port), "--workers", "1", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while "listening on" not in (tmp_path / "serve.log").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)  # only the group this test started
            raise AssertionError((tmp_path / "serve.log").read_text()[-3000:])
        time.sleep(0.5)
    return proc, port


@pytest.mark.slow
def test_fp8ray_serve_command_serves_until_sigterm(tmp_path):
    """`fp8ray serve` starts its own Ray, answers on 127.0.0.1, and on SIGTERM drains:
    a request in flight is answered, new ones 503 in the service's JSON (Serve's plain
    404 before, and in-flight requests dropped); then it shuts down cleanly (exit 0,
    port closed)."""
    proc, port = start_serve(tmp_path, "--archives", str(tmp_path))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    try:
        assert f"1 QuantWorkers, reading the archives under {tmp_path};" in (tmp_path / "serve.log").read_text()
        t = torch.randn(4, 64)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/encode", params=encode_params(t), content=tensor_to_bytes(t).tobytes(), timeout=60
        )
        assert r.status_code == 200 and digest(r.content) == digest(service_codec().encode(t))
        # The README's Serve-handle snippet, as written, in the Ray the command printed.
        address = re.search(r"RAY_ADDRESS=(\S+)", (tmp_path / "serve.log").read_text())[1]
        (tmp_path / "handle.py").write_text(readme_handle_snippet() + "\nassert tensor.shape == (2, 30, 256, 192)\n")
        client = subprocess.run(
            [sys.executable, "handle.py"],
            cwd=tmp_path,
            env={**env, "RAY_ADDRESS": address},
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        body = tensor_to_bytes(t).tobytes()
        with socket.create_connection(("127.0.0.1", port)) as in_flight:
            in_flight.settimeout(120)  # only so that a failure ends
            head = f"POST /v1/encode?dtype=float32&shape=4,64 HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            in_flight.sendall(head.encode() + body[:100])
            proc.send_signal(signal.SIGTERM)
            answers = []
            while not answers or answers[-1] != "closed" and answers[-1].status_code == 200:  # until the stop is known
                try:
                    answers.append(httpx.post(f"http://127.0.0.1:{port}/v1/encode", params=encode_params(t), content=body))
                except httpx.TransportError:
                    answers.append("closed")
            assert answers[-1] != "closed" and answers[-1].status_code == 503, answers
            assert error_of(answers[-1]) == {"error": "the service is stopping", "status": 503}
            assert answers[-1].headers["retry-after"] == "1"
            in_flight.sendall(body[100:])  # the rest, once new requests are refused
            status, answer = read_response(in_flight)
            assert status.startswith(b"HTTP/1.1 200 ") and digest(answer) == digest(service_codec().encode(t)), status
        assert proc.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # only the group this test started
    text = (tmp_path / "serve.log").read_text()
    assert "shutting down" in text
    # Nothing but fp8ray's own lines: no Serve start-up chatter, no failed shutdown call.
    assert [line for line in text.splitlines() if not line.startswith("fp8ray serve: ")] == [], text[-3000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)


@pytest.mark.slow
def test_a_sigterm_to_the_whole_process_group_ends_the_command_at_once(tmp_path):
    """`timeout`, `kill -- -PGID` and systemd signal the command's whole group, the
    embedded Ray's GCS and raylet with it: the stop waited a minute on the dead GCS, then
    Ray ended the process (exit 1), leaving its folders. Now it sees the GCS gone, tears
    down at once and exits 130 with the interrupted line, leaving nothing."""
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="fp8t-", dir="/tmp")  # short: Ray's socket paths are limited
    try:
        proc, port = start_serve(tmp_path, env={"RAY_TMPDIR": ray_tmp})
        try:
            assert "1 QuantWorkers, no --archives;" in (tmp_path / "serve.log").read_text()
            r = httpx.get(f"http://127.0.0.1:{port}/v1/archive/block", params={"archive": "kv.fp8", "key": "a"}, timeout=60)
            assert r.status_code == 404 and "without --archives" in r.json()["error"], r.text
            os.killpg(proc.pid, signal.SIGTERM)
            code = proc.wait(timeout=120)  # Ray's own end of it: exit 1 after a minute
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # only the group this test started
        text = (tmp_path / "serve.log").read_text()
        assert code == 130 and text.endswith("fp8ray: interrupted: serve stopped before it finished\n"), text[-3000:]
        assert os.listdir(ray_tmp) == []  # the embedded Ray's folder and the command's own
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_fp8ray_serve_refuses_an_archives_root_that_is_not_a_directory(tmp_path):
    """Before Ray starts, in one line naming it."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    missing = tmp_path / "no-such-dir"
    result = subprocess.run(
        [sys.executable, "-m", "fp8ray.cli", "serve", "--port", str(free_port()), "--archives", str(missing)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"fp8ray: error: archives root {str(missing)!r} is not a directory"
    ], result.stderr


def test_a_block_over_the_body_limit_is_refused_413(archives_root):
    """The block route's answer is bounded by --max-body-mb, not by its (bodiless) request:
    the replica's read, with a limit below the block's size, refuses it naming the key."""
    from types import SimpleNamespace

    from fp8ray.errors import RequestError
    from fp8ray.io.reader import ArchiveReader
    from fp8ray.serve.archives import ArchiveRoot
    from fp8ray.serve.deployment import Fp8Service

    root, restored = archives_root
    block = restored["a.safetensors"]["shared"]
    read_block = Fp8Service.func_or_class._read_block
    replica = SimpleNamespace(_archives=ArchiveRoot(str(root)), max_body_bytes=block.nbytes)
    response, carried = read_block(replica, "kv.fp8", "shared", "a.safetensors")  # exactly at the limit
    assert response.status_code == 200 and carried == block.nbytes + len(build_safetensors([], {"request": "0"}))
    replica.max_body_bytes = block.nbytes - 1

    def not_read(*args, **kwargs):
        raise AssertionError("a block over the limit is refused before its frame is read")

    with pytest.MonkeyPatch.context() as mp, pytest.raises(RequestError) as refused:
        mp.setattr(ArchiveReader, "get", not_read)
        read_block(replica, "kv.fp8", "shared", "a.safetensors")
    assert (refused.value.status, refused.value.field) == (413, "key") and "--max-body-mb" in str(refused.value)


def test_an_archive_block_at_the_limit_is_answered_with_its_header_on_top(service, archives_root, tmp_path):
    """A block of exactly --max-body-mb whose file has a long key and kilobytes of
    __metadata__ is answered 200: its header is carried on top of the limit (the answer's
    bound counted 1 KiB for it, and a block at the limit answered 500)."""
    from safetensors.torch import save_file

    from fp8ray.engine.archives import compress_archive

    client, _ = service
    key, metadata = "k" * 2000, {"note": "x" * 3000}
    block = torch.arange(MAX_BODY_MB << 18, dtype=torch.float32) % 7  # MAX_BODY_MB MiB
    save_file({key: block}, str(tmp_path / "big.safetensors"), metadata=metadata)
    compress_archive(str(tmp_path / "big.safetensors"), str(archives_root[0] / "big.fp8"), pool=fp8ray_inline())
    r = client.get("/v1/archive/block", params={"archive": "big.fp8", "key": key})
    assert r.status_code == 200, r.text[:300]
    [(got, dtype, shape, data)], got_metadata = parse_safetensors(r.content, tuple(SOURCE_DTYPES))
    assert (got, dtype, shape, got_metadata) == (key, "float32", tuple(block.shape), metadata)
    assert digest(data) == digest(tensor_to_bytes(decode(Fp8Codec().encode(block))))


def test_an_archive_blocks_refusal_quoting_long_file_names_is_answered(service, archives_root, tmp_path):
    """A key in three files whose names are long: the 400 naming them is longer than five
    times the short query, and answered 500 once the route's bound became its request's
    (a refusal quotes the archive, bounded as a block is)."""
    from safetensors.torch import save_file

    from fp8ray.engine.archives import compress_archive

    client, _ = service
    for i in range(3):
        path = tmp_path / "src" / ("d" * 200) / f"{i}{'f' * 200}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"k": torch.zeros(4)}, str(path))
    compress_archive(str(tmp_path / "src"), str(archives_root[0] / "many.fp8"), pool=fp8ray_inline())
    r = client.get("/v1/archive/block", params={"archive": "many.fp8", "key": "k"})
    assert r.status_code == 400 and error_of(r)["field"] == "file", r.text[:300]
    assert "is in 3 files of archive" in error_of(r)["error"] and len(r.content) > 5 * len("archive=many.fp8&key=k") + 1024


def test_a_long_query_parameter_name_is_refused_400_within_the_answers_bound(service):
    """A name of 3000 raw backslashes (one URL byte each, six in the JSON answer when it
    was echoed whole, twice) is refused 400 as unknown, shown cut short: it answered 500,
    the answer over its bound."""
    import http.client

    client, _ = service
    name = "\\" * 3000
    for method, route in (("POST", "/v1/encode"), ("POST", "/v1/decode"), ("GET", "/v1/archive/block")):
        connection = http.client.HTTPConnection(client.base_url.host, client.base_url.port, timeout=60)
        connection.request(method, f"{route}?{name}=1", body=b"", headers={"Content-Length": "0"})
        r = connection.getresponse()
        answer = r.read()
        connection.close()
        assert r.status == 400, answer[:300]
        assert r.getheader("content-type") == "application/json" and len(answer) < 1024
        assert re.search(rb'"unknown (option|parameter) \'(\\\\){56}\.\.\.', answer), answer[:300]


def test_the_replica_keeps_its_last_readers_and_reopens_a_replaced_archive(archives_root, tmp_path):
    from fp8ray.serve.archives import ArchiveRoot

    root, restored = archives_root
    for name in ("b.fp8", "c.fp8"):
        shutil.copytree(root / "kv.fp8", tmp_path / name)
    shutil.copytree(root / "kv.fp8", tmp_path / "kv.fp8")
    archives = ArchiveRoot(str(tmp_path), kept=2)
    first = archives.reader("kv.fp8")
    assert archives.reader("./kv.fp8") is first  # the same archive, however named: not read again
    archives.reader("b.fp8")
    archives.reader("c.fp8")  # the least recently used, kv.fp8, is let go
    assert archives.reader("kv.fp8") is not first
    again = archives.reader("kv.fp8")
    shutil.rmtree(tmp_path / "kv.fp8")
    # Replaced, as compress --overwrite does: a manifest written anew.
    shutil.copytree(root / "kv.fp8", tmp_path / "kv.fp8", copy_function=shutil.copyfile)
    replaced = archives.reader("kv.fp8")
    assert replaced is not again and torch.equal(replaced.get("only0"), restored["a.safetensors"]["only0"])
