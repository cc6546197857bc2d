"""What a reader checks of a part without reading all of it (docs/FORMAT.md, "Manifest").

The part's CRC-32C covers the whole file, so reading one block cannot check it. A part's
entry (manifest and sidecar) therefore also records ``footer_crc32c``, the CRC-32C of
the Parquet footer (the file's last 8 + footer-length bytes), and ``columns_crc32c``, of
its metadata columns' values (:func:`columns_crc32c`). The footer is read and checked
here before pyarrow parses it: pyarrow's parser can abort the process on damaged bytes,
and a damaged footer can move a block under another key.

The part's CRC-32C cannot tell its frames apart, either: a frame ends with the CRC-32C
of what precedes it (a CRC codeword), and every codeword of one length moves a CRC's
state alike, so frames swapped between rows, or replaced by other valid frames of their
lengths, leave the part's CRC-32C as it was. ``frames_crc32c`` (:func:`frames_crc32c`)
is the CRC-32C of the frames' own CRCs in row order, which changes with both.

Parts written before these fields read without these checks.
"""

from __future__ import annotations

import json

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import CorruptArchiveError
from .columns import binary_buffers
from .records import Part

MAGIC = b"PAR1"
# One read takes the footer of most parts (pyarrow also reads a footer 64 KiB at a time).
TAIL_READ = 64 << 10


def footer_crc32c(data: pa.Buffer | bytes) -> int:
    """The CRC-32C of a whole Parquet file's footer, its length and its closing magic."""
    view = memoryview(data)
    length = int.from_bytes(view[-8:-4], "little")
    return crc32c.crc32c(view[-(length + 8) :])


def columns_crc32c(columns: dict[str, list]) -> int:
    """The CRC-32C of a part's metadata columns in canonical form: the values as Arrow
    gives them (``to_pylist``), as compact JSON with sorted column names and ASCII escapes."""
    return crc32c.crc32c(json.dumps(columns, sort_keys=True, separators=(",", ":")).encode("ascii"))


def frames_crc32c(frames: pa.Array | pa.ChunkedArray) -> int:
    """The CRC-32C of a part's frames' own CRC-32Cs (each frame's last 4 bytes, as stored),
    in row order. A frame shorter than 4 bytes (only a damaged one is) gives what it has."""
    crc = 0
    for chunk in frames.chunks if isinstance(frames, pa.ChunkedArray) else [frames]:
        data, offsets = binary_buffers(chunk)
        if not data.size:  # no frame has a byte: nothing to add
            continue
        ends = offsets[1:, None]
        index = ends + np.arange(-4, 0)
        held = index >= offsets[:-1, None]  # the bytes a frame has
        crc = crc32c.crc32c(data[np.where(held, index, 0)][held].tobytes(), crc)
    return crc


def check_frames(table: pa.Table, info: Part, shown: str) -> None:
    """Refuse a part whose frames are not those its entry's ``frames_crc32c`` (where
    recorded) was taken of: frames swapped between rows, or replaced by others."""
    if info.frames_crc32c is None or "frame" not in table.column_names:
        return
    crc = frames_crc32c(table.column("frame"))
    if crc != info.frames_crc32c:
        raise _damaged(
            info,
            shown,
            f"its frames are not the ones written in its rows (their own CRC-32Cs, in row order, have crc32c "
            f"{crc:#010x}, its entry records {info.frames_crc32c:#010x})",
        )


def check_frame_bytes(table: pa.Table, metadata: pq.FileMetaData, info: Part, shown: str) -> None:
    """Refuse a part whose ``frame_bytes`` column (read without the frames) claims more
    bytes than its footer says the frame column holds uncompressed. The column and the
    entry's totals may be made to agree, CRCs and all; the footer's sizes are pyarrow's
    own count of the bytes it wrote, and outputs are sized from the claim (decompress
    reserves a file's length before any frame is read). A frame column stored with a
    dictionary (archives from before the KV default mode) holds repeated frames once:
    not checked."""
    if "frame_bytes" not in table.column_names or "frame" not in metadata.schema.names:
        return
    column = table.column("frame_bytes")
    if not pa.types.is_integer(column.type) or column.null_count:  # the rows' own checks name it
        return
    index = metadata.schema.names.index("frame")
    chunks = [metadata.row_group(g).column(index) for g in range(metadata.num_row_groups)]
    if any(chunk.has_dictionary_page for chunk in chunks):
        return
    claimed = sum(column.to_pylist())  # Python's integers: pyarrow's int64 sum wraps (4 x 2**62 is 0)
    held = sum(chunk.total_uncompressed_size for chunk in chunks)
    if claimed > held:
        raise _damaged(info, shown, f"its rows' frame_bytes add up to {claimed}, more than its frames' {held} bytes hold")


def check_rows(rows: int, info: Part, shown: str) -> None:
    """Refuse a part of another number of rows than its entry's ``blocks``."""
    if rows != info.blocks:
        raise _damaged(info, shown, f"it holds {rows} blocks, its entry {info.blocks}")


def totals_problem(raw_bytes: int, frame_bytes: int, info: Part) -> str | None:
    """What is wrong where a part's blocks hold ``raw_bytes`` in ``frame_bytes`` of frames
    and its entry records other totals; None where they agree."""
    if (raw_bytes, frame_bytes) == (info.raw_bytes, info.frame_bytes):
        return None
    return f"its rows hold {raw_bytes} bytes in {frame_bytes} of frames, its entry records {info.raw_bytes} in {info.frame_bytes}"


def check_key_range(keys: list, info: Part, shown: str) -> None:
    """Refuse a part whose first and last keys are not those its entry records."""
    if keys and (keys[0], keys[-1]) != (info.first_key, info.last_key):
        raise _damaged(
            info,
            shown,
            f"its keys run from {str(keys[0])!r} to {str(keys[-1])!r}, "
            f"its entry records {str(info.first_key)!r} to {str(info.last_key)!r}",
        )


def _damaged(info: Part, shown: str, why: str) -> CorruptArchiveError:
    return CorruptArchiveError(f"part {info.name} of {shown} is damaged: {why}")


def read_footer(f: pa.NativeFile, info: Part, shown: str) -> pq.FileMetaData:
    """The part's footer, read from the open file ``f``, checked against the part's
    ``footer_crc32c`` where recorded, then parsed. Raises :class:`CorruptArchiveError`
    naming the part where it is not a Parquet footer or fails its CRC."""
    size = f.size()
    if size < 12:
        raise _damaged(info, shown, f"{size} bytes, too short for Parquet")
    f.seek(size - min(size, TAIL_READ))
    tail = f.read()
    if tail[-4:] != MAGIC:
        raise _damaged(info, shown, "it does not end as a Parquet file")
    length = int.from_bytes(tail[-8:-4], "little")
    if length + 12 > size:
        raise _damaged(info, shown, f"its footer's length {length} runs past the file's {size} bytes")
    if length + 8 > len(tail):
        f.seek(size - length - 8)
        tail = f.read(length + 8)
    footer = tail[-(length + 8) :]
    if info.footer_crc32c is not None:
        crc = crc32c.crc32c(footer)
        if crc != info.footer_crc32c:
            recorded = info.footer_crc32c
            raise _damaged(info, shown, f"its Parquet footer has crc32c {crc:#010x}, its entry records {recorded:#010x}")
    try:
        return pq.read_metadata(pa.BufferReader(MAGIC + footer))
    except (OSError, pa.ArrowException) as exc:
        raise _damaged(info, shown, f"its Parquet footer is not readable ({' '.join(str(exc).split())})") from None


def check_schema(metadata: pq.FileMetaData, info: Part, shown: str, schema: pa.Schema, names: list[str]) -> None:
    """Refuse a footer lacking any column of ``names``, or giving one another type than
    ``schema``'s, or whose row groups do not add up to the part's blocks."""
    arrow = metadata.schema.to_arrow_schema()
    for name in names:
        index = arrow.get_field_index(name)
        if index < 0:
            raise _damaged(info, shown, f"it has no {name!r} column")
        if arrow.field(index).type != schema.field(name).type:
            raise _damaged(info, shown, f"its {name!r} column is {arrow.field(index).type}, not {schema.field(name).type}")
    rows = sum(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
    check_rows(rows, info, shown)
    check_rows(metadata.num_rows, info, shown)  # the footer's own total, which a reader may trust


def check_columns(columns: dict[str, list], info: Part, shown: str) -> None:
    """Refuse metadata columns whose CRC-32C is not the part's ``columns_crc32c`` (where recorded)."""
    if info.columns_crc32c is None:
        return
    crc = columns_crc32c(columns)
    if crc != info.columns_crc32c:
        recorded = info.columns_crc32c
        raise _damaged(info, shown, f"its metadata columns have crc32c {crc:#010x}, its entry records {recorded:#010x}")
