"""An archive's records: its manifest, its plan and each part's entry, as frozen dataclasses.

Each record is read from its JSON by ``from_json``, which checks every field once and
raises :class:`~fp8ray.errors.CorruptArchiveError` naming the file and the field; the
rest of fp8ray reads attributes. ``to_json`` gives back the JSON fp8ray writes, the same
keys with the same values (docs/FORMAT.md, "Manifest"), so archives written before and
after these classes are byte-identical. Where the files are and how they are written is
:mod:`fp8ray.io.archive`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from ..codec.bound import bound_constants
from ..codec.options import CodecOptions
from ..errors import CorruptArchiveError, InvalidOptionError
from .blocks import BACKSLASH, SUFFIXES, SourceLayout, parquet_schema, raw_schema_problem
from .lmcache_store import STORE_KIND
from .lossless import canonical_lossless
from .paths import is_temporary, is_utf8
from .provenance import Provenance, short_repr

ARCHIVE_FORMAT = "fp8ray-archive"
# Version 2 added the source's layout to the manifest and the "file" column to parts;
# version 1 archives read as before (one safetensors file back).
ARCHIVE_VERSION = 2
# An archive holding stored frames (docs/FORMAT.md) is version 3, which fp8ray before them
# refuses by its version instead of failing on the frames; every other archive stays 2.
STORED_FRAMES_VERSION = 3
READ_VERSIONS = (1, 2, 3)
PART_PREFIX, PART_SUFFIX = "part-", ".parquet"
# What a manifest written before an option existed leaves out, and what it was then.
LEGACY_CODEC = {"scale_dtype": "float32", "scale_choice": "amax", "nonfinite": "error"}
CONTAINERS = ("file", "directory")
SOURCE_KINDS = (*SUFFIXES.values(), STORE_KIND)  # an LMCache store (fp8ray.io.store_source) too


# How errors name what a field should have been.
_KINDS = {int: "a non-negative integer", str: "a string", dict: "an object", list: "a list", float: "a number"}


class _Fields:
    """One JSON object's fields, each taken checked; errors name ``label`` (the file and
    the record) and the field."""

    def __init__(self, obj: object, label: str):
        if not isinstance(obj, dict):
            raise CorruptArchiveError(f"{label} is a JSON {type(obj).__name__}, not an object")
        self.obj, self.label = obj, label
        self.known: list[str] = []  # the fields taken, in order

    def __call__(self, name: str, kind: type, *, null: bool = False, optional: bool = False) -> Any:
        """The field ``name``, of ``kind`` (``int``: a count, never negative; ``float``: any
        number), or ``None`` where ``null`` allows it or ``optional`` lets it be absent."""
        self.known.append(name)
        if name not in self.obj:
            if optional:
                return None
            raise CorruptArchiveError(f"{self.label}'s {name!r} is missing")
        value = self.obj[name]
        if value is None and null:
            return None
        if not _is(value, kind):
            wanted = _KINDS[kind] + (" or null" if null else "")
            raise CorruptArchiveError(f"{self.label}'s {name!r} is {short_repr(value)}, not {wanted}")
        return value

    def refuse_others(self) -> None:
        """Refuse a field no call took: fp8ray writes none, so it is an edit, or an archive
        of a later fp8ray that this one would misread (a later format bumps the version)."""
        unknown = sorted(set(self.obj) - set(self.known))
        if unknown:
            raise CorruptArchiveError(f"{self.label} holds {short_repr(unknown[0])}, not one of {self.known}")


def _is(value: object, kind: type) -> bool:
    if isinstance(value, bool):  # JSON's true is no count
        return False
    if kind is int:
        return isinstance(value, int) and value >= 0
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _strings(value: dict, label: str) -> None:
    """Refuse an object whose keys and values are not all strings (safetensors metadata)."""
    bad = [k for k, v in value.items() if not isinstance(v, str)]
    if bad:
        raise CorruptArchiveError(f"{label}'s {bad[0]!r} is {short_repr(value[bad[0]])}, not a string")


OPTIONAL_CRCS = ("footer_crc32c", "columns_crc32c", "frames_crc32c")  # of Part: absent from older entries


@dataclass(frozen=True)
class Part:
    """What the manifest (and a part's sidecar) records of one part."""

    name: str  # part-NNNNN.parquet, in the archive's directory
    blocks: int
    raw_bytes: int
    frame_bytes: int
    file_bytes: int
    crc32c: int  # of the whole file
    first_key: str | None  # None: a part without blocks
    last_key: str | None
    # Optional (parts written before them lack them; fp8ray.io.part_checks): the CRC-32C
    # of the Parquet footer, checked before pyarrow parses it, of the metadata columns,
    # and of the frames' own CRC-32Cs in row order.
    footer_crc32c: int | None = None
    columns_crc32c: int | None = None
    frames_crc32c: int | None = None

    @classmethod
    def from_json(cls, obj: object, where: str) -> Part:
        """A part entry; ``where`` names the file and entry (``"…/_manifest.json: part entry 3"``)."""
        field = _Fields(obj, where)
        part = cls(
            name=field("name", str),
            blocks=field("blocks", int),
            raw_bytes=field("raw_bytes", int),
            frame_bytes=field("frame_bytes", int),
            file_bytes=field("file_bytes", int),
            crc32c=field("crc32c", int),
            first_key=field("first_key", str, null=True),
            last_key=field("last_key", str, null=True),
            footer_crc32c=field("footer_crc32c", int, optional=True),
            columns_crc32c=field("columns_crc32c", int, optional=True),
            frames_crc32c=field("frames_crc32c", int, optional=True),
        )
        field.refuse_others()
        if "/" in part.name or not part.name.startswith(PART_PREFIX):
            raise CorruptArchiveError(f"{where} names {part.name!r}, not a part of this archive")
        for name in ("crc32c", *OPTIONAL_CRCS):
            value = getattr(part, name)
            if value is not None and value >= 1 << 32:
                raise CorruptArchiveError(f"{where}'s {name!r} is {value}, more than 32 bits")
        return part

    def to_json(self) -> dict:
        """The entry's JSON: an optional CRC not recorded stays out (older parts keep their JSON)."""
        out = asdict(self)
        for name in OPTIONAL_CRCS:
            if out[name] is None:
                del out[name]
        return out


def _lossless(spec: str | None, label: str) -> str | None:
    """The lossless stage a manifest records (what the archive was asked to use; each
    part's Parquet names its own codec), checked, in its canonical spelling: archives of
    2026-12-03 recorded it as typed (``zstd:03``, ``zstd:``)."""
    if spec is None:
        return None
    try:
        return canonical_lossless(spec.removesuffix(":"))
    except InvalidOptionError:
        raise CorruptArchiveError(f"{label}'s 'lossless' is {short_repr(spec)}, not a lossless stage") from None


def _layout(obj: object, label: str) -> SourceLayout:
    """The source's layout a manifest records, checked field by field."""
    field = _Fields(obj, label)
    kind, container = field("kind", str), field("container", str)
    if kind not in SOURCE_KINDS:
        raise CorruptArchiveError(f"{label}'s 'kind' is {kind!r}, not one of {sorted(SUFFIXES.values())} or {STORE_KIND!r}")
    if container not in CONTAINERS:
        raise CorruptArchiveError(f"{label}'s 'container' is {container!r}, not one of {list(CONTAINERS)}")
    files = field("files", list)
    if container == "file" and len(files) != 1:  # decompress gives one file back, its name the output's
        raise CorruptArchiveError(f"{label}'s 'container' is 'file', but it records {len(files)} files, not one")
    for i, entry in enumerate(files):
        file = _Fields(entry, f"{label}, file {i}")
        checked_file_name(file("name", str), f"{label}, file {i}")  # no name writes outside an output
        file("blocks", int)
        _schema(file("schema", str, null=True, optional=True), kind, f"{label}, file {i}")
        metadata = file("metadata", dict, optional=True)
        if metadata:
            _strings(metadata, f"{label}, file {i}'s metadata")
        file.refuse_others()
    for i, entry in enumerate(field("skipped", list, optional=True) or ()):
        skipped = _Fields(entry, f"{label}, skipped entry {i}")
        skipped("name", str)
        skipped("reason", str)
        skipped.refuse_others()
    field.refuse_others()
    return SourceLayout.from_dict(obj)


def checked_file_name(name, where: str = "the archive") -> str:
    """A file name from a manifest, refused unless it is a plain relative path (parts
    separated by ``/``, as a source tree's files are named): never one that would write
    outside the output directory, into a hidden folder, or under a temporary's name. (A
    file's own name may start with ``.``: an LMCache store's chunk of a model served from
    a relative path, ``./models/x``, is named ``.-SEP-models-SEP-x@...``.) ``where``: what
    names it, for the message."""
    parts = name.split("/") if isinstance(name, str) else []
    if (
        not parts
        or BACKSLASH in name
        or "\0" in name
        or not is_utf8(name)  # a lone surrogate (\ud800): no file can be given that name
        or any(not part or part in (".", "..") or is_temporary(part) for part in parts)
        or any(folder.startswith(".") for folder in parts[:-1])
    ):
        raise CorruptArchiveError(f"{where} names a source file {str(name)!r}, which is not a plain relative file name")
    return name


def _schema(schema: str | None, kind: str, label: str) -> None:
    """A file's recorded Arrow schema: what a Parquet file is written back with (base64
    IPC bytes), and nothing for the other kinds."""
    if kind != "parquet":
        if schema is not None:
            raise CorruptArchiveError(f"{label} records a Parquet schema, but the layout's 'kind' is {kind!r}")
        return
    if schema is None:
        raise CorruptArchiveError(f"{label} records no Parquet schema, which a layout of 'kind' 'parquet' needs")
    try:
        problem = raw_schema_problem(parquet_schema(schema))
    except (ValueError, OSError, pa.ArrowException) as exc:  # binascii.Error: ValueError; a bad IPC message: OSError
        raise CorruptArchiveError(f"{label}'s 'schema' is not a base64 Arrow schema: {exc}") from None
    if problem:
        raise CorruptArchiveError(f"{label}'s 'schema' is not a raw-block source's: {problem}")


@dataclass(frozen=True)
class Manifest:
    """An archive's ``_manifest.json``: what it holds, how it was encoded, the source's
    layout (to give it back) and each part's size and CRC-32C."""

    version: int
    fp8ray_version: str
    codec: dict[str, Any]  # as recorded: a manifest from before an option lacks it (see ``options``)
    lossless: str | None  # None: version 1, before the lossless stage
    error_bound: dict[str, float] | None  # the codec's bound terms (fp8ray.codec.bound); None: version 1
    layout: SourceLayout | None  # None: version 1, which restores as one safetensors file
    source: str  # redacted: never a URI's credentials
    blocks: int
    raw_bytes: int
    frame_bytes: int
    archive_bytes: int
    parts: tuple[Part, ...]
    provenance: Provenance | None = None  # None: none given (and every manifest from before it)
    stored_blocks: int = 0  # blocks in stored frames (fp8 does not encode their dtype); > 0 only in version 3

    @property
    def options(self) -> CodecOptions:
        """The codec options the archive was written with (:data:`LEGACY_CODEC` for what
        an older manifest leaves out)."""
        return CodecOptions.parse({**LEGACY_CODEC, **self.codec})

    @classmethod
    def from_json(cls, obj: object, where: str) -> Manifest:
        """The manifest in ``obj``, read from the file ``where`` (named in errors)."""
        label = f"{where}: the manifest"
        if not isinstance(obj, dict):
            raise CorruptArchiveError(f"{label} is a JSON {type(obj).__name__}, not an object")
        version = obj.get("version")
        if obj.get("format") != ARCHIVE_FORMAT or type(version) is not int or version not in READ_VERSIONS:
            raise CorruptArchiveError(
                f"{where}: format {obj.get('format')!r} version {obj.get('version')!r}, "
                f"expected {ARCHIVE_FORMAT!r} version {' or '.join(map(str, READ_VERSIONS))}"
            )
        field = _Fields(obj, label)
        field.known += ["format", "version"]  # checked above
        codec = field("codec", dict)
        try:
            options = CodecOptions.parse({**LEGACY_CODEC, **codec})
        except InvalidOptionError as exc:
            raise CorruptArchiveError(f"{label}'s 'codec' is not valid: {exc}") from None
        bound = field("error_bound", dict, optional=True)
        if bound:  # an empty one records nothing: verify derives the bound
            terms = bound_constants(options.fmt, options.scaling)
            if set(bound) != set(terms) or not all(_is(v, float) for v in bound.values()):
                raise CorruptArchiveError(f"{label}'s 'error_bound' is {short_repr(bound)}, not numbers for {sorted(terms)}")
            if bound != terms:  # verify --against holds blocks to it: a loosened one would pass another source
                raise CorruptArchiveError(
                    f"{label}'s 'error_bound' is {short_repr(bound)}, not its codec's ({options.label()}): {terms}"
                )
        layout = field("layout", dict, optional=obj["version"] == 1)  # version 2 added it: without, one file back
        provenance = field("provenance", dict, optional=True)
        parts = field("parts", list)
        manifest = cls(
            version=obj["version"],
            fp8ray_version=field("fp8ray_version", str),
            codec=codec,
            lossless=_lossless(field("lossless", str, optional=True), label),
            error_bound=bound,
            layout=_layout(layout, f"{label}'s layout") if layout is not None else None,
            source=field("source", str),
            blocks=field("blocks", int),
            raw_bytes=field("raw_bytes", int),
            frame_bytes=field("frame_bytes", int),
            archive_bytes=field("archive_bytes", int),
            parts=tuple(Part.from_json(entry, f"{where}: part entry {i}") for i, entry in enumerate(parts)),
            provenance=Provenance.from_json(provenance, f"{label}'s provenance") if provenance is not None else None,
            stored_blocks=field("stored_blocks", int, optional=True) or 0,
        )
        field.refuse_others()
        stored = manifest.stored_blocks
        if stored > manifest.blocks or (manifest.version == STORED_FRAMES_VERSION) != (stored > 0):
            raise CorruptArchiveError(
                f"{label} is version {manifest.version} with 'stored_blocks' {stored} of "
                f"{manifest.blocks} blocks: version {STORED_FRAMES_VERSION} and only it holds stored blocks, at least "
                "one and at most every block"
            )
        # Each total as fp8ray writes it, the parts' sum: a manifest edited by hand is refused.
        for total, of_part in (
            ("blocks", "blocks"),
            ("raw_bytes", "raw_bytes"),
            ("frame_bytes", "frame_bytes"),
            ("archive_bytes", "file_bytes"),
        ):
            recorded, summed = getattr(manifest, total), sum(getattr(p, of_part) for p in manifest.parts)
            if recorded != summed:
                raise CorruptArchiveError(
                    f"{label} records {total} {recorded}, but its parts' entries' {of_part} add up to {summed}"
                )
        return manifest

    def to_json(self) -> dict:
        """The manifest as fp8ray writes it: what a version 1 manifest lacks stays out."""
        out: dict[str, Any] = {
            "format": ARCHIVE_FORMAT,
            "version": self.version,
            "fp8ray_version": self.fp8ray_version,
            "codec": self.codec,
        }
        if self.lossless is not None:
            out["lossless"] = self.lossless
        if self.error_bound is not None:
            out["error_bound"] = self.error_bound
        if self.layout is not None:
            out["layout"] = self.layout.as_dict()
        out.update(
            source=self.source,
            blocks=self.blocks,
            raw_bytes=self.raw_bytes,
            frame_bytes=self.frame_bytes,
            archive_bytes=self.archive_bytes,
            parts=[p.to_json() for p in self.parts],
        )
        if self.provenance is not None:  # only where given: archives without keep their JSON
            out["provenance"] = self.provenance.to_json()
        if self.stored_blocks:
            out["stored_blocks"] = self.stored_blocks
        return out


@dataclass(frozen=True)
class Plan:
    """An unfinished archive's ``_plan.json``: a resumed run must find the same source,
    options and parts, and the source's files unchanged (``files``)."""

    source: str  # a URI redacted (never its credentials), a local path absolute
    codec: dict[str, Any]
    lossless: str
    parts: tuple[tuple[tuple[str, str], ...], ...]  # each part's blocks as (file, key)
    # Each source file's (name, size, mtime_ns; None where its filesystem keeps none): a
    # file rewritten since is not resumed. None: a plan written before they were recorded.
    files: tuple[tuple[str, int, int | None], ...] | None = None

    @classmethod
    def from_json(cls, obj: object, where: str) -> Plan:
        """The plan in ``obj``, read from the file ``where`` (named in errors)."""
        label = f"{where}: the plan"
        field = _Fields(obj, label)
        parts = field("parts", list)
        for i, part in enumerate(parts):
            if not isinstance(part, list) or not all(
                isinstance(b, list) and len(b) == 2 and all(isinstance(s, str) for s in b) for b in part
            ):
                raise CorruptArchiveError(f"{label}'s part {i} is {short_repr(part)}, not a list of [file, key] pairs")
        files = field("files", list, optional=True)
        for i, entry in enumerate(files or ()):
            if not (
                isinstance(entry, list)
                and len(entry) == 3
                and isinstance(entry[0], str)
                and _is(entry[1], int)
                and (entry[2] is None or (isinstance(entry[2], int) and not isinstance(entry[2], bool)))
            ):
                raise CorruptArchiveError(f"{label}'s file {i} is {short_repr(entry)}, not [name, size, mtime_ns or null]")
        return cls(
            source=field("source", str),
            codec=field("codec", dict),
            lossless=field("lossless", str),
            parts=tuple(tuple((file, key) for file, key in part) for part in parts),
            files=None if files is None else tuple((name, size, mtime) for name, size, mtime in files),
        )

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "codec": self.codec,
            "lossless": self.lossless,
            "parts": [[[file, key] for file, key in part] for part in self.parts],
            **({} if self.files is None else {"files": [list(f) for f in self.files]}),
        }
