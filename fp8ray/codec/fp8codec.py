"""``Fp8Codec``: encode a bf16/fp16/fp32 tensor into a checked fp8 frame, and back.

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

import numpy as np
import torch

from ..errors import BadInputError, BlockError, CorruptFrameError, MismatchError, NonFiniteError
from . import cpu, cuda_search, frame, reference
from .devices import host_tensor
from .formats import DTYPE_NAMES, DTYPES, Fp8Format
from .options import DEFAULT_OPTIONS, CodecOptions

DEFAULT_BLOCK_SIZE = DEFAULT_OPTIONS.block_size


def _check_tensor(tensor) -> torch.Tensor:
    if isinstance(tensor, np.ndarray):
        if tensor.dtype not in (np.float16, np.float32):
            raise TypeError(f"unsupported array dtype {tensor.dtype}; expected float16 or float32 (or a bfloat16 tensor)")
        tensor = torch.from_numpy(np.ascontiguousarray(tensor))
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy array, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
        raise TypeError(f"unsupported dtype {tensor.dtype}; expected one of {sorted(DTYPE_NAMES.values())}")
    if tensor.device.type == "meta":
        raise BlockError("cannot encode a meta tensor: it has no data")
    return tensor


def _raise_nonfinite(x: torch.Tensor, count: int) -> None:
    flat = x.reshape(-1)
    first = int(torch.nonzero(~torch.isfinite(flat))[0, 0])
    index = tuple(int(i) for i in np.unravel_index(first, tuple(x.shape))) if x.dim() else ()
    value = float(flat[first])
    raise NonFiniteError(
        f"{count} non-finite value(s) in a {tuple(x.shape)} {DTYPE_NAMES[x.dtype]} tensor; "
        f"the first is {value} at index {list(index)} (nonfinite='keep', or --nonfinite keep, stores them)"
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
        fp8: str | torch.dtype | None = None,
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
        self.options: CodecOptions = CodecOptions.parse(given, base=options) if given or options is None else options
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

    def __repr__(self) -> str:
        o = self.options
        return (
            f"Fp8Codec(fp8={o.fp8!r}, scaling={o.scaling!r}, block_size={o.block_size}, scale_dtype={o.scale_dtype!r}, "
            f"scale_choice={o.scale_choice!r}, nonfinite={o.nonfinite!r})"
        )

    def _header(self, shape, dtype: torch.dtype) -> frame.FrameHeader:
        shape = tuple(int(d) for d in shape)
        frame.check_shape(shape)  # what the decoder would refuse is never written
        scale_dtype = frame.stored_scale_dtype(self.scaling, self.scale_dtype)
        return frame.FrameHeader(self.fmt, self.scaling, dtype, shape, self.block_size, scale_dtype)

    def encoded_size(self, shape, dtype: torch.dtype) -> int:
        """Exact size in bytes of the frame of a ``shape`` tensor of ``dtype``."""
        if dtype not in DTYPES:
            raise TypeError(f"unsupported dtype {dtype}; expected one of {sorted(DTYPE_NAMES.values())}")
        return self._header(shape, dtype).frame_size

    def encode(self, tensor, out: np.ndarray | None = None, *, threads: int | None = None) -> memoryview:
        """Encode a tensor of any rank (0-d and empty included), contiguous or not.

        Returns a read-write ``memoryview`` over one freshly allocated buffer holding the
        whole frame (``bytes(frame)`` copies it; ``np.frombuffer(frame, np.uint8)`` does not),
        or over ``out``, a writable 1-D uint8 array of exactly :meth:`encoded_size` bytes
        (to lay many frames end to end in one buffer; for CUDA tensors, pinned memory
        reused from call to call is the fast way: :func:`fp8ray.codec.devices.host_buffer`).
        ``threads``: how many threads the CPU kernels (for a CUDA tensor, the checksum) may
        use for this call (default ``FP8RAY_NUM_THREADS``, else every CPU this process may use).
        """
        x = _check_tensor(tensor)
        header = self._header(x.shape, x.dtype)
        if out is None:
            buf = np.empty(header.frame_size, dtype=np.uint8)
        elif not (
            isinstance(out, np.ndarray)
            and out.dtype == np.uint8
            and out.ndim == 1
            and out.size == header.frame_size
            and out.flags.writeable
            and out.flags.c_contiguous
        ):
            raise BadInputError(f"out must be a writable contiguous 1-D uint8 array of {header.frame_size} bytes", field="out")
        else:
            buf = out
        frame.write_header(buf, header)
        stored = buf[header.scales_offset : header.codes_offset]
        codes = frame.codes_of(buf, header)
        options = (self.scale_dtype, self.scale_choice)
        if x.device.type == "cpu":
            # The kernels write fp32 scales: into the frame itself for float32 scales, else
            # into a small array whose values (already bfloat16 ones) are then narrowed.
            bf16 = header.scale_dtype == "bfloat16"
            scales = np.empty(header.num_scales, np.float32) if bf16 else stored.view(np.float32)
            nonfinite, codes_crc = cpu.quantize_checksummed(
                x.contiguous(), self.fmt, self.scaling, self.block_size, codes, scales, *options, threads
            )
            if bf16:  # as _scale_bytes does on a GPU; numpy here: a torch call costs small blocks more
                stored.view("<u2")[:] = scales.view(np.uint32) >> 16  # exact: the low 16 bits are zero
        else:
            lanes = cuda_search.lanes_for(x.device) if self.scale_choice == "mse" else reference.error_lanes
            ref_codes, ref_scales, nonfinite = reference.quantize(
                x, self.fmt, self.scaling, self.block_size, self.nonfinite == "keep", *options, lanes
            )
            # Straight from the GPU into the frame, the scales narrowed there: no host copy in between.
            torch.from_numpy(codes).copy_(ref_codes)
            torch.from_numpy(stored).copy_(_scale_bytes(ref_scales, header.scale_dtype))
            codes_crc = cpu.crc32c(codes, threads)
        if nonfinite and self.nonfinite == "error":
            _raise_nonfinite(x, nonfinite)
        frame.seal(buf, None if codes_crc is None else (header.codes_offset, codes_crc))
        return memoryview(buf)

    def decode(self, data, *, out: torch.Tensor | None = None, device=None, threads: int | None = None) -> torch.Tensor:
        """Decode a frame; the same as :func:`fp8ray.decode` (frames describe themselves)."""
        return decode(data, out=out, device=device, threads=threads)


def decode(data, *, out: torch.Tensor | None = None, device=None, threads: int | None = None) -> torch.Tensor:
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
        CorruptFrameError: the frame is truncated, malformed or fails its checksum.
    """
    buf = frame.as_byte_array(data)
    header = frame.parse_layout(buf)  # the checksum is verified with the codes' CRC, below
    try:
        scales = frame.scales_of(buf, header)
    except CorruptFrameError:
        frame.verify(buf, header)  # a damaged frame is reported as such
        raise
    codes = frame.codes_of(buf, header)
    if out is not None:
        if tuple(out.shape) != header.shape or out.dtype != header.dtype:
            frame.verify(buf, header)  # a damaged dtype or shape is reported as damage, not as a mismatch
            raise MismatchError(
                f"out is a {tuple(out.shape)} {out.dtype} tensor, the frame holds {header.shape} {header.dtype}", field="out"
            )
        if device is not None and torch.device(device) != out.device:
            raise MismatchError(f"out is on {out.device} but device={device!r} was asked for", field="device")
        target = out.device
    else:
        target = torch.device(device) if device is not None else torch.device("cpu")
    if target.type == "cpu":
        result = out if out is not None and out.is_contiguous() else torch.empty(header.shape, dtype=header.dtype)
        codes_crc = cpu.dequantize_checksummed(
            codes, scales, header.fmt, header.scaling, header.shape, header.block_size, result, threads
        )
        frame.verify(buf, header, codes_crc)
    else:
        frame.verify(buf, header, cpu.crc32c(codes, threads))
        result = reference.dequantize(
            host_tensor(codes).to(target),
            host_tensor(scales).to(target),
            header.fmt,
            header.scaling,
            header.shape,
            header.dtype,
            header.block_size,
        )
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


def _scale_bytes(scales: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """fp32 ``scales`` (values of ``scale_dtype``) as the frame stores them, little-endian
    bytes on their own device: bfloat16 ones are fp32's top half (the low bits are zero)."""
    if scale_dtype == "bfloat16":
        scales = (scales.view(torch.int32) >> 16).to(torch.int16)
    return scales.view(torch.uint8)


def encoded_size(shape, dtype: torch.dtype, **options) -> int:
    """Exact frame size for a tensor of ``shape`` and ``dtype`` under these codec options
    (those of :class:`~fp8ray.codec.options.CodecOptions`; the default mode if none)."""
    return Fp8Codec(**options).encoded_size(shape, dtype)
