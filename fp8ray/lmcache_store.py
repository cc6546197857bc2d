"""LMCache's filesystem L2 store: chunk file names, scanning, and fp8 conversion on Ray.

LMCache's FS adapter keeps one file per chunk, flat in its ``base_path``, named::

    <model, '/' -> '-SEP-'>@<kv_rank as 0x%08x>@<object_group_id, hex>@<chunk_hash, hex>[@<cache_salt>].data

holding only the chunk's raw bytes: no header, the reader supplies the layout (e.g.
bfloat16 ``[2, layers, 256, kv_heads * head_dim]``). With LMCache's fp8 serde the same
file holds one fp8 byte per element instead. ``compress_store`` turns a bf16/fp16/fp32
store into exactly the files the fp8 serde would have written (same names, bytes of
:class:`fp8ray.lmcache.Fp8QuantizationSerializer`); ``decompress_store`` does the
reverse with :class:`fp8ray.lmcache.Fp8QuantizationDeserializer`. Both run on
``QuantWorker`` actors, a shard of files per call; docs/LMCACHE.md has the contract.

Nothing is written at the destination until every file is converted: workers write into
a temporary directory beside it, which is renamed into place at the end, and removed if
anything failed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from .errors import Fp8rayError
from .formats import FORMATS
from .sources import TORCH_DTYPES

SEP = "@"
SLASH_REPLACEMENT = "-SEP-"
EXTENSION = ".data"
SALT_FORBIDDEN = frozenset("@/\\\x00")
SALT_MAX_LEN = 128
LAYOUT_DTYPES = TORCH_DTYPES  # the dtypes a layout may name: fp8ray's source dtypes
SHARD_BYTES = 64 << 20  # input bytes per worker call


class LMCacheStoreError(Fp8rayError, ValueError):
    """A store could not be converted: a bad destination, or a file that failed."""


@dataclass(frozen=True)
class ChunkName:
    """The fields of an LMCache chunk file name (LMCache's ``ObjectKey``).

    ``model`` must not contain ``@``; ``cache_salt`` not ``@``, ``/``, ``\\`` or NUL and
    at most 128 characters; ``object_group_id`` is non-negative, as LMCache requires.
    """

    model: str
    kv_rank: int
    object_group_id: int
    chunk_hash: bytes
    cache_salt: str = ""

    def __post_init__(self):
        if SEP in self.model:
            raise ValueError(f"model must not contain '@' (got {self.model!r})")
        if self.object_group_id < 0:
            raise ValueError(f"object_group_id must be >= 0 (got {self.object_group_id})")
        bad = SALT_FORBIDDEN & set(self.cache_salt)
        if bad:
            raise ValueError(f"cache_salt must not contain {sorted(bad)} (got {self.cache_salt!r})")
        if len(self.cache_salt) > SALT_MAX_LEN:
            raise ValueError(f"cache_salt is {len(self.cache_salt)} characters, at most {SALT_MAX_LEN} allowed")


def format_chunk_name(name: ChunkName) -> str:
    """The file name LMCache's FS adapter gives a chunk."""
    base = (
        f"{name.model.replace('/', SLASH_REPLACEMENT)}{SEP}{name.kv_rank:#010x}"
        f"{SEP}{name.object_group_id:x}{SEP}{name.chunk_hash.hex()}"
    )
    return f"{base}{SEP}{name.cache_salt}{EXTENSION}" if name.cache_salt else f"{base}{EXTENSION}"


def parse_chunk_name(filename: str) -> ChunkName:
    """The fields of a chunk file name, parsed as LMCache parses them (4 fields, or 5
    with a salt; kv_rank and object_group_id as hex, ``0x`` optional). Raises
    ``ValueError`` saying why a name is not one."""
    if not filename.endswith(EXTENSION):
        raise ValueError(f"does not end in {EXTENSION}")
    parts = filename[: -len(EXTENSION)].split(SEP)
    if len(parts) not in (4, 5):
        raise ValueError(f"has {len(parts)} '@'-separated fields, expected 4 or 5")
    model, rank, group, chunk_hash, *salt = parts
    try:
        return ChunkName(
            model=model.replace(SLASH_REPLACEMENT, "/"),
            kv_rank=int(rank, 16),
            object_group_id=int(group, 16),
            chunk_hash=bytes.fromhex(chunk_hash),
            cache_salt=salt[0] if salt else "",
        )
    except ValueError as exc:
        raise ValueError(f"has a malformed field: {exc}") from None


@dataclass(frozen=True)
class Layout:
    """The dtype and shape of every chunk of a store: ``bfloat16:2,30,256,192``."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def raw_bytes(self) -> int:
        return self.numel * LAYOUT_DTYPES[self.dtype].itemsize

    def __str__(self) -> str:
        return f"{self.dtype}:{','.join(map(str, self.shape))}"


def parse_layout(text: str) -> Layout:
    dtype, sep, dims = text.partition(":")
    if not sep or dtype not in LAYOUT_DTYPES:
        raise ValueError(f"layout {text!r}: expected DTYPE:D0,D1,... with DTYPE one of {sorted(LAYOUT_DTYPES)}")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise ValueError(f"layout {text!r}: dimensions must be comma-separated integers") from None
    if any(d <= 0 for d in shape):
        raise ValueError(f"layout {text!r}: dimensions must be positive")
    return Layout(dtype, shape)


@dataclass
class StoreScan:
    """The files of a store to convert, and those left alone with the reason."""

    files: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"name", "reason"}


def scan_store(directory: str, expected_bytes: int, other_sizes: dict[int, str] | None = None) -> StoreScan:
    """Sort the entries of a store directory into chunk files of ``expected_bytes`` and
    skipped ones (not a regular file, a name that is not a chunk name, another size).
    Like LMCache's FS adapter, only the directory's own entries count (no recursion).
    ``other_sizes`` maps a size to a hint for the reason (``"already fp8?"``)."""
    scan = StoreScan()
    with os.scandir(directory) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            if entry.is_symlink():
                scan.skipped.append({"name": entry.name, "reason": "a symbolic link"})
                continue
            if not entry.is_file():
                scan.skipped.append({"name": entry.name, "reason": "not a regular file (LMCache keeps chunks flat)"})
                continue
            try:
                parse_chunk_name(entry.name)
            except ValueError as exc:
                scan.skipped.append({"name": entry.name, "reason": f"not an LMCache chunk name: it {exc}"})
                continue
            size = entry.stat().st_size
            if size != expected_bytes:
                hint = (other_sizes or {}).get(size)
                reason = f"{size} bytes, the layout needs {expected_bytes}" + (f" ({hint})" if hint else "")
                scan.skipped.append({"name": entry.name, "reason": reason})
                continue
            scan.files.append(entry.name)
    return scan


@dataclass
class StoreReport:
    mode: str  # "compress" | "decompress"
    source: str
    destination: str
    layout: str
    fp8: str
    files: int
    skipped: list[dict]
    bytes_before: int
    bytes_after: int
    seconds: float
    workers: int

    @property
    def input_gbps(self) -> float:
        return self.bytes_before / self.seconds / 1e9 if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "input_gbps": self.input_gbps}


def convert_files(worker, mode: str, source: str, scratch: str, names: list[str], layout: Layout, fp8: str) -> dict:
    """Convert a shard of files from ``source`` into ``scratch``; runs on a QuantWorker
    (through Ray's ``__ray_call__``, ``worker`` being the actor instance).

    Returns ``{"done": [(name, bytes in, bytes out)], "failed": [(name, message)]}``;
    it stops at the first failure, so the driver can report it without a traceback.
    """
    from .lmcache import Fp8QuantizationDeserializer, Fp8QuantizationSerializer

    dtype = LAYOUT_DTYPES[layout.dtype]
    serializer = Fp8QuantizationSerializer(fp8) if mode == "compress" else None
    deserializer = Fp8QuantizationDeserializer(fp8) if mode == "decompress" else None
    expected = layout.raw_bytes if mode == "compress" else layout.numel
    out: dict = {"done": [], "failed": []}
    for name in names:
        try:
            data = bytearray(expected)
            with open(os.path.join(source, name), "rb") as f:
                size = f.readinto(data) + len(f.read(1))
            if size != expected:  # changed since the scan
                raise ValueError(f"{'fewer' if size < expected else 'more'} bytes than the layout's {expected}")
            raw = torch.frombuffer(data, dtype=torch.uint8)
            if serializer is not None:
                src = raw.view(dtype).reshape(layout.shape)
                dst = torch.empty(layout.numel, dtype=torch.uint8)
                serializer.serialize(SimpleNamespace(tensor=src), SimpleNamespace(tensor=dst))
            else:
                dst = torch.empty(layout.shape, dtype=dtype)
                deserializer.deserialize(SimpleNamespace(tensor=raw), SimpleNamespace(tensor=dst))
            payload = dst.reshape(-1).view(torch.uint8).numpy()
            with open(os.path.join(scratch, name), "wb") as f:
                f.write(memoryview(np.ascontiguousarray(payload)))
            out["done"].append((name, len(data), int(payload.size)))
        except (ValueError, TypeError, OSError) as exc:
            out["failed"].append((name, str(exc)))
            break
    return out


def _check_paths(source: str, destination: str, overwrite: bool) -> tuple[str, str]:
    src, dst = os.path.realpath(source), os.path.realpath(destination)
    if not os.path.isdir(src):
        raise LMCacheStoreError(f"source {source} is not a directory")
    if src == dst:
        raise LMCacheStoreError(f"destination {destination} is the source: the conversion never writes in place")
    if dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
        raise LMCacheStoreError(f"source {source} and destination {destination} must not lie inside each other")
    if os.path.lexists(dst):
        if not overwrite:
            raise LMCacheStoreError(f"destination {destination} exists (pass --overwrite to replace it)")
        if not os.path.isdir(dst) or os.path.islink(destination):
            raise LMCacheStoreError(f"destination {destination} exists and is not a directory; not replacing it")
    return src, dst


def _remove_tree(path: str) -> None:
    """Remove a scratch directory; a killed worker may still be finishing a write into it."""
    for _ in range(20):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.1)
    shutil.rmtree(path)  # raises, naming what is left


def _plan_shards(files: list[str], file_bytes: int, workers: int) -> list[list[str]]:
    """Shards of up to SHARD_BYTES of input, and at least two per worker when there are enough files."""
    per_shard = max(1, min(SHARD_BYTES // max(1, file_bytes), -(-len(files) // (2 * workers))))
    return [files[i : i + per_shard] for i in range(0, len(files), per_shard)]


def convert_store(
    mode: str,
    source: str,
    destination: str,
    layout: Layout | str,
    *,
    fp8: str = "e4m3fn",
    workers: int = 2,
    gpus_per_worker: float = 0,
    address: str | None = None,
    overwrite: bool = False,
    progress=None,
    on_scan=None,
) -> StoreReport:
    """Convert every chunk file of an LMCache FS store: ``mode="compress"`` from the
    layout's dtype to fp8, ``"decompress"`` back. Files of another size or name are
    skipped and reported; a file that fails (non-finite values in compress) aborts the
    whole run with an error naming it, leaving no destination.

    ``progress(n)`` is called with the files just converted; ``on_scan(n)`` with the
    number of files to convert, before the work starts.
    """
    from .formats import get_format
    from .pool import QuantPool

    if mode not in ("compress", "decompress"):
        raise ValueError(f"mode must be 'compress' or 'decompress', got {mode!r}")
    fmt = get_format(fp8)
    layout = parse_layout(layout) if isinstance(layout, str) else layout
    src, dst = _check_paths(source, destination, overwrite)
    raw, fp8_bytes = layout.raw_bytes, layout.numel
    if mode == "compress":
        scan = scan_store(src, raw, {fp8_bytes: "the layout's size in fp8: already compressed?"})
    else:
        scan = scan_store(src, fp8_bytes, {raw: f"the layout's size in {layout.dtype}: not compressed?"})
    if on_scan is not None:
        on_scan(len(scan.files))

    scratch = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(scratch)
    before = after = 0
    seconds = 0.0
    try:
        if scan.files:
            shards = _plan_shards(scan.files, raw if mode == "compress" else fp8_bytes, workers)
            with QuantPool(num_workers=workers, gpus_per_worker=gpus_per_worker, address=address) as pool:
                start = time.perf_counter()  # the conversion itself, once the workers are up
                items = ((convert_files, mode, src, scratch, shard, layout, fmt.name) for shard in shards)
                for result in pool.map("__ray_call__", items):
                    if result["failed"]:
                        name, message = result["failed"][0]
                        raise LMCacheStoreError(f"{mode} of {os.path.join(source, name)} failed: {message}")
                    for _, n_in, n_out in result["done"]:
                        before += n_in
                        after += n_out
                    if progress is not None:
                        progress(len(result["done"]))
                seconds = time.perf_counter() - start
        if os.path.lexists(dst):  # --overwrite: swap the old one out only now
            trash = f"{scratch}.old"
            os.rename(dst, trash)
            try:
                os.rename(scratch, dst)
            except BaseException:
                os.rename(trash, dst)  # put the old store back
                raise
            shutil.rmtree(trash, ignore_errors=True)  # the new store is in place either way
        else:
            os.rename(scratch, dst)
    except BaseException:
        _remove_tree(scratch)
        raise
    return StoreReport(
        mode=mode,
        source=source,
        destination=destination,
        layout=str(layout),
        fp8=fmt.name,
        files=len(scan.files),
        skipped=scan.skipped,
        bytes_before=before,
        bytes_after=after,
        seconds=seconds,
        workers=workers,
    )


def compress_store(source: str, destination: str, layout: Layout | str, **options) -> StoreReport:
    """LMCache chunk files in the layout's dtype -> the files LMCache's fp8 serde writes."""
    return convert_store("compress", source, destination, layout, **options)


def decompress_store(source: str, destination: str, layout: Layout | str, **options) -> StoreReport:
    """LMCache fp8-serde chunk files -> raw chunk files in the layout's dtype."""
    return convert_store("decompress", source, destination, layout, **options)


def run_store_command(args) -> int:
    from .cli import _progress

    state: dict = {}

    def on_scan(total: int) -> None:
        state["bar"], state["update"] = _progress(args, lambda: total)

    report = convert_store(
        "compress" if args.command == "lmcache-compress" else "decompress",
        args.source,
        args.destination,
        args.layout,
        fp8=args.fp8,
        workers=args.workers,
        gpus_per_worker=args.gpus_per_worker,
        address=args.address,
        overwrite=args.overwrite,
        progress=lambda n: state.get("update") and state["update"](n),
        on_scan=on_scan,
    )
    if state.get("bar") is not None:
        state["bar"].close()
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        for skipped in report.skipped:
            print(f"fp8ray: skipped {skipped['name']}: {skipped['reason']}", file=sys.stderr)
        print(
            f"{report.mode}ed {report.files} chunk files ({len(report.skipped)} skipped) into {report.destination}: "
            f"{report.bytes_before / 2**20:.1f} MiB -> {report.bytes_after / 2**20:.1f} MiB, "
            f"{report.input_gbps:.2f} GB/s of input on {report.workers} workers"
        )
    return 0


def add_commands(commands, bench_kinds) -> None:
    from .cli import engine_arguments

    for name, help_text in (
        ("lmcache-compress", "convert an LMCache filesystem store to the files of LMCache's fp8 serde"),
        ("lmcache-decompress", "convert an LMCache fp8-serde filesystem store back to the layout's dtype"),
    ):
        parser = commands.add_parser(name, help=help_text)
        parser.add_argument("source", help="the store's directory (LMCache's base_path)")
        parser.add_argument("destination", help="a new directory; renamed into place when every file is converted")
        parser.add_argument("--layout", required=True, help="dtype and shape of one chunk, e.g. bfloat16:2,30,256,192")
        parser.add_argument("--fp8", choices=sorted(FORMATS), default="e4m3fn")
        parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")
        engine_arguments(parser)
        parser.set_defaults(handler=run_store_command)
