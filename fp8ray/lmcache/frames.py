"""fp8ray's frame serde for LMCache: its scaled, self-describing, checksummed frame
(docs/FORMAT.md), one per tensor, written one after the other.

The estimate is exactly what ``serialize`` writes (``serialize`` also narrows ``dst`` to
it with ``dst.set_used_size(n)`` where the object has that method); ``deserialize``
verifies each frame (checksum, length, dtype and shape against ``dst``) and raises on any
mismatch, so LMCache's task fails (a cache miss) instead of handing back a wrong tensor.
Any KV shape is taken: ``[2, L, T, H]``, vLLM's blocks-first fused ``[1, L, T, 2H]``, or
K and V as separate objects of a group (a tuple, as LMCache's
``MultiSerializer``/``MultiDeserializer`` pass them; :class:`Fp8FrameMultiSerializer` /
:class:`Fp8FrameMultiDeserializer` fix the group's size). A source that is already one
byte per element (vLLM's ``fp8`` KV cache, as uint8 or a float8 dtype) is refused with an
error naming its dtype, unless ``fp8_input="passthrough"`` asks to store its bytes as
they are.

CPU tensors go through fp8ray's numba kernels; CUDA tensors through the torch ops the
kernels equal bit for bit, with the frame bytes staged in host memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..codec import frame
from ..codec.blocks import decode_frames_into, encode_tensors_into
from ..codec.formats import DTYPE_NAMES, DTYPES
from ..codec.fp8codec import Fp8Codec, copy_into
from ..codec.options import CodecOptions
from ..errors import BadInputError, CorruptFrameError, InvalidOptionError, MismatchError, block_error
from .objects import Shape, byte_view, check_dense, check_dtype, check_group, is_group, kv_tensors, layout_pairs, one_byte

FP8_INPUT_POLICIES = ("refuse", "passthrough")  # what the frame pair does with 1-byte sources

# The header of the frame a prefix of bytes starts with, or None (the codec's parser,
# under the name this package has always exported). Its ``dtype`` is the source dtype's
# name ("bfloat16"); ``torch_dtype`` is torch's.
read_frame_header = frame.parse_header


def check_fp8_input(fp8_input: str) -> None:
    """Refuse an ``fp8_input`` policy that is not one of :data:`FP8_INPUT_POLICIES`."""
    if fp8_input not in FP8_INPUT_POLICIES:
        raise InvalidOptionError(f"fp8_input must be one of {list(FP8_INPUT_POLICIES)}, got {fp8_input!r}", field="fp8_input")


class _FramePair:
    def __init__(self, options: CodecOptions | None = None, fp8_input: str = "refuse", group_size: int | None = None):
        check_fp8_input(fp8_input)
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
            raise InvalidOptionError(f"group_size must be a positive integer or None, got {group_size!r}", field="group_size")
        self.codec = Fp8Codec(options=options or CodecOptions())
        self.fp8_input = fp8_input
        self._group_size = group_size

    @property
    def options(self) -> CodecOptions:
        return self.codec.options

    @property
    def group_size(self) -> int | None:
        """The number of objects a group must hold; ``None``: single objects and groups of any size."""
        return self._group_size

    def _size(self, shape, dtype: torch.dtype) -> int:
        """The bytes one tensor takes: its frame, or its own bytes when it is 1-byte (or
        of a dtype the codec does not encode, which serialize refuses)."""
        if one_byte(dtype) or dtype not in DTYPES:  # never an estimate error: LMCache calls it outside any try
            return math.prod(int(d) for d in shape)
        return self.codec.encoded_size(shape, dtype)

    def _one_object(self) -> None:
        """Refuse a single object where the serde takes only groups."""
        if self._group_size is not None:
            raise BadInputError(f"this serde takes groups of {self._group_size} objects, got one object")


class Fp8FrameSerializer(_FramePair):
    """Encode a KV object (or a group of them) as fp8ray frames, one per tensor, into a
    byte buffer.

    Takes :class:`~fp8ray.codec.options.CodecOptions` (default: the default mode), and
    ``fp8_input``: ``"refuse"`` (default) fails on a source that is already one byte per
    element (uint8 or a float8 dtype, as vLLM's ``fp8`` KV cache), naming its dtype;
    ``"passthrough"`` stores such a tensor's bytes as they are, unframed and unchecked.
    ``group_size``: None takes single objects and groups of any size; a number (see
    :class:`Fp8FrameMultiSerializer`) takes only groups of that size.
    """

    def frame_sizes(self, layout_desc) -> list[int]:
        """The exact size of each tensor's frame for an object (or a group) of this layout."""
        if not is_group(layout_desc):
            if self._group_size is not None:
                raise BadInputError(f"this serde takes groups of {self._group_size} layouts, got one layout")
            return [self._size(shape, dtype) for shape, dtype in layout_pairs(layout_desc)]
        check_group(layout_desc, self._group_size, "layout")
        sizes = []
        for i, member in enumerate(layout_desc):
            if member is None:
                raise BadInputError(f"slot {i} of the layout group is None: the fp8ray frame serde stores every slot")
            sizes += [self._size(shape, dtype) for shape, dtype in layout_pairs(member)]
        return sizes

    def estimate_serialized_size(self, layout_desc) -> int:
        """Exactly the bytes :meth:`serialize` writes for an object of this layout (the
        sum of its tensors' frame sizes): LMCache's adapters store the buffer sized by
        this estimate, so any margin would be stored too. A group of layouts (one per
        slot) gives the sum over its slots."""
        return sum(self.frame_sizes(layout_desc))

    def serialized_size(self, layout: Sequence[tuple[Shape, torch.dtype]]) -> int:
        """The bytes :meth:`serialize_tensors` writes for tensors of these ``(shape, dtype)``."""
        return sum(self._size(shape, dtype) for shape, dtype in layout)

    def _source_tensors(self, src) -> list[torch.Tensor]:
        if not is_group(src):
            self._one_object()
            return kv_tensors(src)
        check_group(src, self._group_size, "src")
        tensors = []
        for i, member in enumerate(src):
            if member is None:
                raise BadInputError(f"slot {i} of the src group is None: the fp8ray frame serde stores every slot")
            tensors += kv_tensors(member)
        return tensors

    def _check_source(self, tensors: Sequence[torch.Tensor]) -> None:
        for i, t in enumerate(tensors):
            check_dense(t, "src")
            if one_byte(t.dtype):
                if self.fp8_input == "passthrough":
                    continue
                which = f"src tensor {i + 1} of {len(tensors)}" if len(tensors) > 1 else "src tensor"
                raise BadInputError(
                    f"{which} is {t.dtype} {list(t.shape)}: already one byte per element (vLLM's fp8 KV cache?); "
                    f"the fp8ray serde encodes bfloat16, float16 or float32, and stores nothing for this object. "
                    f'Set the serde option "fp8_input": "passthrough" to store its bytes as they are',
                    field="fp8_input",
                )
            check_dtype(t)

    def serialize(self, src, dst, key=None) -> int:
        """Write one frame per tensor of ``src`` (an object, or a group of objects slot
        by slot), one after the other, to the start of ``dst.tensor``; narrow ``dst`` to
        them (``dst.set_used_size``, where it has it) and return the bytes written.
        ``key`` is ignored."""
        total = self.serialize_tensors(self._source_tensors(src), getattr(dst, "tensor", None))
        set_used_size = getattr(dst, "set_used_size", None)
        if callable(set_used_size):
            set_used_size(total)
        return total

    def serialize_tensors(self, tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> int:
        """Write one frame per tensor, one after the other, to the start of ``buffer`` (a
        contiguous tensor of 1-byte elements, on any device); returns the bytes written."""
        self._check_source(tensors)
        target = byte_view(buffer, "dst")
        sizes = [self._size(t.shape, t.dtype) for t in tensors]
        total = sum(sizes)
        if target.numel() < total:
            raise BadInputError(f"dst holds {target.numel()} bytes but the frames of src need {total}")
        # The frames are written in place on the CPU; a CUDA buffer gets them from a
        # host copy (the codec's CUDA path computes on the GPU, then copies to the host).
        host = target[:total].numpy() if target.device.type == "cpu" else np.empty(total, dtype=np.uint8)
        named = [
            (f"src tensor {i + 1} of {len(tensors)}" if len(tensors) > 1 else "src tensor", t) for i, t in enumerate(tensors)
        ]
        if not any(one_byte(t.dtype) for t in tensors):
            encode_tensors_into(self.codec, named, host, sizes)
        else:  # passthrough tensors (refused above otherwise) keep their bytes, between frames
            offset = 0
            for (name, t), size in zip(named, sizes):
                piece = host[offset : offset + size]
                if one_byte(t.dtype):
                    piece[:] = t.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
                else:
                    encode_tensors_into(self.codec, [(name, t)], piece, [size])
                offset += size
        if target.device.type != "cpu":
            copy_into(target[:total], torch.from_numpy(host))
        return total


class Fp8FrameDeserializer(_FramePair):
    """Decode fp8ray frames straight into a KV object's tensors (or a group's), checking each.

    The frames describe themselves (format, scaling, scales); the options given are
    used only to know each frame's length, so they must be the serializer's (LMCache
    sizes the buffer it loads by the same estimate). ``fp8_input`` and ``group_size``
    must be the serializer's too: with ``"passthrough"``, a 1-byte destination tensor
    gets its bytes copied back as they were stored.
    """

    def _destination_tensors(self, dst) -> list[torch.Tensor | None]:
        """``dst``'s tensors in order; for a group, one ``None`` for each slot left out (of one or more frames)."""
        if not is_group(dst):
            self._one_object()
            return list(kv_tensors(dst))
        check_group(dst, self._group_size, "dst")
        tensors: list[torch.Tensor | None] = []
        for member in dst:
            tensors += [None] if member is None else kv_tensors(member)
        return tensors

    def deserialize(self, src, dst, key=None) -> None:
        """Decode the frames at the start of ``src.tensor`` into ``dst``'s tensors.

        ``dst`` may be a group of objects (LMCache's ``MultiDeserializer``): a ``None``
        slot is left untouched and its frames skipped (:meth:`_placements`). Raises
        :class:`~fp8ray.errors.CorruptFrameError` for a corrupt or truncated frame and
        :class:`~fp8ray.errors.MismatchError` when a frame holds another dtype or shape
        than its tensor, before anything is written; a frame that fails its checksum
        raises after its tensor may have been written (the CRC is taken as the codes are
        decoded, :func:`fp8ray.decode`). ``key`` is ignored.
        """
        self.deserialize_tensors(getattr(src, "tensor", None), self._destination_tensors(dst))

    def deserialize_tensors(self, buffer: torch.Tensor, tensors: Sequence[torch.Tensor | None]) -> None:
        """Decode the frames at the start of ``buffer`` (a contiguous tensor of 1-byte
        elements, on any device) into ``tensors`` in turn; a ``None`` skips a slot's
        frames (:meth:`_placements`)."""
        src_bytes = byte_view(buffer, "src")
        if src_bytes.device.type != "cpu":  # frames are parsed and checked on the host
            src_bytes = src_bytes.cpu()
        data = src_bytes.numpy()
        to_decode: list[tuple[str, np.ndarray, torch.Tensor]] = []  # every frame is checked for room first
        passed: list[tuple[np.ndarray, torch.Tensor]] = []
        for i, offset, t in self._placements(data, tensors):
            where = f"frame {i + 1} of {len(tensors)}" if len(tensors) > 1 else "frame"
            size = self._size(t.shape, t.dtype)
            if not one_byte(t.dtype):
                self._check_written_alike(data, offset, t, size, where)
            if offset + size > data.size:
                raise CorruptFrameError(
                    f"{where} truncated: src holds {data.size - offset} bytes from offset {offset}, "
                    f"a {tuple(t.shape)} {t.dtype} tensor's frame has {size}"
                )
            chunk = data[offset : offset + size]
            if one_byte(t.dtype):  # passthrough: the bytes as they were stored, once every frame checks
                stored = frame.parse_header(chunk[: frame.MAX_HEADER_BYTES])
                if stored is not None:  # a store written from a bf16 cache, read by an fp8 one
                    raise MismatchError(
                        f"{where}: dst tensor is {t.dtype}, for fp8 bytes stored as they are, but src holds the "
                        f"fp8ray frame of a {stored.dtype} tensor there"
                    )
                passed.append((chunk, t))
            else:
                to_decode.append((where, chunk, t))
        for chunk, t in passed:
            copy_into(t, torch.from_numpy(chunk.copy()).view(t.dtype).reshape(t.shape).to(t.device))
        decode_frames_into([(where, chunk) for where, chunk, _ in to_decode], [t for *_, t in to_decode])

    def _placements(self, data: np.ndarray, tensors: Sequence[torch.Tensor | None]) -> list[tuple[int, int, torch.Tensor]]:
        """``(index, offset, tensor)`` of each wanted tensor, its dtype checked. In order
        from the start; past a skipped slot (``None``), whose tensors are unknown (a slot
        may hold several), the wanted run that follows goes where its frames (by their
        headers) or its passthrough bytes fit: after some whole number of the frames
        there, or (the last run) at the end of ``src``. Where that is more than one place
        and the end does not decide, or none, the read is refused: never another slot's
        tensor of the same shape."""
        for i, t in enumerate(tensors):
            if t is not None:
                self._check_destination(t, f"frame {i + 1} of {len(tensors)}" if len(tensors) > 1 else "frame")
        placed: list[tuple[int, int, torch.Tensor]] = []
        offset, i = 0, 0
        while i < len(tensors):
            t = tensors[i]
            if t is None:
                start = i
                while i < len(tensors) and tensors[i] is None:
                    i += 1
                end = i
                while end < len(tensors) and tensors[end] is not None:
                    end += 1
                if i == len(tensors):  # nothing wanted after: the rest is left unread
                    break
                offset = self._run_start(data, offset, i - start, tensors[i:end], end == len(tensors), i)
                continue
            placed.append((i, offset, t))
            offset += self._size(t.shape, t.dtype)
            i += 1
        return placed

    def _run_start(self, data: np.ndarray, offset: int, skipped: int, run: Sequence[torch.Tensor], last: bool, index: int) -> int:
        """Where the wanted ``run`` starts, past ``skipped`` slots from ``offset`` (see
        :meth:`_placements`); ``index``: the run's first tensor's, for the messages."""
        where = f"frame {index + 1}"
        sizes = [self._size(t.shape, t.dtype) for t in run]
        places, p, frames = [], offset, 0
        while p < data.size:  # each place after a whole frame, at least one per skipped slot
            header = frame.parse_header(data[p : p + frame.MAX_HEADER_BYTES])
            if header is None:
                break
            p, frames = p + header.frame_size, frames + 1
            if frames >= skipped and self._run_fits(data, p, run, sizes):
                places.append(p)
        at_end = data.size - sum(sizes)
        if last and at_end > offset and at_end not in places and self._run_fits(data, at_end, run, sizes):
            places.append(at_end)  # past a skipped slot of passthrough bytes, which have no header
        if len(places) > 1 and last and at_end in places:
            places = [at_end]  # a group's frames end where src does: src is taken to be what serialize wrote
        if len(places) != 1:
            found = "no place in src fits" if not places else f"{len(places)} places (offsets {places[:4]}) in src fit"
            raise MismatchError(
                f"{where} (the first wanted after a skipped slot): {found} the wanted tensors' frames, "
                "so which bytes are theirs cannot be told; the read is refused rather than risk another slot's tensor"
            )
        return places[0]

    def _run_fits(self, data: np.ndarray, p: int, run: Sequence[torch.Tensor], sizes: list[int]) -> bool:
        """Whether the frames of ``run`` (of ``sizes``) lie at ``p`` by their headers: each
        one's dtype, shape and size; a passthrough tensor's bytes within ``src`` and not a frame."""
        for t, size in zip(run, sizes):
            if p + size > data.size:
                return False
            header = frame.parse_header(data[p : p + frame.MAX_HEADER_BYTES])
            if one_byte(t.dtype):
                if header is not None:
                    return False
            elif header is None or (header.dtype, tuple(header.shape), header.frame_size) != (
                DTYPE_NAMES.get(t.dtype),
                tuple(t.shape),
                size,
            ):
                return False
            p += size
        return True

    def _check_destination(self, t: torch.Tensor, where: str) -> None:
        """Refuse a destination tensor of a dtype this serde does not decode into."""
        if one_byte(t.dtype) and self.fp8_input != "passthrough":
            raise MismatchError(
                f"{where}: dst tensor is {t.dtype}, one byte per element; the fp8ray serde decodes into "
                f'bfloat16, float16 or float32 unless "fp8_input" is "passthrough"'
            )
        if not one_byte(t.dtype) and t.dtype not in DTYPES:  # as serialize refuses such a source
            raise MismatchError(f"{where}: dst tensor is {t.dtype}; the fp8ray serde decodes into bfloat16, float16 or float32")

    def _check_written_alike(self, data: np.ndarray, offset: int, t: torch.Tensor, size: int, where: str) -> None:
        """Refuse, before anything is written, a sound frame that holds another dtype or
        shape than ``t``, or was written under other codec options (its size then differs
        from the ``size`` these options give: read a store with the options it was written
        with), and a damaged one whose header is not this tensor's (no frame there, a
        damaged dtype or shape: reported as damage, not as a mismatch). A frame whose header
        is right has the rest of its checksum taken by the decoder, as it decodes."""
        this = (DTYPE_NAMES.get(t.dtype), tuple(t.shape))
        try:
            header = frame.parse_header(data[offset : offset + frame.MAX_HEADER_BYTES])
            same_tensor = header is not None and (header.dtype, tuple(header.shape)) == this
            if same_tensor and header.frame_size == size:
                return
            # A longer frame than these options make, cut to their size (LMCache reads as many bytes
            # as this serde's estimate): its checksum cannot be taken, its header names its options.
            cut = same_tensor and offset + header.frame_size > data.size
            if not cut:
                frame.parse(data[offset : offset + (header.frame_size if header is not None else size)])  # raises if damaged
        except CorruptFrameError as exc:
            raise block_error(where, exc) from None
        if not same_tensor:
            dst = f"{tuple(t.shape)} {t.dtype}"
            raise MismatchError(f"{where}: dst is a {dst} tensor, the frame holds {header.shape} {header.dtype}")
        raise MismatchError(
            f"{where} was written with {frame.layout_label(header)}; "
            f"this deserializer's options are {self.options.label()}: read a store with the serde options it was written with"
            + (f" (src holds {data.size - offset} of its {header.frame_size} bytes)" if cut else "")
        )


class Fp8FrameMultiSerializer(Fp8FrameSerializer):
    """:class:`Fp8FrameSerializer` for groups of exactly ``group_size`` objects (default
    2: slot 0 = K, slot 1 = V, each an LMCache ``MemoryObj``), the shape of LMCache's
    ``MultiSerializer``: every slot is required; the frames of slot 0's tensors come
    first, then slot 1's."""

    def __init__(self, options: CodecOptions | None = None, fp8_input: str = "refuse", group_size: int = 2):
        super().__init__(options, fp8_input, group_size)


class Fp8FrameMultiDeserializer(Fp8FrameDeserializer):
    """:class:`Fp8FrameDeserializer` for groups of exactly ``group_size`` destination
    objects (LMCache's ``MultiDeserializer``): a ``None`` slot is left untouched, its
    frames skipped (a slot may hold several: see :meth:`Fp8FrameDeserializer._placements`)."""

    def __init__(self, options: CodecOptions | None = None, fp8_input: str = "refuse", group_size: int = 2):
        super().__init__(options, fp8_input, group_size)
