"""The archive's lossless stage over the frames: Parquet's codecs, their level ranges and
the default, and the spec that names one. Without pyarrow: the command line's help reads it."""

from ..errors import InvalidOptionError

DEFAULT_LOSSLESS = "zstd:3"  # chosen from the table in BENCHMARKS.md ("Lossless stage")
# Lossless codecs for the frame column (Parquet's own), and their level ranges.
LOSSLESS_CODECS = {"none": None, "zstd": (1, 22), "lz4": None, "snappy": None, "gzip": (1, 9), "brotli": (0, 11)}


def parse_lossless(spec: str) -> tuple[str, int | None]:
    """``"zstd:3"`` -> ``("zstd", 3)``; ``"none"`` -> ``("none", None)``. A bad spec raises
    :class:`InvalidOptionError` naming the codecs and levels."""
    if not isinstance(spec, str):
        raise InvalidOptionError(f"lossless must be a string such as 'zstd:3' or 'none', got {spec!r}", field="lossless")
    name, colon, level = spec.partition(":")
    if name not in LOSSLESS_CODECS:
        raise InvalidOptionError(f"unknown lossless codec {name!r}; expected one of {list(LOSSLESS_CODECS)}", field="lossless")
    levels = LOSSLESS_CODECS[name]
    if not colon:
        return name, None
    if levels is None or not (level.isascii() and level.isdigit()) or not levels[0] <= int(level) <= levels[1]:
        allowed = f"levels {levels[0]} to {levels[1]}" if levels else "no level"
        raise InvalidOptionError(f"lossless {spec!r}: {name} takes {allowed}", field="lossless")
    return name, int(level)


def canonical_lossless(spec: str) -> str:
    """``spec`` as an archive records it, checked: ``"zstd:03"`` -> ``"zstd:3"``."""
    name, level = parse_lossless(spec)
    return name if level is None else f"{name}:{level}"
