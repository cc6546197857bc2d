"""An LMCache filesystem store as an archive's source: one more kind beside safetensors
and raw-block Parquet (:func:`fp8ray.io.blocks.scan_source`), so that ``compress``
plans, writes and records it as it does them.

The store is scanned as the store tools scan it (:func:`~fp8ray.io.lmcache_store.scan_store`:
chunk files of one layout in any form, flat or in hash-prefix folders); each chunk file
is one block, keyed by its file name and recorded as a file of the source under its path
relative to the store (``9f/3a/<name>.data``), so that ``decompress --lmcache-form``
gives back the same names in the same folders. What the store holds besides is named in
the layout's ``skipped``, with why. The blocks' bytes are read by the workers
(:func:`fp8ray.lmcache.store_files.encode_chunk_files`), which find each file's form again.
"""

from __future__ import annotations

import os
import posixpath

from ..errors import MismatchError, SourceError
from .blocks import BACKSLASH, BACKSLASH_REASON, NOT_UTF8_REASON, BlockRef, SkippedEntry, SourceFile, SourceLayout
from .lmcache_store import STORE_KIND, Layout, parse_layout, scan_store
from .paths import is_utf8, printable, redact


def scan_store_source(uri: str, layout: Layout | str, plain_form: str | None = None) -> tuple[SourceLayout, list[BlockRef]]:
    """The layout and blocks of the LMCache store in the local directory ``uri``, whose
    chunks are of ``layout`` (``"bfloat16:2,30,256,192"``; ``plain_form``: as
    :func:`~fp8ray.io.lmcache_store.scan_store` takes it). Refuses a store that is not a
    local directory, and one holding no chunk file of the layout (the mark of a wrong
    layout), naming the most common reasons its files were not taken."""
    layout = parse_layout(layout) if isinstance(layout, str) else layout
    if "://" in uri:
        raise SourceError(f"source {redact(uri)}: an LMCache store is read from a local directory (its base_path)")
    if not os.path.isdir(uri):
        what = "does not exist" if not os.path.lexists(uri) else "is not a directory"
        raise SourceError(f"LMCache store {redact(uri)} {what}")
    root = os.path.abspath(uri)
    try:
        scan = scan_store(root, layout, plain_form)
    except OSError as exc:
        raise SourceError(f"LMCache store {redact(uri)} cannot be read: {exc.strerror or exc}") from None
    # Chunks LMCache can name on Linux that no archive may record: a model with a
    # backslash, or a name of bytes that are not UTF-8 (shown escaped).
    taken = []
    for chunk in scan.chunks:
        reason = NOT_UTF8_REASON if not is_utf8(chunk.name) else BACKSLASH_REASON if BACKSLASH in chunk.name else None
        if reason is None:
            taken.append(chunk)
        else:
            scan.skipped.append({"name": chunk.name, "reason": reason})
    scan.chunks = taken
    if not scan.chunks:
        reasons = sorted({s["reason"] for s in scan.skipped})[:3]
        raise MismatchError(
            f"LMCache store {redact(uri)} holds no chunk file of the layout {layout} in any form (raw, fp8, fp8ray)"
            + (f": {len(scan.skipped)} entries, e.g. {'; '.join(reasons)}; is --lmcache-layout right?" if scan.skipped else ""),
            field="layout",
        )
    refs = [
        BlockRef(posixpath.basename(c.name), layout.dtype, layout.shape, STORE_KIND, f"{root}/{c.name}", 0, c.name)
        for c in scan.chunks
    ]
    files = tuple(SourceFile(c.name, 1) for c in scan.chunks)
    # The manifest is UTF-8: a name that is not is recorded escaped, as a source tree's is.
    skipped = tuple(SkippedEntry(s["name"] if is_utf8(s["name"]) else printable(s["name"]), s["reason"]) for s in scan.skipped)
    return SourceLayout(STORE_KIND, "directory", files, skipped), refs
