"""``Fp8Codec``: encode a bf16/fp16/fp32 tensor into a checked fp8 frame, and back; a
tensor of a dtype fp8 does not encode (integers, booleans, float64, complex64, fp8) into
a stored frame, its bytes as they are.

>>> import torch
>>> codec = Fp8Codec(fp8="e4m3fn", scaling="token")
>>> frame = codec.encode(torch.randn(8, 256, 64, dtype=torch.bfloat16))
>>> tensor = decode(frame)          # every parameter is read from the frame

The options, their defaults and the default mode are :class:`~fp8ray.codec.options.CodecOptions`;
the scale convention is in :mod:`fp8ray.codec.formats`; the frame layout in
:mod:`fp8ray.codec.frame` and docs/FORMAT.md. CPU tensors go through the numba kernels of
:mod:`fp8ray.codec.cpu`; tensors on other devices (CUDA) through the torch ops of
:mod:`fp8ray.codec.reference`, which the CPU kernels equal bit for bit.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..errors import BadInputError, BlockError, CorruptFrameError, InvalidOptionError, MismatchError, NonFiniteError
from . import cpu, frame
from .formats import INFINITY_BITS, KERNEL_TYPES, Fp8Format, dtype_name
from .options import DEFAULT_OPTIONS, CodecOptions

DEFAULT_BLOCK_SIZE = DEFAULT_OPTIONS.block_size

FLOAT64_STORED = (
    "a float64 tensor is stored as it is (8 bytes per element), not encoded in fp8: "
    "cast it to float32 first (x.float(), array.astype(numpy.float32)) to compress it"
)


def is_array(value) -> bool:
    """Whether ``value`` is a numpy array or scalar (what :func:`source_array` takes)."""
    return isinstance(value, (np.ndarray, np.generic))


def source_array(array) -> np.ndarray:
    """A numpy array or scalar :meth:`Fp8Codec.encode` takes (of a dtype a frame holds, in
    this machine's byte order) as a C-contiguous array of its shape, or the error naming
    what is wrong. No copy where it is contiguous already, read-only ones included."""
    if isinstance(array, np.generic):  # a numpy scalar: a 0-d array
        array = np.asarray(array)
    if isinstance(array, np.ma.MaskedArray):
        raise BlockError("cannot encode a masked array: its mask would be lost; fill it first (array.filled(value))")
    if not array.dtype.isnative:
        raise TypeError(
            f"array dtype {array.dtype} is not in this machine's byte order; "
            "convert it first (array.astype(array.dtype.newbyteorder('=')))"
        )
    dtype_name(array.dtype)  # a TypeError naming the dtypes there are
    return np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray would make a 0-d array 1-d


def not_dense(tensor) -> str | None:
    """What a tensor that is not dense and strided is ("nested", "sparse_coo", ...), or
    None: such a tensor has no memory of its own to encode from or decode into."""
    import torch

    if tensor.is_nested:
        return "nested"
    return None if tensor.layout == torch.strided else str(tensor.layout).removeprefix("torch.")


def source_tensor(tensor):
    """What :meth:`Fp8Codec.encode` takes (a dense tensor of a dtype a frame holds, or a
    numpy array or scalar of one) as a torch tensor, or the error naming what is wrong."""
    import torch  # a tensor was given (or a numpy array, made one here)

    if is_array(tensor):
        array = source_array(tensor)
        # torch warns of a read-only array (it could be written through the tensor): a copy
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy array, got {type(tensor).__name__}")
    kind = not_dense(tensor)
    if kind is not None:
        raise BlockError(f"cannot encode a {kind} tensor: give a dense one (tensor.to_dense())")
    dtype_name(tensor.dtype)  # a TypeError naming the dtypes there are
    if tensor.device.type == "meta":
        raise BlockError("cannot encode a meta tensor: it has no data")
    if tensor.dtype == torch.float64:  # numpy's default: more likely a cache to cast than one to keep
        warnings.warn(FLOAT64_STORED, stacklevel=3)  # at the caller of encode (or encode_many)
    return tensor


def _byte_buffer(out: np.ndarray | None, nbytes: int) -> np.ndarray:
    """``out``, checked to be a writable contiguous 1-D uint8 array of ``nbytes``, or a new one."""
    if out is None:
        try:
            return np.empty(nbytes, dtype=np.uint8)
        except MemoryError:  # an empty tensor's frame still holds a scale per channel or row
            raise BadInputError(f"the result needs {nbytes} bytes, more than this process can allocate") from None
    if not (
        isinstance(out, np.ndarray)
        and out.dtype == np.uint8
        and out.ndim == 1
        and out.size == nbytes
        and out.flags.writeable
        and out.flags.c_contiguous
    ):
        raise BadInputError(f"out must be a writable contiguous 1-D uint8 array of {nbytes} bytes", field="out")
    return out


def _apart(out: np.ndarray, source: np.ndarray, given, what: str = "the tensor being encoded", own: str = "a buffer"):
    """``source``, refused where ``out`` (the caller's ``given`` output; a fresh one shares
    nothing) shares its memory: an encode writes the header before it reads the codes, a
    decode its output as it reads the frame, so either would read what it overwrote."""
    if given is not None and np.may_share_memory(out, source):
        raise BadInputError(f"out overlaps {what}: give {own} of its own", field="out")
    return source


def raise_nonfinite(tensor, count: int) -> None:
    """Raise :class:`NonFiniteError` for a tensor (on any device) with ``count`` non-finite
    values, naming the first (found where the tensor is: only that value is copied)."""
    import torch

    flat = tensor.reshape(-1)
    first = int(torch.nonzero(~torch.isfinite(flat))[0, 0])
    _raise_nonfinite_at(tuple(tensor.shape), dtype_name(tensor.dtype), count, first, float(flat[first]))


def _raise_nonfinite(x: np.ndarray, dtype: str, count: int) -> None:
    """:func:`raise_nonfinite` for ``x``, the elements as the kernels take them
    (:func:`fp8ray.codec.cpu.kernel_array`)."""
    flat = x.reshape(-1)
    # +inf's bits are the exponent's: all set is inf or NaN
    bad = ~np.isfinite(flat) if dtype == "float32" else (flat & INFINITY_BITS[dtype]) == INFINITY_BITS[dtype]
    first = int(np.flatnonzero(bad)[0])
    element = flat[first : first + 1]
    if dtype == "bfloat16":
        value = float((element.astype(np.uint32) << 16).view(np.float32)[0])
    else:
        value = float(element.view(np.float16 if dtype == "float16" else np.float32)[0])
    _raise_nonfinite_at(x.shape, dtype, count, first, value)


# How a refusal of non-finite values ends: the option that stores them (a service, which
# takes no such option, says otherwise).
KEEP_HINT = " (nonfinite='keep', or --nonfinite keep, stores them)"


def _raise_nonfinite_at(shape: tuple[int, ...], dtype: str, count: int, first: int, value: float) -> None:
    raise NonFiniteError(
        f"{count} non-finite value(s) in a {tuple(shape)} {dtype} tensor; "
        f"the first is {value} at index {frame.element_index(first, shape)}{KEEP_HINT}"
    )


class Fp8Codec:
    """Encode tensors to fp8 frames with one fixed configuration.

    Takes the options of :class:`~fp8ray.codec.options.CodecOptions` (``fp8``,
    ``scaling``, ``block_size``, ``nonfinite``, ``scale_dtype``, ``scale_choice``), or
    ``options=`` a ready one. Options left out keep the default mode (e4m3fn, blocks of
    32, bfloat16 scales by least squared error, non-finite input refused); each one
    given overrides only itself. Bad values raise
    :class:`~fp8ray.errors.InvalidOptionError` (a ``ValueError``) naming the option.
    """

    def __init__(
        self,
        fp8=None,
        scaling: str | None = None,
        block_size: int | None = None,
        nonfinite: str | None = None,
        scale_dtype: str | None = None,
        scale_choice: str | None = None,
        *,
        options: CodecOptions | None = None,
    ):
        given = {
            "fp8": fp8,
            "scaling": scaling,
            "block_size": block_size,
            "nonfinite": nonfinite,
            "scale_dtype": scale_dtype,
            "scale_choice": scale_choice,
        }
        given = {name: value for name, value in given.items() if value is not None}
        self.options: CodecOptions = CodecOptions.parse(given, base=options)
        self.fmt: Fp8Format = self.options.fmt

    @property
    def scaling(self) -> str:
        return self.options.scaling

    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def scale_dtype(self) -> str:
        return self.options.scale_dtype

    @property
    def scale_choice(self) -> str:
        return self.options.scale_choice

    @property
    def nonfinite(self) -> str:
        return self.options.nonfinite

    def __eq__(self, other) -> bool:
        """Codecs of the same options are equal: they write the same frames (a codec is its options)."""
        return self.options == other.options if isinstance(other, Fp8Codec) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.options)

    def __repr__(self) -> str:
        o = self.options
        return (
            f"Fp8Codec(fp8={o.fp8!r}, scaling={o.scaling!r}, block_size={o.block_size}, scale_dtype={o.scale_dtype!r}, "
            f"scale_choice={o.scale_choice!r}, nonfinite={o.nonfinite!r})"
        )

    def _header(self, shape, dtype: str) -> frame.FrameHeader:
        shape = frame.dimensions(shape)
        frame.check_shape(shape, dtype)  # what the decoder would refuse is never written
        return frame.header_for(self.options, dtype, shape)

    def encoded_size(self, shape, dtype) -> int:
        """Exact size in bytes of the frame of a ``shape`` tensor of ``dtype`` (a torch
        dtype or its name, ``"bfloat16"``, or a numpy dtype)."""
        return self._header(shape, dtype_name(dtype)).frame_size

    def encode(self, tensor, out: np.ndarray | None = None, *, threads: int | None = None) -> memoryview:
        """Encode a tensor of any rank (0-d and empty included), contiguous or not.

        Returns a read-write ``memoryview`` over one freshly allocated buffer holding the
        whole frame (``bytes(frame)`` copies it; ``np.frombuffer(frame, np.uint8)`` does not),
        or over ``out``, a writable 1-D uint8 array of exactly :meth:`encoded_size` bytes
        (to lay many frames end to end in one buffer; for CUDA tensors, pinned memory
        reused from call to call is the fast way: :func:`fp8ray.codec.devices.host_buffer`).
        ``threads``: how many threads the CPU kernels (for a CUDA tensor, the checksum) may
        use for this call (default ``FP8RAY_NUM_THREADS``, else every CPU this process may use).

        A tensor of a dtype fp8 does not encode (integers, booleans, float64, complex64,
        fp8: :data:`~fp8ray.codec.names.STORED_DTYPE_CODES`) makes a stored frame: its
        bytes as they are, which decode gives back bit for bit; float64 warns, as it is
        more likely a cache to cast to float32 first than a tensor to keep at 8 bytes each.
        """
        if is_array(tensor):  # by its bytes, as a file's: no torch
            array = source_array(tensor)
            if array.dtype == np.float64:
                warnings.warn(FLOAT64_STORED, stacklevel=2)
            return self.encode_raw(array.reshape(-1).view(np.uint8), array.dtype, array.shape, out, threads=threads)
        x = source_tensor(tensor)
        header = self._header(x.shape, dtype_name(x.dtype))
        buf = _byte_buffer(out, header.frame_size)
        if header.stored:
            frame.store_into(buf, header, _apart(buf, cpu.tensor_to_bytes(x.detach().cpu()), out))
        elif x.device.type == "cpu":
            self._encode_host(_apart(buf, cpu.kernel_array(x.resolve_neg().contiguous()), out), header, buf, threads)
        else:
            self._encode_on_device(x, header, buf, threads)
        return memoryview(buf)

    def encode_raw(self, data: np.ndarray, dtype: str, shape, out: np.ndarray | None = None, *, threads: int | None = None):
        """:meth:`encode` of a tensor given as its raw little-endian bytes (``data``: a 1-D
        uint8 array), its dtype's name (``"bfloat16"``, ``"float16"``, ``"float32"``, or a
        stored dtype's: ``"int64"``...; no float64 warning: a file's tensors are as they
        are) and its shape: the same frame, on the CPU, without torch (``fp8ray compress`` reads
        files as bytes, and loading torch takes it about a second)."""
        dtype = dtype_name(dtype)
        header = self._header(shape, dtype)
        if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1):
            got = f"a {data.ndim}-D {data.dtype} array" if isinstance(data, np.ndarray) else type(data).__name__
            raise TypeError(f"data must be a 1-D uint8 array, got {got}")
        nbytes = header.tensor_nbytes
        if data.size != nbytes:
            raise BadInputError(f"data holds {data.size} bytes, a {list(header.shape)} {dtype} tensor has {nbytes}")
        buf = _byte_buffer(out, header.frame_size)
        _apart(buf, data, out)
        if header.stored:
            frame.store_into(buf, header, data)
        else:
            x = np.ascontiguousarray(data).view(KERNEL_TYPES[dtype]).reshape(header.shape)
            self._encode_host(x, header, buf, threads)
        return memoryview(buf)

    def _encode_host(self, x: np.ndarray, header: frame.FrameHeader, buf: np.ndarray, threads: int | None) -> None:
        """The frame of ``x`` (the elements as the kernels take them) into ``buf``, by the CPU kernels."""
        frame.write_header(buf, header)
        stored = buf[header.scales_offset : header.codes_offset]
        # The kernels write fp32 scales: into the frame itself for float32 scales, else
        # into a small array whose values (already bfloat16 ones) are then narrowed.
        bf16 = header.scale_dtype == "bfloat16"
        scales = np.empty(header.num_scales, np.float32) if bf16 else stored.view(np.float32)
        codes = frame.codes_of(buf, header)
        options = (self.fmt, self.scaling, self.block_size, codes, scales, self.scale_dtype, self.scale_choice)
        nonfinite, codes_crc = cpu.quantize_checksummed(x, *options, threads)
        if bf16:  # as _scale_bytes does on a GPU; numpy here: a torch call costs small blocks more
            stored.view("<u2")[:] = scales.view(np.uint32) >> 16  # exact: the low 16 bits are zero
        if nonfinite and self.nonfinite == "error":
            _raise_nonfinite(x, header.dtype, nonfinite)
        frame.seal(buf, (header.codes_offset, codes_crc))

    def _encode_on_device(self, x, header: frame.FrameHeader, buf: np.ndarray, threads: int | None) -> None:
        """The frame of a tensor on a GPU into ``buf``, by the torch ops of the reference."""
        import torch

        from . import cuda_search, reference

        frame.write_header(buf, header)
        lanes = cuda_search.lanes_for(x.device) if self.scale_choice == "mse" else reference.error_lanes
        ref_codes, ref_scales, nonfinite = reference.quantize(
            x, self.fmt, self.scaling, self.block_size, self.nonfinite == "keep", self.scale_dtype, self.scale_choice, lanes
        )
        # Straight from the GPU into the frame, the scales narrowed there: no host copy in between.
        codes = frame.codes_of(buf, header)
        torch.from_numpy(codes).copy_(ref_codes)
        torch.from_numpy(buf[header.scales_offset : header.codes_offset]).copy_(_scale_bytes(ref_scales, header.scale_dtype))
        if nonfinite and self.nonfinite == "error":
            raise_nonfinite(x, nonfinite)
        frame.seal(buf, (header.codes_offset, cpu.crc32c(codes, threads)))

    def decode(self, data, *, out=None, device=None, threads: int | None = None):
        """Decode a frame; the same as :func:`fp8ray.decode` (frames describe themselves)."""
        return decode(data, out=out, device=device, threads=threads)


def decode(data, *, out=None, device=None, threads: int | None = None):
    """Decode any fp8ray frame to a tensor of its original dtype and shape.

    Args:
        data: the frame, any bytes-like object (bytes, memoryview, uint8 numpy array or
            CPU tensor). Its lengths and scales are checked first; its checksum on
            CPU as the codes are decoded (each thread takes the CRC of the codes it has
            just read), elsewhere first.
        out: optional tensor of the frame's shape and dtype to decode into; if the frame
            fails its checksum, ``out`` may have been written before the error is raised.
        device: where to decode (default CPU, or ``out``'s device); on CUDA the codes
            travel to the GPU and are decoded there.
        threads: how many threads the CPU kernels may use (as for :meth:`Fp8Codec.encode`).

    Raises:
        CorruptFrameError: the frame is truncated, malformed or fails its checksum, or a
            finite code of it decodes to an infinity (a scale too large for its codes).
    """
    import torch

    buf, header, scales, codes = _opened(data)
    dtype = header.torch_dtype
    asked = _decode_device(device)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != header.shape or out.dtype != dtype:
            _refuse(buf, header, f"out is a {tuple(out.shape)} {out.dtype} tensor", "out")
        if not _elements_apart(out):
            raise BadInputError(
                f"out's strides {out.stride()} let elements of its shape {tuple(out.shape)} share memory "
                "(an expanded or as_strided view): each element needs memory of its own",
                field="out",
            )
        if out.requires_grad:
            raise BadInputError(
                "out requires grad: decode writes it in place, outside autograd; give out.detach() or a tensor without grad",
                field="out",
            )
        if asked is not None and asked != out.device:
            raise MismatchError(f"out is on {out.device} but device={device!r} was asked for", field="device")
        target = _decode_device(out.device)
    else:
        target = asked if asked is not None else torch.device("cpu")
    if target.type == "cuda" and not torch.cuda.is_available():  # torch's own error is an AssertionError
        raise InvalidOptionError(f"device {str(target)!r} was asked for, but torch sees no CUDA device", field="device")
    if header.stored:
        host = torch.empty(header.shape, dtype=dtype)
        _copy_stored(buf, header, codes, cpu.tensor_to_bytes(host), threads)
        result = host if target.type == "cpu" else host.to(target)
    elif target.type == "cpu":
        # A negative view (out.is_neg()) holds its values' negatives: decoded apart, then copied in.
        direct = out is not None and out.is_contiguous() and not out.is_neg()
        result = out if direct else torch.empty(header.shape, dtype=dtype)
        elements = cpu.kernel_array(result)
        _apart(elements, buf, out if result is out else None, "the frame being decoded", "a tensor")
        _decode_host(buf, header, scales, codes, elements, threads)
    else:
        from . import reference
        from .devices import host_tensor

        frame.verify(buf, header, cpu.crc32c(codes, threads))
        result = reference.dequantize(
            host_tensor(codes).to(target),
            host_tensor(scales).to(target),
            header.fmt,
            header.scaling,
            header.shape,
            dtype,
            header.block_size,
        )
        if frame.may_overflow(header, scales):  # checked on the CPU: only such rare frames travel back
            frame.refuse_overflow(header, scales, codes, cpu.kernel_array(result.cpu()))
    if out is not None and result is not out:
        copy_into(out, result)
        return out
    return result


def copy_into(out, result) -> None:
    """``out.copy_(result)``, also where ``out`` was made under ``torch.inference_mode()``
    (torch refuses writing one in place outside it; the direct path writes it as memory)."""
    import torch

    with torch.inference_mode(out.is_inference()):
        out.copy_(result)


def _elements_apart(t) -> bool:
    """Whether no two elements of ``t`` share memory, as far as its strides show: ordered
    by stride, each dimension of more than one element steps past the whole span of the
    ones before it (every layout torch makes without ``as_strided`` or ``expand``)."""
    if t.numel() == 0:
        return True
    span = 1
    for stride, size in sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride < span:
            return False
        span = stride * size
    return True


def _decode_device(device):
    """``device`` (a name or a ``torch.device``; None: not given) as a ``torch.device``
    decode runs on: the CPU or a CUDA device (a meta tensor would hold no data)."""
    import torch

    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidOptionError(
            f"device {device!r} is not a torch device; expected 'cpu', 'cuda' or 'cuda:N'", field="device"
        ) from None
    if target.type not in ("cpu", "cuda"):
        raise InvalidOptionError(f"decode runs on the CPU or a CUDA device, not {str(target)!r}", field="device")
    return target


def decode_raw(data, dtype: str, shape, out: np.ndarray | None = None, *, threads: int | None = None) -> np.ndarray:
    """:func:`decode` of a frame that holds a ``shape`` tensor of ``dtype`` (by name), to
    that tensor's raw little-endian bytes: a 1-D uint8 array, ``out`` where given (a
    writable contiguous one of exactly those bytes). On the CPU kernels, without torch,
    the mirror of :meth:`Fp8Codec.encode_raw` (``fp8ray decompress`` writes bytes to
    files). A frame holding another dtype or shape raises :class:`MismatchError`, one
    that is damaged :class:`CorruptFrameError`."""
    dtype, shape = dtype_name(dtype), frame.dimensions(shape)
    buf, header, scales, codes = _opened(data)
    if (header.dtype, header.shape) != (dtype, shape):
        _refuse(buf, header, f"expected a {shape} {dtype} tensor", "shape" if header.dtype == dtype else "dtype")
    given, out = out, _byte_buffer(out, header.tensor_nbytes)
    _apart(out, buf, given, "the frame being decoded")
    if header.stored:
        _copy_stored(buf, header, codes, out, threads)
    else:
        _decode_host(buf, header, scales, codes, out.view(KERNEL_TYPES[dtype]).reshape(shape), threads)
    return out


def _opened(data) -> tuple[np.ndarray, frame.FrameHeader, np.ndarray, np.ndarray]:
    """A frame's bytes, header, fp32 scales and codes, its layout and scales checked (the
    checksum is verified with the codes' CRC, as they are decoded)."""
    buf = frame.as_byte_array(data)
    header = frame.parse_layout(buf)
    try:
        scales = frame.scales_of(buf, header)
    except CorruptFrameError:
        frame.verify(buf, header)  # a damaged frame is reported as such
        raise
    return buf, header, scales, frame.codes_of(buf, header)


def _refuse(buf: np.ndarray, header: frame.FrameHeader, asked: str, field: str) -> None:
    """Raise :class:`MismatchError` naming ``field``: the frame holds another tensor than ``asked`` says."""
    frame.verify(buf, header)  # a damaged dtype or shape is reported as damage, not as a mismatch
    raise MismatchError(f"{asked}, the frame holds {header.shape} {header.dtype}", field=field)


def _decode_host(buf, header: frame.FrameHeader, scales, codes, target: np.ndarray, threads: int | None) -> None:
    """Decode into ``target`` (the elements as the kernels write them) on the CPU kernels,
    the frame's checksum verified with the CRC of the codes they read."""
    layout = (header.fmt, header.scaling, header.shape, header.block_size)
    frame.verify(buf, header, cpu.dequantize_checksummed(codes, scales, *layout, target, threads))
    frame.refuse_overflow(header, scales, codes, target)


def _copy_stored(buf, header: frame.FrameHeader, stored: np.ndarray, target: np.ndarray, threads: int | None) -> None:
    """A stored frame's bytes (``stored``) into ``target`` (a uint8 array of as many), its
    checksum verified first."""
    frame.verify(buf, header, cpu.crc32c(stored, threads))
    target[:] = stored


def _scale_bytes(scales, scale_dtype: str):
    """fp32 ``scales`` (a tensor of values of ``scale_dtype``) as the frame stores them,
    little-endian bytes on their own device: bfloat16 ones are fp32's top half (the low
    bits are zero)."""
    import torch

    if scale_dtype == "bfloat16":
        scales = (scales.view(torch.int32) >> 16).to(torch.int16)
    return scales.view(torch.uint8)


def encoded_size(shape, dtype, **options) -> int:
    """Exact frame size for a tensor of ``shape`` and ``dtype`` under these codec options
    (those of :class:`~fp8ray.codec.options.CodecOptions`; the default mode if none)."""
    return Fp8Codec(**options).encoded_size(shape, dtype)
