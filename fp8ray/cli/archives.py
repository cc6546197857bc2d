"""``fp8ray compress``, ``decompress``, ``verify`` and ``inspect``: archives on the Ray engine;
``fp8ray get``: one block out of an archive, without Ray."""

from __future__ import annotations

import json

from ..io.lossless import DEFAULT_LOSSLESS
from ..io.provenance import Provenance
from .common import (
    codec_arguments,
    codec_options,
    engine_arguments,
    non_empty,
    plain_form_argument,
    pool_settings,
    positive_float,
    progress,
    rate,
    refuse_standard_output,
    warn,
    warn_each,
)


def _provenance_flags(parser, prefix: str, text: str) -> None:
    """A flag per provenance field (``--model``, ``--kv-layout``; ``prefix``: ``"expect-"``)."""
    for name in Provenance.names():
        what = name.replace("_", " ")
        parser.add_argument(f"--{prefix}{name.replace('_', '-')}", metavar=name.upper(), help=text.format(what))


def _provenance(args, prefix: str = "") -> dict[str, str]:
    """The provenance fields given on the command line (``prefix``: ``"expect_"``)."""
    return {name: getattr(args, prefix + name) for name in Provenance.names() if getattr(args, prefix + name) is not None}


def add_commands(commands) -> None:
    compress = commands.add_parser("compress", help="compress a safetensors file/directory or raw-block Parquet into an archive")
    compress.add_argument(
        "source", help="a .safetensors file, a directory tree of them (subfolders too), or raw-block Parquet; local or s3://"
    )
    compress.add_argument("destination", help="the archive directory to create (local or s3://)")
    codec_arguments(compress)
    compress.add_argument("--part-mb", type=positive_float, default=64.0, help="input MiB per Parquet part (default 64)")
    compress.add_argument(
        "--lossless",
        default=DEFAULT_LOSSLESS,
        metavar="CODEC[:LEVEL]",
        help=f"lossless stage over the frames: none, zstd[:1-22], lz4, ... (default {DEFAULT_LOSSLESS}); "
        f"decompress needs no flag",
    )
    compress.add_argument("--parents", action="store_true", help="create the destination's missing parent directories")
    compress.add_argument("--resume", action="store_true", help="keep the parts an interrupted run finished")
    compress.add_argument(
        "--strict",
        action="store_true",
        help="refuse a source directory holding anything compress does not take (other files, hidden names, "
        "links to folders, empty folders), which it otherwise names as skipped",
    )
    compress.add_argument(
        "--overwrite", action="store_true", help="replace an existing destination (never one that overlaps the source)"
    )
    compress.add_argument(
        "--lmcache-layout",
        metavar="DTYPE:SHAPE",
        help="SOURCE is an LMCache filesystem store (its base_path) whose chunks have this layout, e.g. "
        "bfloat16:2,30,256,192: every chunk file (raw, fp8 or fp8ray form; flat or in hash-prefix folders) is archived "
        "under its name",
    )
    plain_form_argument(compress, "with --lmcache-layout: ")
    _provenance_flags(compress, "", "record in the manifest the {} the cache was made for")
    engine_arguments(compress)
    compress.set_defaults(handler=run_compress)

    decompress = commands.add_parser(
        "decompress", help="give back what was compressed: the source's files, or one .safetensors file"
    )
    decompress.add_argument("archive", help="an fp8ray archive directory")
    decompress.add_argument(
        "output", help="where the source comes back: a directory for a directory source, else the file to write"
    )
    decompress.add_argument(
        "--single-file", action="store_true", help="every block into OUTPUT as one .safetensors file (keys must be unique)"
    )
    decompress.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output of the same kind that holds only files the archive describes (its source's too)",
    )
    decompress.add_argument(
        "--force-replace",
        action="store_true",
        help="replace an existing output directory even if it holds other files, deleting them (named first)",
    )
    decompress.add_argument("--parents", action="store_true", help="create the output's missing parent directories")
    decompress.add_argument(
        "--lmcache-form",
        choices=("raw", "fp8ray"),
        help="an archive of an LMCache store (compress --lmcache-layout) comes back as a store directory: raw chunk files "
        "(LMCache with no serde) or the archive's fp8ray frames (LMCache's fp8ray serde in the archive's options)",
    )
    _provenance_flags(decompress, "expect-", "refuse an archive that does not record this {} (from compress)")
    engine_arguments(decompress)
    decompress.set_defaults(handler=run_decompress)

    verify = commands.add_parser("verify", help="check every part and frame; with --against, error metrics per key")
    verify.add_argument("archive", help="an fp8ray archive directory")
    verify.add_argument(
        "--against", type=non_empty, metavar="SOURCE", help="the source it was compressed from: compare every block with it"
    )
    engine_arguments(verify, gpus=False)
    verify.set_defaults(handler=run_verify)

    inspect = commands.add_parser("inspect", help="print an archive's manifest summary")
    inspect.add_argument("archive", help="an fp8ray archive directory")
    inspect.add_argument("--json", action="store_true", help="print the manifest as JSON, with the ratio and any problems")
    inspect.set_defaults(handler=run_inspect)

    add_get_command(commands)


def _finish(args, bar, report, summary: str) -> None:
    if bar is not None:
        bar.close()
    print(json.dumps(report.as_dict(), indent=1) if args.json else summary)


def run_compress(args) -> int:
    from ..engine.archives import compress_archive
    from ..io.paths import counted, size_text

    options = codec_options(args)  # bad options fail before Ray starts
    refuse_standard_output(args.destination, "compress writes an archive directory")
    bars: dict = {}  # the bar, once the source is scanned (scanning it twice took seconds on a large tree)

    def on_scan(blocks: int) -> None:
        bars["bar"], bars["update"] = progress(args, lambda: blocks)

    report = compress_archive(
        args.source,
        args.destination,
        options=options,
        pool=pool_settings(args),
        resume=args.resume,
        overwrite=args.overwrite,
        parents=args.parents,
        strict=args.strict,
        part_bytes=max(1, int(args.part_mb * 2**20)),  # a part holds a block at least
        lossless=args.lossless,
        progress=lambda n: bars.get("update") and bars["update"](n),
        provenance=_provenance(args),
        lmcache_layout=args.lmcache_layout,
        lmcache_plain_form=args.plain_form,
        announce=warn,
        on_scan=on_scan,
    )
    _finish(
        args,
        bars.get("bar"),
        report,
        (
            f"compressed {counted(report.blocks, 'block')}"
            + _stored_note(report.stored)
            + f" into {counted(report.parts, 'part')} ({report.parts_reused} reused): "
            f"{size_text(report.raw_bytes)} -> {size_text(report.archive_bytes)} ({report.ratio:.2f}x), "
            f"{rate(report.input_gbps)} of input on {counted(report.workers, 'worker')} "
            f"({', '.join(report.devices) or 'no new parts'})" + skipped_summary(report.skipped)
        ),
    )
    return 0


def skipped_summary(skipped: list[dict]) -> str:
    """``"; skipped 2 files: README.txt, tenant_b/index.json"`` (folders end in ``/``), or
    nothing when a source tree was taken whole. Every one is in ``--json`` and the
    manifest, with why."""
    from ..io.paths import counted, name_list

    if not skipped:
        return ""
    folders = sum(s["name"].endswith("/") for s in skipped)
    files = len(skipped) - folders
    counts = [counted(n, word) for n, word in ((files, "file"), (folders, "folder")) if n]
    return f"; skipped {' and '.join(counts)}: {name_list([s['name'] for s in skipped])}"


def _manifest_blocks(uri: str) -> int:
    from ..io.archive import read_manifest
    from ..io.paths import resolve

    return read_manifest(*resolve(uri)).blocks


def run_decompress(args) -> int:
    from ..engine.archives import decompress_archive
    from ..io.paths import counted, size_text

    refuse_standard_output(  # as get takes it, not a file named '-'
        args.output, "decompress writes files", ", or write one block to standard output with fp8ray get ARCHIVE KEY -o -"
    )
    bar, update = progress(args, lambda: _manifest_blocks(args.archive))
    report = decompress_archive(
        args.archive,
        args.output,
        single_file=args.single_file,
        pool=pool_settings(args),
        overwrite=args.overwrite,
        force_replace=args.force_replace,
        parents=args.parents,
        progress=update,
        announce=warn,
        expect=_provenance(args, "expect_"),
        lmcache_form=args.lmcache_form,
    )
    as_store = f" as {args.lmcache_form} LMCache chunk files" if args.lmcache_form else ""
    serde = f'; LMCache\'s fs adapter loads it with "serde": {json.dumps(report.lmcache_serde)}' if report.lmcache_serde else ""
    _finish(
        args,
        bar,
        report,
        (
            f"decompressed {counted(report.blocks, 'block')} ({size_text(report.raw_bytes)}) "
            f"into {counted(report.files, 'file')}{as_store} at {report.output}, "
            f"{rate(report.output_gbps)} of output on {counted(args.workers, 'worker')}{serde}"
        ),
    )
    return 0


def run_verify(args) -> int:
    from ..engine.archives import verify_archive
    from ..io.paths import counted

    bar, update = progress(args, lambda: _manifest_blocks(args.archive))
    report = verify_archive(args.archive, against=args.against, pool=pool_settings(args), progress=update)
    summary = f"{counted(report.blocks, 'block')} in {counted(report.parts, 'part')}: "
    summary += "ok" if report.ok else counted(len(report.errors), "problem")
    if report.metrics:  # the fp8 blocks' (stored ones are exact, or an error)
        worst = max(report.metrics.items(), key=lambda kv: kv[1]["rel_fro"])
        summary += f"; worst relative error {worst[1]['rel_fro']:.3%} ({worst[0]!r})"
    if report.stored:
        summary += f"; {counted(len(report.stored), 'stored block')} identical to the source"
    _finish(args, bar, report, summary)
    if not report.ok:
        warn_each(report.errors, "problems")
        warn(f"error: archive {report.archive} failed verification ({counted(len(report.errors), 'problem')})")
        return 1
    return 0


def _stored_note(stored: int) -> str:
    """How many blocks are in stored frames, where any are: for a summary line."""
    return f" ({stored} stored as they are, not in fp8)" if stored else ""


def run_inspect(args) -> int:
    from dataclasses import asdict

    from ..engine.archives import inspect_archive
    from ..io.paths import counted, printable, redact, size_text

    report = inspect_archive(args.archive)
    manifest = report.manifest
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        skipped = [asdict(s) for s in manifest.layout.skipped] if manifest.layout else []
        print(
            f"{redact(args.archive)}: {counted(manifest.blocks, 'block')} in {counted(len(manifest.parts), 'part')}, "
            f"{manifest.options.label()}" + _stored_note(manifest.stored_blocks) + "; "
            f"{size_text(manifest.raw_bytes)} -> {size_text(manifest.archive_bytes)} ({report.ratio:.2f}x); "
            f"fp8ray {printable(manifest.fp8ray_version)}"
            + (f"; made for {manifest.provenance.describe()}" if manifest.provenance else "")
            + skipped_summary(skipped).replace("; skipped", "; the source's tree skipped")
        )
    if report.problems:
        warn_each(report.problems, "problems")
        warn(f"error: archive {redact(args.archive)} failed inspection ({counted(len(report.problems), 'problem')})")
        return 1
    return 0


def add_get_command(commands) -> None:
    get = commands.add_parser(
        "get", help="write one block of an archive to a .safetensors file, reading only that block (no Ray)"
    )
    get.add_argument("archive", help="an fp8ray archive directory (local or s3://)")
    get.add_argument("key", help="the block's key, as in its source file")
    get.add_argument(
        "--file",
        metavar="F",
        help="the source file holding the key, as the archive names it (needed where the key is in several files)",
    )
    get.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT.safetensors",
        help="the .safetensors file to write: the one block under its key, with its source file's __metadata__; "
        "'-' writes it to standard output",
    )
    get.add_argument("--overwrite", action="store_true", help="replace an existing OUT (once the new one is complete)")
    get.add_argument("--parents", action="store_true", help="create OUT's missing parent directories")
    get.set_defaults(handler=run_get)


def run_get(args) -> int:
    import sys

    import pyarrow.fs as pafs

    from ..errors import ArchiveExistsError, DestinationError
    from ..io.paths import (
        check_apart,
        check_not_special,
        os_reason,
        output_error,
        output_exists,
        prepare_parent,
        redact,
        remove_folders,
        resolve_output,
        write_all,
    )
    from ..io.reader import open_archive
    from ..io.safetensors import SafetensorsWriter, build_body

    to_stdout = args.output == "-"
    if to_stdout and sys.stdout is None:  # started with it closed (>&-)
        raise DestinationError("-o - writes to standard output, which is closed")
    if to_stdout and sys.stdout.isatty():  # as gzip and zstd refuse: binary on a terminal garbles it
        raise DestinationError("-o - writes a safetensors file's bytes, and standard output is a terminal: redirect or pipe it")
    if not to_stdout:  # the output is checked before anything is read
        check_apart(args.archive, args.output)
        fs, path = resolve_output(args.output)
        try:  # a name too long, a file where a folder should be: pyarrow's words, named once
            check_not_special(fs, path, args.output)  # '-' is the way to write to standard output
            if fs.get_file_info(path).type == pafs.FileType.Directory:
                raise DestinationError(f"output {redact(args.output)} is a directory; name the .safetensors file to write")
            if output_exists(fs, path) and not args.overwrite:  # a link to nothing too
                raise ArchiveExistsError(f"output {redact(args.output)} exists (pass --overwrite to replace it)")
            if not args.parents:  # a missing folder is refused now; --parents makes it once the block is read
                prepare_parent(fs, path, args.output, parents=False)
        except OSError as exc:
            raise output_error(args.output, exc) from None
    reader = open_archive(args.archive)
    file = args.file if args.file is not None else reader.file_of(args.key)  # an ambiguous key is refused, naming the files
    block = reader.block(args.key, file)  # a missing key is refused, naming the key and file
    metadata = reader.metadata(file) or None
    made = []  # folders --parents makes, after the refusals (they leave none behind); removed if the write fails
    if not to_stdout and args.parents:
        try:
            made = prepare_parent(fs, path, args.output, parents=True)
        except OSError as exc:
            raise output_error(args.output, exc) from None
    if to_stdout:
        try:
            write_all(sys.stdout.buffer, build_body([(args.key, block.dtype, block.shape, block.data)], metadata))
            sys.stdout.buffer.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:  # a full disk behind a redirection: its Errno said, not what was written
            raise DestinationError(f"cannot write to standard output (-o -): {os_reason(exc)}") from None
        return 0
    try:
        with SafetensorsWriter(args.output, [(args.key, block.dtype, block.shape)], metadata, replace=args.overwrite) as writer:
            writer.write(block.data)
    except BaseException as exc:
        remove_folders(made)
        if isinstance(exc, OSError):  # a full disk
            raise output_error(args.output, exc) from None
        raise
    of_file = f" of {file!r}" if file else ""  # a version 1 archive names no files
    print(f"wrote {args.key!r} ({block.dtype} {list(block.shape)}){of_file} to {redact(args.output)}")
    return 0
