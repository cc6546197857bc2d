"""Ray Data in and out: callable classes for ``Dataset.map_batches``.

Ray Data's UDF convention: state (the codec) is built once in ``__init__``, on each
actor, then each call takes a batch and returns one.

- :class:`Fp8Encoder`: raw-block rows (``key``, ``dtype``, ``shape``, ``data``, and
  optionally ``file``) to rows of the archive part schema
  (:data:`fp8ray.io.archive.SCHEMA`: ``file`` (empty when not given),
  ``key``, ``dtype``, ``shape``, ``fp8``, ``scaling``, ``block_size``, ``raw_bytes``,
  ``frame_bytes``, ``frame``), each frame exactly ``Fp8Codec(options).encode`` of its block.
- :class:`Fp8Decoder`: rows with ``key`` and ``frame`` (an archive's parts, read with
  ``ray.data.read_parquet(ARCHIVE_DIR)``, or the encoder's output) back to raw-block
  rows (:data:`RAW_SCHEMA`; with ``with_file=True``, the rows' ``file`` column first,
  :data:`RAW_FILE_SCHEMA`), each block bit for bit ``fp8ray.decode`` of its frame.

Engine or Ray Data?

- The engine (``fp8ray compress`` / :func:`fp8ray.compress_archive`, ``decompress``,
  ``verify``) makes an *archive*: deterministic parts (the same bytes whatever the
  number of workers), a manifest written last with every part's CRC-32C, ``--resume``
  after an interruption, ``verify`` against the source, workers replaced when they die.
  Use it to store KV caches and get them back.
- Ray Data (these classes) fits *inside an existing Ray Data pipeline*: blocks stream
  from any reader through ``map_batches`` to any writer, with Ray Data's backpressure
  and autoscaling, but with no manifest, no part CRCs, no resume and no verify: each
  frame still carries its own CRC-32C, which the decoder checks. A directory written by
  ``write_parquet(Fp8Encoder output)`` is not an archive the engine reads (it has no
  manifest); an archive the engine wrote is read by Ray Data as it is (its
  ``_manifest.json`` and ``_part-*.json`` are skipped by Parquet readers).

Batch format: ``batch_format="pyarrow"`` is the one to use. The ``data`` and ``frame``
columns are then read as memoryviews of Arrow's own buffers and the output columns are
built over one buffer each, so the bytes are never copied between Ray Data and the
codec. ``"pandas"`` and ``"numpy"`` work too (for pipelines already in them), but Ray
Data then converts each binary value to a Python ``bytes`` object and back: one more
copy of every block on the way in. The output is a ``pyarrow.Table`` whatever the
input format (Ray Data accepts any).

Resources: these classes run as actors (``compute=ray.data.ActorPoolStrategy(size=N)``).
Give each the CPUs its codec threads use (``num_cpus=2, fn_constructor_kwargs={"threads":
2}``), and leave at least one CPU free for Ray Data's own tasks (listing files, reading):
on a 2-CPU machine two actors of ``num_cpus=1`` take both, and the pipeline waits
forever; use fractional CPUs there (``num_cpus=0.5``). With ``num_gpus=...`` the actors
encode and decode on their GPU (the same bytes as on the CPU).

Errors: Ray Data wraps an exception raised in a UDF in its ``UserCodeException`` (the
fp8ray class and message, naming the block's key, appear in its text). Set
``ray.data.DataContext.get_current().raise_original_map_exception = True`` to catch
fp8ray's own classes (``except fp8ray.CorruptFrameError``) around the pipeline.

Docs with a runnable example: docs/RAY_DATA.md.
"""

from .batches import RAW_FILE_SCHEMA, RAW_SCHEMA
from .decoder import Fp8Decoder
from .encoder import Fp8Encoder

__all__ = ["RAW_FILE_SCHEMA", "RAW_SCHEMA", "Fp8Decoder", "Fp8Encoder"]
