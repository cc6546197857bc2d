"""fp8ray.lmcache without the lmcache package: the seed-compatible pair matches LMCache's fp8
serde byte for byte where the seed's cast is finite; the frame pair writes exactly its
estimate and refuses what it cannot decode faithfully; the registered type's options.

The same classes inside the real lmcache package: tests/lmcache/test_lmcache_package.py."""

from __future__ import annotations

import enum
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _util import DTYPES, kv_like

import fp8ray
from fp8ray.codec import CodecOptions, Fp8Codec, frame
from fp8ray.errors import BadInputError, CorruptFrameError, InvalidOptionError, MismatchError, NonFiniteError
from fp8ray.lmcache import (
    Fp8FrameDeserializer,
    Fp8FrameMultiDeserializer,
    Fp8FrameMultiSerializer,
    Fp8FrameSerializer,
    Fp8QuantizationDeserializer,
    Fp8QuantizationSerializer,
    MemoryLayoutDesc,
    make_fp8_serde,
    read_frame_header,
    serde_options,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def obj(t):
    return SimpleNamespace(tensor=t)


def seed_serialize(src: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """What the seed writes: ``src.to(fp8).contiguous().view(uint8).flatten()``."""
    return src.to(fp8_dtype).contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_serialize_matches_seed_bytes_in_range(fp8_dtype, dtype):
    fmax = torch.finfo(fp8_dtype).max
    src = kv_like((2, 4, 32, 64), dtype, seed=1).float().clamp(-fmax, fmax).to(dtype)
    dst = torch.full((src.numel() + 100,), 0xAB, dtype=torch.uint8)
    n = Fp8QuantizationSerializer(fp8_dtype).serialize(obj(src), obj(dst))
    assert n == src.numel()
    assert torch.equal(dst[:n], seed_serialize(src, fp8_dtype))
    assert (dst[n:] == 0xAB).all()  # nothing written past the payload


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_out_of_range_saturates(fp8_dtype):
    fmax = torch.finfo(fp8_dtype).max
    src = torch.tensor([fmax * 1.5, -fmax * 8, 1e30, -1e30, 1.0])
    dst = torch.empty(5, dtype=torch.uint8)
    Fp8QuantizationSerializer(fp8_dtype).serialize(obj(src), obj(dst))
    assert dst.view(fp8_dtype).float().tolist() == [fmax, -fmax, fmax, -fmax, 1.0]


def test_nonfinite_input_raises_unless_kept():
    src = torch.tensor([1.0, float("nan"), float("inf")])
    dst = torch.empty(3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"2 non-finite value\(s\).*index \[1\]"):
        Fp8QuantizationSerializer().serialize(obj(src), obj(dst))
    Fp8QuantizationSerializer(torch.float8_e5m2, nonfinite="keep").serialize(obj(src), obj(dst))
    back = dst.view(torch.float8_e5m2).float()
    assert back[0] == 1 and torch.isnan(back[1]) and back[2] == float("inf")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_deserialize_matches_seed(fp8_dtype, dtype):
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)
    src = torch.cat([codes, torch.zeros(10, dtype=torch.uint8)])  # a longer buffer, as LMCache pads
    dst = torch.empty(4, 256, dtype=dtype)
    Fp8QuantizationDeserializer(fp8_dtype).deserialize(obj(src), obj(dst))
    expected = codes.view(fp8_dtype).reshape(4, 256).to(dtype)
    nan = torch.isnan(expected)
    assert torch.isnan(dst[nan]).all()
    assert torch.equal(dst[~nan], expected[~nan])


def test_deserialize_into_non_contiguous_dst():
    src = seed_serialize(kv_like((8, 16), torch.float32).clamp(-400, 400), torch.float8_e4m3fn)
    dst = torch.empty(16, 8, dtype=torch.bfloat16).t()
    Fp8QuantizationDeserializer().deserialize(obj(src), obj(dst))
    assert torch.equal(dst, src.view(torch.float8_e4m3fn).reshape(8, 16).to(torch.bfloat16))


def test_round_trip_through_both():
    src = kv_like((2, 30, 16, 64), torch.bfloat16, seed=4).float().clamp(-448, 448).to(torch.bfloat16)
    ser, de = make_fp8_serde({"fp8_dtype": "float8_e4m3fn"})
    layout = MemoryLayoutDesc(shapes=[src.shape], dtypes=[src.dtype])
    buf = torch.empty(ser.estimate_serialized_size(layout), dtype=torch.uint8)
    assert ser.serialize(obj(src), obj(buf)) == buf.numel()
    out = torch.empty_like(src)
    de.deserialize(obj(buf), obj(out))
    assert torch.equal(out, src.to(torch.float8_e4m3fn).to(torch.bfloat16))


ONE_BYTE_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_every_real_dtype_gives_lmcaches_bytes(fmt):
    """LMCache's fp8 serde casts a source of any dtype (vLLM's fp8 KV cache included: a
    cast to its own format is the identity); the pair gives the same bytes wherever that
    cast is finite. They were refused (float64, fp8, integers) before."""
    fp8 = getattr(torch, fmt)
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(4096, generator=g, dtype=torch.float64) * torch.logspace(-12, 6, 4096, dtype=torch.float64)
    near = torch.tensor([1.0625 + 2.0**-40, 1.0625 - 2.0**-40, -0.0, 2.0**-10 + 2.0**-60, 1e39, -1e300], dtype=torch.float64)
    sources = [torch.cat([wide, near])]  # float64: rounded to float32 first, as torch does (the near-midpoint pair)
    sources += [torch.arange(256, dtype=torch.uint8).view(d) for d in ONE_BYTE_FLOATS]
    sources += [torch.arange(-600, 600, dtype=d) for d in (torch.int8, torch.int16, torch.int32, torch.int64)]
    sources += [torch.arange(256, dtype=torch.uint8), torch.tensor([True, False])]
    ser, de = make_fp8_serde({"fp8_dtype": fmt})
    for src in sources:
        src = src[src.double().isfinite() & src.to(fp8).float().isfinite()]  # where LMCache's cast is finite
        buf = torch.empty(src.numel(), dtype=torch.uint8)
        assert ser.serialize(obj(src), obj(buf)) == src.numel()
        assert torch.equal(buf, src.to(fp8).view(torch.uint8)), src.dtype
        out = torch.empty_like(src)
        de.deserialize(obj(buf), obj(out))  # back into the source's dtype, as LMCache's cast
        assert torch.equal(out.view(torch.uint8), buf.view(fp8).to(src.dtype).view(torch.uint8)), src.dtype  # NaN too


def test_a_non_finite_value_is_named_in_the_sources_own_dtype():
    src = torch.tensor([1.0, 2.0, float("inf")], dtype=torch.float64)
    buf = torch.empty(3, dtype=torch.uint8)
    with pytest.raises(NonFiniteError, match=r"a \(3,\) float64 tensor"):
        Fp8QuantizationSerializer().serialize(obj(src), obj(buf))


def test_estimate_is_one_byte_per_element():
    layout = MemoryLayoutDesc(shapes=[torch.Size([2, 30, 256, 192]), (3, 5)], dtypes=[torch.bfloat16] * 2)
    assert Fp8QuantizationSerializer().estimate_serialized_size(layout) == 2 * 30 * 256 * 192 + 15


def test_sizes_are_checked_and_named():
    with pytest.raises(ValueError, match="dst holds 10 bytes but src needs 12"):
        Fp8QuantizationSerializer().serialize(obj(torch.ones(3, 4)), obj(torch.empty(10, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="src holds 5 bytes but dst needs 6"):
        Fp8QuantizationDeserializer().deserialize(obj(torch.zeros(5, dtype=torch.uint8)), obj(torch.empty(2, 3)))


def test_tensors_with_no_dense_memory_are_refused_by_name():
    """A meta dst was "written" (the bytes went nowhere, and the serde returned their
    count); a meta or sparse src raised torch's own RuntimeError from deep inside."""
    ser, de = Fp8QuantizationSerializer(), Fp8QuantizationDeserializer()
    buf = torch.zeros(4, dtype=torch.uint8)
    for call, said in (
        (lambda: ser.serialize(obj(torch.ones(4, device="meta")), obj(buf)), "src tensor is a meta tensor: it has no data"),
        (lambda: ser.serialize(obj(torch.eye(2).to_sparse()), obj(buf)), "src tensor is a sparse_coo tensor"),
        (lambda: ser.serialize(obj(torch.eye(2, dtype=torch.int32).to_sparse()), obj(buf)), "src tensor is a sparse_coo"),
        (lambda: ser.serialize(obj(torch.ones(4)), obj(buf.to("meta"))), "dst tensor is a meta tensor: it has no data"),
        (lambda: de.deserialize(obj(buf), obj(torch.empty(4, device="meta"))), "dst tensor is a meta tensor: it has no data"),
        # and the frame pair's source: torch's NotImplementedError from as_strided before
        (lambda: Fp8FrameSerializer().serialize(obj(torch.eye(4).to_sparse()), obj(buf)), "src tensor is a sparse_coo"),
    ):
        with pytest.raises(BadInputError, match=said):
            call()


def test_missing_tensors_and_bad_buffers():
    with pytest.raises(ValueError, match="requires src and dst to have tensors"):
        Fp8QuantizationSerializer().serialize(obj(None), obj(torch.empty(3, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="requires src and dst to have tensors"):
        Fp8QuantizationDeserializer().deserialize(obj(torch.empty(3, dtype=torch.uint8)), SimpleNamespace())
    with pytest.raises(ValueError, match="dst must be a 1-byte buffer"):
        Fp8QuantizationSerializer().serialize(obj(torch.ones(3)), obj(torch.empty(3)))
    with pytest.raises(ValueError, match="must be contiguous"):
        Fp8QuantizationSerializer().serialize(obj(torch.ones(3)), obj(torch.empty(3, 2, dtype=torch.uint8).t()))
    with pytest.raises(TypeError, match="unsupported dtype torch.complex64: a KV cache is real"):
        Fp8QuantizationSerializer().serialize(obj(torch.ones(3, dtype=torch.complex64)), obj(torch.empty(3, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="Unknown torch dtype: 'float8_e9m9'"):
        make_fp8_serde({"fp8_dtype": "float8_e9m9"})
    buffers = [np.zeros(64, np.uint8), bytearray(64), memoryview(bytearray(64))]
    for pair in (make_fp8_serde(), (Fp8FrameSerializer(), Fp8FrameDeserializer())):
        for buffer in buffers:  # not a tensor: named, not an AttributeError
            with pytest.raises(
                BadInputError, match=f"dst must be a torch tensor of 1-byte elements, got {type(buffer).__name__}"
            ):
                pair[0].serialize_tensors([torch.ones(4)], buffer)
            with pytest.raises(
                BadInputError, match=f"src must be a torch tensor of 1-byte elements, got {type(buffer).__name__}"
            ):
                pair[1].deserialize_tensors(buffer, [torch.empty(4)])


# --- LMCache's current interface: a key, and objects of several kernel groups ---------


class MultiObj:
    """An object shaped like LMCache's TensorMemoryObj holding several kernel groups: its
    ``.tensor`` views the whole buffer with the first shape, which cannot work (as in
    LMCache), so each group must be read through ``get_tensor(i)``."""

    def __init__(self, tensors):
        self._tensors = tensors

    def get_shapes(self):
        return [t.shape for t in self._tensors]

    def get_tensor(self, i):
        return self._tensors[i]

    @property
    def tensor(self):
        raise RuntimeError("shape mismatch: the first group's shape does not cover the buffer")


KEY = object()  # LMCache's ObjectKey, which content-agnostic serdes ignore


def test_seed_pair_takes_a_key_and_still_works_without_one():
    src = kv_like((2, 4, 16, 64), torch.bfloat16, seed=5).float().clamp(-448, 448).to(torch.bfloat16)
    ser, de = Fp8QuantizationSerializer(), Fp8QuantizationDeserializer()
    with_key, without = torch.empty(src.numel(), dtype=torch.uint8), torch.empty(src.numel(), dtype=torch.uint8)
    assert ser.serialize(obj(src), obj(with_key), KEY) == ser.serialize(obj(src), obj(without)) == src.numel()
    assert torch.equal(with_key, without) and torch.equal(with_key, seed_serialize(src, torch.float8_e4m3fn))
    a, b = torch.empty_like(src), torch.empty_like(src)
    de.deserialize(obj(with_key), obj(a), KEY)
    de.deserialize(obj(with_key), obj(b))
    assert torch.equal(a, b) and torch.equal(a, src.to(torch.float8_e4m3fn).to(torch.bfloat16))


def test_memory_layout_desc_needs_one_dtype_per_shape():
    with pytest.raises(ValueError, match="same length"):
        MemoryLayoutDesc(shapes=[(2, 3), (4,)], dtypes=[torch.bfloat16])
    with pytest.raises(ValueError, match="same length"):
        MemoryLayoutDesc(shapes=[], dtypes=[torch.float16])
    assert MemoryLayoutDesc().shapes == [] and Fp8FrameSerializer().estimate_serialized_size(MemoryLayoutDesc()) == 0


def test_seed_pair_writes_each_kernel_group_in_turn():
    groups = [
        kv_like((2, 3, 8, 16), torch.bfloat16, seed=1).clamp(-448, 448),
        kv_like((2, 3, 8, 8), torch.float16, seed=2).clamp(-448, 448),
    ]
    layout = MemoryLayoutDesc(shapes=[g.shape for g in groups], dtypes=[g.dtype for g in groups])
    ser, de = Fp8QuantizationSerializer(), Fp8QuantizationDeserializer()
    buf = torch.empty(ser.estimate_serialized_size(layout), dtype=torch.uint8)
    assert ser.serialize(MultiObj(groups), obj(buf), KEY) == buf.numel() == sum(g.numel() for g in groups)
    assert torch.equal(buf, torch.cat([seed_serialize(g, torch.float8_e4m3fn) for g in groups]))
    out = [torch.empty_like(g) for g in groups]
    de.deserialize(obj(buf), MultiObj(out), KEY)
    for g, o in zip(groups, out):
        assert torch.equal(o, g.to(torch.float8_e4m3fn).to(g.dtype))


# --- the frame pair ------------------------------------------------------------------


MODES = [CodecOptions(), CodecOptions(scaling="token", scale_dtype="float32"), CodecOptions(fp8="e5m2", scaling="none")]


@pytest.mark.parametrize("options", MODES, ids=lambda o: o.label())
@pytest.mark.parametrize("dtype", DTYPES)
def test_frame_serializer_writes_exactly_its_estimate_and_the_codecs_frame(options, dtype):
    src = kv_like((2, 4, 32, 64), dtype, seed=3)
    ser = Fp8FrameSerializer(options)
    layout = MemoryLayoutDesc(shapes=[src.shape], dtypes=[src.dtype])
    size = ser.estimate_serialized_size(layout)
    assert size == Fp8Codec(options=options).encoded_size(src.shape, dtype)
    dst = torch.full((size + 64,), 0xAB, dtype=torch.uint8)  # a larger buffer: nothing written past the frame
    assert ser.serialize(obj(src), obj(dst), KEY) == size
    assert bytes(dst[:size].numpy()) == bytes(Fp8Codec(options=options).encode(src))
    assert bool((dst[size:] == 0xAB).all())
    out = torch.empty_like(src)
    Fp8FrameDeserializer(options).deserialize(obj(dst[:size]), obj(out), KEY)
    assert torch.equal(out, fp8ray.decode(dst[:size]))


def test_frames_of_several_kernel_groups_lie_end_to_end():
    groups = [kv_like((2, 3, 8, 64), torch.bfloat16, seed=1), kv_like((2, 3, 8, 32), torch.float32, seed=2)]
    layout = MemoryLayoutDesc(shapes=[g.shape for g in groups], dtypes=[g.dtype for g in groups])
    ser = Fp8FrameSerializer()
    sizes = ser.frame_sizes(layout)
    buf = torch.empty(ser.estimate_serialized_size(layout), dtype=torch.uint8)
    assert buf.numel() == sum(sizes) and ser.serialize(MultiObj(groups), obj(buf)) == buf.numel()
    assert frame.parse(buf[: sizes[0]].numpy()).shape == (2, 3, 8, 64)
    assert frame.parse(buf[sizes[0] :].numpy()).dtype == "float32"
    out = [torch.empty_like(g) for g in groups]
    Fp8FrameDeserializer().deserialize(obj(buf), MultiObj(out))
    for o, size, start in zip(out, sizes, (0, sizes[0])):
        assert torch.equal(o, fp8ray.decode(buf[start : start + size]))


def test_a_later_frame_with_a_damaged_header_is_refused_before_any_tensor_is_written():
    """The first group's tensor was written, then frame 2's bad magic (or damaged shape)
    raised: docs/LMCACHE.md promises every frame checked first but for its codes' checksum."""
    groups = [kv_like((2, 3, 8, 64), torch.bfloat16, seed=1), kv_like((2, 3, 8, 32), torch.float32, seed=2)]
    ser = Fp8FrameSerializer()
    first = ser.frame_sizes(MemoryLayoutDesc(shapes=[g.shape for g in groups], dtypes=[g.dtype for g in groups]))[0]
    buf = torch.empty(
        ser.estimate_serialized_size(MemoryLayoutDesc([g.shape for g in groups], [g.dtype for g in groups])), dtype=torch.uint8
    )
    ser.serialize(MultiObj(groups), obj(buf))
    for offset, error in ((0, "bad magic"), (17, r"shape \[4098, 3, 8, 32\]")):  # the magic; a byte of the shape
        bad = buf.clone()
        bad[first + offset] ^= 0x10
        out = [torch.zeros_like(g) for g in groups]
        with pytest.raises(CorruptFrameError, match=f"^block 'frame 2 of 2': .*{error}"):
            Fp8FrameDeserializer().deserialize(obj(bad), MultiObj(out))
        assert not any(bool(o.any()) for o in out), offset


def test_frame_deserializer_refuses_corrupt_truncated_and_mismatched_frames():
    src = kv_like((2, 4, 16, 64), torch.bfloat16, seed=7)
    ser, de = Fp8FrameSerializer(), Fp8FrameDeserializer()
    size = ser.estimate_serialized_size(MemoryLayoutDesc([src.shape], [src.dtype]))
    buf = torch.empty(size, dtype=torch.uint8)
    ser.serialize(obj(src), obj(buf))
    for offset in (0, 20, size // 2, size - 1):  # header, shape, codes, checksum
        bad = buf.clone()
        bad[offset] ^= 0x10
        with pytest.raises(CorruptFrameError):  # the checksum is taken as the codes are decoded: dst may be written
            de.deserialize(obj(bad), obj(torch.zeros_like(src)))
    out = torch.zeros_like(src)
    with pytest.raises(CorruptFrameError, match="truncated"):
        de.deserialize(obj(buf[: size - 1]), obj(out))
    with pytest.raises(MismatchError, match="float16"):  # a sound frame of another dtype, same size
        de.deserialize(obj(buf), obj(torch.empty(src.shape, dtype=torch.float16)))
    with pytest.raises(MismatchError, match=r"dst is a \(2, 4, 8, 64\) torch.bfloat16 tensor, the frame holds \(2, 4, 16, 64\)"):
        de.deserialize(obj(buf), obj(torch.empty(2, 4, 8, 64, dtype=torch.bfloat16)))  # a sound frame of another shape
    assert not bool(out.any())  # refusals by size, dtype or shape come before anything is decoded


def test_frame_serializer_refuses_bad_input_and_short_buffers():
    ser = Fp8FrameSerializer()
    with pytest.raises(ValueError, match="dst holds 10 bytes but the frames of src need"):
        ser.serialize(obj(torch.ones(3, 4)), obj(torch.empty(10, dtype=torch.uint8)))
    for dtype in (torch.int32, torch.float64):  # refused by serialize, but the estimate answers: LMCache calls it unguarded
        assert ser.estimate_serialized_size(MemoryLayoutDesc([(3,)], [dtype])) == 3
        with pytest.raises(TypeError, match=f"unsupported dtype {dtype}"):
            ser.serialize(obj(torch.ones(3, dtype=dtype)), obj(torch.empty(100, dtype=torch.uint8)))
    with pytest.raises(NonFiniteError, match="1 non-finite"):
        ser.serialize(obj(torch.tensor([1.0, float("inf")])), obj(torch.empty(100, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="requires src and dst to have tensors"):
        ser.serialize(SimpleNamespace(), obj(torch.empty(100, dtype=torch.uint8)))


def test_read_frame_header_gives_the_header_without_the_checksum():
    t = kv_like((2, 3, 5), torch.float16)
    data = bytes(Fp8Codec(scaling="token").encode(t))
    header = read_frame_header(data[:40])  # 16 + 8 * 3 bytes suffice
    assert header == frame.parse(np.frombuffer(data, np.uint8)) and header.frame_size == len(data)
    assert read_frame_header(data[:30]) is None and read_frame_header(b"\0" * 64) is None
    with pytest.raises(CorruptFrameError, match="unknown dtype code 99"):
        read_frame_header(data[:7] + b"\x63" + data[8:])


def test_both_pairs_take_tensors_and_a_buffer_as_they_take_lmcaches_objects():
    """serialize_tensors / deserialize_tensors (the interface the store conversion calls)
    write and read the same bytes as serialize / deserialize on objects."""
    groups = [kv_like((2, 3, 8, 16), torch.bfloat16, seed=21).clamp(-448, 448), kv_like((2, 3, 8, 8), torch.float32, seed=22)]
    layout = MemoryLayoutDesc([g.shape for g in groups], [g.dtype for g in groups])
    for ser, de in ((Fp8QuantizationSerializer(), Fp8QuantizationDeserializer()), (Fp8FrameSerializer(), Fp8FrameDeserializer())):
        size = ser.serialized_size([(g.shape, g.dtype) for g in groups])
        assert size == ser.estimate_serialized_size(layout)
        by_object, by_tensors = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
        assert ser.serialize(MultiObj(groups), obj(by_object)) == ser.serialize_tensors(groups, by_tensors) == size
        assert torch.equal(by_object, by_tensors)
        expected, out = [torch.empty_like(g) for g in groups], [torch.empty_like(g) for g in groups]
        de.deserialize(obj(by_object), MultiObj(expected))
        de.deserialize_tensors(by_tensors, out)
        assert all(torch.equal(e, o) for e, o in zip(expected, out))
        with pytest.raises(ValueError, match="dst must be a 1-byte buffer"):
            ser.serialize_tensors(groups, torch.empty(size, dtype=torch.float32))


# --- the registered type's options ----------------------------------------------------


def test_serde_options_default_to_the_default_mode_and_name_what_is_wrong():
    assert serde_options({}) == serde_options(None) == (CodecOptions(), 1, "refuse")
    assert serde_options({"scaling": "token", "block_size": 64, "max_workers": 4}) == (
        CodecOptions(scaling="token", block_size=64),
        4,
        "refuse",
    )
    assert serde_options({"fp8": "float8_e5m2", "max_workers": "2"}) == (CodecOptions(fp8="e5m2"), 2, "refuse")
    assert serde_options({"fp8_input": "passthrough"}).fp8_input == "passthrough"
    bad = {
        "fp8_dtype": {"fp8_dtype": "float8_e4m3fn"},  # the plain fp8 serde's option: here it is "fp8"
        "scaling": {"scaling": "row"},
        "block_size": {"block_size": 0},
        "scale_choice": {"scaling": "tensor", "scale_choice": "mse"},
        "max_workers": {"max_workers": 0},
        "fp8_input": {"fp8_input": "keep"},
    }
    for field, kwargs in bad.items():
        with pytest.raises(InvalidOptionError) as info:
            serde_options(kwargs)
        assert info.value.field == field and field in str(info.value)
    with pytest.raises(ValueError, match="max_workers must be a positive integer, got True"):
        serde_options({"max_workers": True})


@pytest.mark.parametrize("kwargs", [["scaling"], "scaling=token", 5])
@pytest.mark.parametrize("factory", [serde_options, make_fp8_serde])
def test_serde_kwargs_that_are_not_a_mapping_are_refused_by_type(factory, kwargs):
    """An adapter config with a list or string where its "serde" object goes: named, not
    an AttributeError from inside the factory."""
    with pytest.raises(BadInputError, match=f"must be a mapping .* got {type(kwargs).__name__}"):
        factory(kwargs)


def test_fp8ray_lmcache_imports_without_lmcache_and_register_says_what_is_missing():
    code = (
        "import sys; sys.modules['lmcache'] = None\n"  # as if not installed
        "import fp8ray.lmcache as m\n"
        "try:\n    m.register()\nexcept ImportError as e:\n    print(e)\n"
        "try:\n    m.make_serde_processor({'scaling': 'row'})\nexcept ValueError as e:\n    print('ValueError', e.field)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "'lmcache' package is not installed" in lines[0] and "pip install --no-deps lmcache==" in lines[0]
    assert lines[1] == "ValueError scaling"  # bad options are refused before LMCache is needed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dst_device", ["cpu", "cuda"])
def test_cuda_tensors_take_the_cuda_path_with_the_cpu_paths_bytes(dst_device):
    """On CUDA both pairs compute with the torch ops the CPU kernels equal bit for bit:
    the same bytes, and the same decoded tensors, on the GPU."""
    src = kv_like((2, 4, 32, 64), torch.bfloat16, seed=9).clamp(-448, 448)
    for ser, de in ((Fp8FrameSerializer(), Fp8FrameDeserializer()), (Fp8QuantizationSerializer(), Fp8QuantizationDeserializer())):
        size = ser.estimate_serialized_size(MemoryLayoutDesc([src.shape], [src.dtype]))
        on_cpu = torch.empty(size, dtype=torch.uint8)
        ser.serialize(obj(src), obj(on_cpu))
        buf = torch.empty(size, dtype=torch.uint8, device=dst_device)
        assert ser.serialize(obj(src.cuda()), obj(buf), KEY) == size
        assert torch.equal(buf.cpu(), on_cpu)
        expected = torch.empty_like(src)
        de.deserialize(obj(on_cpu), obj(expected))
        out = torch.empty(src.shape, dtype=src.dtype, device="cuda")
        de.deserialize(obj(buf), obj(out), KEY)
        assert torch.equal(out.cpu(), expected)


# --- LMCache after 0.5.6: fused layouts, K/V groups, 1-byte sources, used size, size contract ---


class ByteBuffer(SimpleNamespace):
    """A byte buffer with LMCache's ``set_used_size`` (MemoryObj), recording the calls."""

    def __init__(self, size):
        super().__init__(tensor=torch.full((size,), 0xAB, dtype=torch.uint8), used=[])

    def set_used_size(self, n):
        self.used.append(n)


@pytest.mark.parametrize("shape", [(2, 3, 16, 64), (1, 3, 16, 128)], ids=["split-2LTH", "fused-1LT2H"])
def test_frame_pair_takes_split_and_fused_kv_layouts(shape):
    src = kv_like(shape, torch.bfloat16, seed=11)
    ser, de = Fp8FrameSerializer(), Fp8FrameDeserializer()
    size = ser.estimate_serialized_size(MemoryLayoutDesc([src.shape], [src.dtype]))
    buf = torch.empty(size, dtype=torch.uint8)
    assert ser.serialize(obj(src), obj(buf), KEY) == size
    assert bytes(buf.numpy()) == bytes(Fp8Codec().encode(src))
    out = torch.empty_like(src)
    de.deserialize(obj(buf), obj(out), KEY)
    assert torch.equal(out, fp8ray.decode(buf))


def _group_of_kernel_groups(fp8_input: str = "refuse"):
    """K of two kernel groups ``A`` and ``B`` (bf16, or uint8 ``A`` passed through), V of
    one ``B``: a V-only read once took K's second group, of V's shape, for V."""
    from fp8ray.bench.lmcache import byte_obj, memory_obj

    a, b = (1, 3, 4, 64), (1, 2, 4, 32)
    k_dtypes = [torch.uint8 if fp8_input == "passthrough" else torch.bfloat16, torch.bfloat16]
    k, v = memory_obj([a, b], k_dtypes), memory_obj([b], [torch.bfloat16])
    g = torch.Generator().manual_seed(21)
    for i, t in enumerate([k.get_tensor(0), k.get_tensor(1), v.get_tensor(0)]):
        t.copy_((torch.randn(t.shape, generator=g) * (10 if i < 2 else 1)).to(t.dtype))
    ser, de = Fp8FrameMultiSerializer(fp8_input=fp8_input), Fp8FrameMultiDeserializer(fp8_input=fp8_input)
    size = ser.estimate_serialized_size(
        (MemoryLayoutDesc([torch.Size(a), torch.Size(b)], k_dtypes), MemoryLayoutDesc([torch.Size(b)], [torch.bfloat16]))
    )
    buf = byte_obj(size)
    ser.serialize((k, v), buf, KEY)
    return de, buf, v.get_tensor(0), lambda: memory_obj([b], [torch.bfloat16]), byte_obj


@pytest.mark.parametrize("fp8_input", ["refuse", "passthrough"])
def test_a_skipped_slot_of_several_kernel_groups_is_skipped_whole(fp8_input):
    de, buf, v, empty_v, byte_obj = _group_of_kernel_groups(fp8_input)
    expected = fp8ray.decode(bytes(Fp8Codec().encode(v)))
    v_only = empty_v()
    de.deserialize(buf, (None, v_only), KEY)  # K's frames (or passthrough bytes and a frame) skipped
    assert torch.equal(v_only.get_tensor(0), expected)
    # In a buffer longer than the group's frames, K's second group (of V's shape) and V both
    # fit, and the end does not decide: refused, not guessed
    frames = buf.tensor.numpy()
    longer = byte_obj(frames.size + 100)
    longer.tensor.numpy()[: frames.size] = frames
    if fp8_input == "refuse":
        with pytest.raises(MismatchError, match=r"2 places \(offsets .*\) in src fit the wanted tensors' frames"):
            de.deserialize(longer, (None, empty_v()), KEY)
    else:  # past K's passthrough bytes (no header) only the end could tell
        with pytest.raises(MismatchError, match=r"no place in src fits the wanted tensors' frames"):
            de.deserialize(longer, (None, empty_v()), KEY)


def test_passthrough_refuses_a_frame_where_it_wants_stored_bytes():
    """A store written from a bf16 cache, read by a server with vLLM's fp8 KV cache: its
    frame's header, scales and codes were handed back as fp8 codes (a hit)."""
    src = kv_like((2, 4, 16, 64), torch.bfloat16, seed=22)
    stored = bytes(Fp8Codec().encode(src))
    buf = torch.frombuffer(bytearray(stored), dtype=torch.uint8)
    fp8_dst = torch.zeros(src.shape, dtype=torch.uint8)
    with pytest.raises(MismatchError, match=r"for fp8 bytes stored as they are, but src holds the fp8ray frame of a bfloat16"):
        Fp8FrameDeserializer(fp8_input="passthrough").deserialize(obj(buf), obj(fp8_dst), KEY)
    assert not fp8_dst.any()


def test_frame_serializer_narrows_dst_to_what_it_wrote():
    src = kv_like((2, 3, 16, 64), torch.float16, seed=12)
    size = Fp8FrameSerializer().estimate_serialized_size(MemoryLayoutDesc([src.shape], [src.dtype]))
    dst = ByteBuffer(size + 100)  # a buffer larger than the estimate
    assert Fp8FrameSerializer().serialize(obj(src), dst, KEY) == size
    assert dst.used == [size]


def test_frame_pair_takes_k_and_v_groups_and_skips_a_none_destination_slot():
    k, v = kv_like((3, 16, 64), torch.bfloat16, seed=13), kv_like((3, 16, 64), torch.float16, seed=14)
    layouts = (MemoryLayoutDesc([k.shape], [k.dtype]), MemoryLayoutDesc([v.shape], [v.dtype]))
    for ser, de in ((Fp8FrameSerializer(), Fp8FrameDeserializer()), (Fp8FrameMultiSerializer(), Fp8FrameMultiDeserializer())):
        size = ser.estimate_serialized_size(layouts)
        assert size == Fp8Codec().encoded_size(k.shape, k.dtype) + Fp8Codec().encoded_size(v.shape, v.dtype)
        buf = torch.empty(size, dtype=torch.uint8)
        assert ser.serialize((obj(k), obj(v)), obj(buf), KEY) == size
        assert bytes(buf.numpy()) == bytes(Fp8Codec().encode(k)) + bytes(Fp8Codec().encode(v))
        k_out, v_out = torch.empty_like(k), torch.empty_like(v)
        de.deserialize(obj(buf), (obj(k_out), obj(v_out)), KEY)
        assert torch.equal(k_out, fp8ray.decode(bytes(Fp8Codec().encode(k)))) and torch.equal(
            v_out, fp8ray.decode(bytes(Fp8Codec().encode(v)))
        )
        v_only = torch.zeros_like(v)
        de.deserialize(obj(buf), (None, obj(v_only)), KEY)  # V-only retrieval: K's frame is skipped
        assert torch.equal(v_only, v_out)
        with pytest.raises(ValueError, match="slot 1 of the src group is None"):
            ser.serialize((obj(k), None), obj(buf), KEY)
        with pytest.raises(ValueError, match="slot 0 of the layout group is None"):
            ser.estimate_serialized_size((None, layouts[1]))
    multi = Fp8FrameMultiSerializer()
    assert multi.group_size == Fp8FrameMultiDeserializer().group_size == 2
    with pytest.raises(ValueError, match="has 3 slots; this serde takes groups of 2"):
        multi.serialize((obj(k), obj(v), obj(v)), obj(buf))
    with pytest.raises(ValueError, match="takes groups of 2 objects, got one object"):
        multi.serialize(obj(k), obj(buf))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.int16])
def test_the_serde_keeps_refusing_what_a_kv_cache_is_not_though_frames_can_store_it(dtype):
    """Fp8Codec stores such tensors in stored frames; the LMCache serde, for KV caches,
    refuses them both ways: a stored frame read into an int64 dst was "written with other
    serde options", which no option could fix."""
    t = torch.arange(2 * 64).reshape(2, 64).to(dtype)
    with pytest.raises(TypeError, match=f"src tensor has unsupported dtype {dtype}"):
        Fp8FrameSerializer().serialize(obj(t), ByteBuffer(4096), KEY)
    stored = torch.frombuffer(bytearray(Fp8Codec().encode(t)), dtype=torch.uint8)
    with pytest.raises(MismatchError, match=rf"^frame: dst tensor is {dtype}; the fp8ray serde decodes into bfloat16, float16"):
        Fp8FrameDeserializer().deserialize(obj(stored), obj(torch.empty_like(t)))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_one_byte_source_is_refused_naming_its_dtype_unless_passed_through(dtype):
    codes = torch.randint(0, 120, (1, 3, 16, 128), dtype=torch.uint8).view(dtype)  # vLLM's fp8 KV, fused
    layout = MemoryLayoutDesc([codes.shape], [codes.dtype])
    ser = Fp8FrameSerializer()
    assert ser.estimate_serialized_size(layout) == codes.numel()  # an estimate, never an error (LMCache sizes buffers by it)
    dst = ByteBuffer(codes.numel())
    with pytest.raises(BadInputError, match=rf"src tensor is {dtype} \[1, 3, 16, 128\]: already one byte per element") as info:
        ser.serialize(obj(codes), dst, KEY)
    assert info.value.field == "fp8_input" and '"fp8_input": "passthrough"' in str(info.value)
    assert dst.used == [] and bool((dst.tensor == 0xAB).all())  # nothing written, no size reported
    with pytest.raises(MismatchError, match=f"dst tensor is {dtype}"):
        Fp8FrameDeserializer().deserialize(obj(codes.view(torch.uint8).reshape(-1)), obj(torch.empty_like(codes)))
    # passthrough: the bytes as they are, exactly the estimate; K bf16 framed beside an fp8 V
    k = kv_like((3, 16, 64), torch.bfloat16, seed=15)
    ser, de = Fp8FrameSerializer(fp8_input="passthrough"), Fp8FrameDeserializer(fp8_input="passthrough")
    size = ser.estimate_serialized_size((MemoryLayoutDesc([k.shape], [k.dtype]), layout))
    dst = ByteBuffer(size)
    assert ser.serialize((obj(k), obj(codes)), dst, KEY) == size == Fp8Codec().encoded_size(k.shape, k.dtype) + codes.numel()
    assert dst.used == [size] and bytes(dst.tensor[-codes.numel() :].numpy()) == bytes(
        codes.view(torch.uint8).reshape(-1).numpy()
    )
    k_out, v_out = torch.empty_like(k), torch.empty_like(codes)
    de.deserialize(dst, (obj(k_out), obj(v_out)), KEY)
    assert torch.equal(v_out.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(
        k_out, fp8ray.decode(bytes(Fp8Codec().encode(k)))
    )
    with pytest.raises(InvalidOptionError, match="fp8_input must be one of"):
        Fp8FrameSerializer(fp8_input="keep")


# --- registration: the size contract, detected by what the installed LMCache's registry takes ---


class FakeContract(enum.Enum):
    EXACT = "exact"
    UPPER_BOUND = "upper_bound"


def fake_serde(takes_size_contract: bool, has_enum: bool = True):
    """A stand-in for ``lmcache.v1.distributed.serde``: LMCache main's registry
    (``register_serde_factory(name, factory, *, size_contract=UPPER_BOUND)``) or 0.5.6's
    (``register_serde_factory(name, factory)``), recording what each name was given."""
    registry, contracts = {}, {}
    if takes_size_contract:

        def register_serde_factory(name, factory, *, size_contract=FakeContract.UPPER_BOUND):
            if name in registry:
                raise ValueError(f"Serde type already registered: {name!r}")
            registry[name], contracts[name] = factory, size_contract

    else:

        def register_serde_factory(name, factory):
            if name in registry:
                raise ValueError(f"Serde type already registered: {name!r}")
            registry[name], contracts[name] = factory, None

    ns = SimpleNamespace(
        register_serde_factory=register_serde_factory,
        get_registered_serde_types=lambda: list(registry),
        factory=SimpleNamespace(_SERDE_FACTORY_REGISTRY=registry),
        contracts=contracts,
    )
    if has_enum:
        ns.SerdeSizeContract = FakeContract
    return ns


@pytest.mark.parametrize(
    "takes, has_enum, expected",
    [(True, True, FakeContract.EXACT), (False, False, None), (False, True, None)],
    ids=["main-takes-size_contract", "0.5.6-no-contract", "enum-but-registry-without-the-keyword"],
)
def test_register_declares_the_exact_size_contract_where_the_registry_takes_one(monkeypatch, takes, has_enum, expected):
    import fp8ray.lmcache.registry as module

    serde = fake_serde(takes, has_enum)
    monkeypatch.setattr(module, "_lmcache_serde", lambda: serde)
    assert module.exact_size_contract(serde) is expected
    assert module.register() is expected
    assert (
        serde.contracts == {"fp8ray": expected} and serde.factory._SERDE_FACTORY_REGISTRY["fp8ray"] is module.make_serde_processor
    )
    assert module.register() is expected and list(serde.contracts) == ["fp8ray"]  # a second call is a no-op
    serde.register_serde_factory("taken", lambda kwargs: None)
    with pytest.raises(ValueError, match="'taken' is already registered by another factory"):
        module.register("taken")


@pytest.mark.parametrize("padding", [0, 64], ids=["exact", "padded"])
@pytest.mark.parametrize(
    "written, read",
    [({"scaling": "token"}, {}), ({}, {"scaling": "token"}), ({"scale_dtype": "float32"}, {})],
    ids=["token-read-as-block", "block-read-as-token", "fp32-scales"],
)
def test_frames_written_under_other_options_are_named_so_not_as_damage(written, read, padding):
    """An adapter whose serde options changed reads every old chunk as another size: the
    frames are sound, so the error says what they were written with, before writing."""
    src = kv_like((4, 64), torch.bfloat16, seed=3)
    ser, de = Fp8FrameSerializer(CodecOptions.parse(written)), Fp8FrameDeserializer(CodecOptions.parse(read))
    size = ser.estimate_serialized_size(MemoryLayoutDesc([src.shape], [src.dtype]))
    buf = torch.zeros(size + padding, dtype=torch.uint8)
    ser.serialize(obj(src), obj(buf))
    out = torch.zeros_like(src)
    written_so = r"^frame was written with e4m3fn, .*; this deserializer's options are .*: read a store"
    with pytest.raises(MismatchError, match=written_so):
        de.deserialize(obj(buf), obj(out))
    assert not out.any()
    damaged = buf.clone()
    damaged[size - 1] ^= 1  # a damaged frame of other options is damage
    with pytest.raises(CorruptFrameError):
        de.deserialize(obj(damaged), obj(out))


def test_a_longer_frame_cut_to_the_readers_size_is_named_by_its_options_not_as_damage():
    """LMCache reads as many bytes as the reader's estimate: a chunk written with more
    scales (block 16) arrives cut short, and was called truncated (damage)."""
    src = kv_like((4, 64), torch.bfloat16, seed=3)
    stored = bytes(Fp8Codec(block_size=16).encode(src))
    size = Fp8Codec().encoded_size(src.shape, src.dtype)
    buf = torch.frombuffer(bytearray(stored[:size]), dtype=torch.uint8)
    out = torch.zeros_like(src)
    with pytest.raises(
        MismatchError,
        match=rf"^frame was written with e4m3fn, block 16, .*: read a store .*\(src holds {size} of its {len(stored)} bytes\)$",
    ):
        Fp8FrameDeserializer().deserialize(obj(buf), obj(out))
    assert not out.any()


def test_passthrough_writes_nothing_when_a_later_frame_holds_another_dtype():
    ser, de = Fp8FrameSerializer(fp8_input="passthrough"), Fp8FrameDeserializer(fp8_input="passthrough")
    fp8 = torch.randn(16).to(torch.float8_e4m3fn)
    bf16 = kv_like((4, 8), torch.bfloat16, seed=5)
    group = [obj(fp8), obj(bf16)]
    buf = torch.zeros(ser.serialized_size([(fp8.shape, fp8.dtype), (bf16.shape, bf16.dtype)]), dtype=torch.uint8)
    ser.serialize(group, obj(buf))
    first, second = torch.zeros(16, dtype=torch.float8_e4m3fn), torch.zeros(4, 8, dtype=torch.float16)
    mismatch = r"frame 2 of 2: dst is a \(4, 8\) torch.float16 tensor, the frame holds \(4, 8\) bfloat16"
    with pytest.raises(MismatchError, match=mismatch):
        de.deserialize(obj(buf), [obj(first), obj(second)])
    assert not first.view(torch.uint8).any() and not second.any()


def test_a_layout_naming_its_dtype_as_text_is_refused_by_name():
    with pytest.raises(TypeError, match=r"^layout dtype 0 is 'bfloat16', not a torch dtype"):
        Fp8FrameSerializer().estimate_serialized_size(MemoryLayoutDesc([[4]], ["bfloat16"]))


def test_deserializers_write_buffers_made_under_inference_mode():
    """vLLM makes its KV buffers under torch.inference_mode(), and LMCache's serde threads
    run outside it: the fp8 passthrough of the frame deserializer and the seed serde's
    strided path raised torch's "Inplace update to inference tensor outside InferenceMode"."""
    src = torch.randn(8, 64).to(torch.float8_e4m3fn)
    serializer = Fp8FrameSerializer(fp8_input="passthrough")
    buf = torch.empty(1 << 16, dtype=torch.uint8)
    total = serializer.serialize(SimpleNamespace(tensor=src), SimpleNamespace(tensor=buf))
    with torch.inference_mode():
        dst = torch.empty(8, 64, dtype=torch.float8_e4m3fn)
        strided = torch.empty(64, 8, dtype=torch.bfloat16).t()
    Fp8FrameDeserializer(fp8_input="passthrough").deserialize(SimpleNamespace(tensor=buf[:total]), SimpleNamespace(tensor=dst))
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    seed_serializer, seed_deserializer = make_fp8_serde({"fp8_dtype": "float8_e4m3fn"})
    bf16 = torch.randn(8, 64, dtype=torch.bfloat16)
    codes = torch.empty(bf16.numel(), dtype=torch.uint8)
    seed_serializer.serialize(SimpleNamespace(tensor=bf16), SimpleNamespace(tensor=codes))
    seed_deserializer.deserialize(SimpleNamespace(tensor=codes), SimpleNamespace(tensor=strided))
    assert torch.equal(strided, codes.view(torch.float8_e4m3fn).reshape(8, 64).to(torch.bfloat16))
