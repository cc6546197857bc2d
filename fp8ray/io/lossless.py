"""The archive's lossless stage over the frames: Parquet's codecs, their level ranges and
the default. Plain data, without pyarrow: the command line's help reads it."""

DEFAULT_LOSSLESS = "zstd:3"  # chosen from the table in BENCHMARKS.md ("Lossless stage")
# Lossless codecs for the frame column (Parquet's own), and their level ranges.
LOSSLESS_CODECS = {"none": None, "zstd": (1, 22), "lz4": None, "snappy": None, "gzip": (1, 9), "brotli": (0, 11)}
