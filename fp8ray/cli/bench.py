"""``fp8ray bench codec|pipeline|lossless|serve|lmcache|startup``: each figure beside a baseline from the same run."""

from __future__ import annotations

import argparse

from ..io.lossless import DEFAULT_LOSSLESS
from .common import codec_arguments, codec_options, given_codec_options, non_empty, positive_float, positive_int
from .serve import service_args, service_arguments


def add_commands(commands) -> None:
    from ..codec.names import DTYPE_CODES, SCALINGS

    bench = commands.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="kind", required=True)

    codec = kinds.add_parser("codec", help="codec throughput vs the torch reference and a memory copy")
    codec_arguments(codec, ("fp8", "block_size", "scale_dtype", "scale_choice"))
    codec.add_argument(
        "--scaling",
        choices=list(SCALINGS),
        action="append",
        help="repeatable (default: every scaling); the other codec options apply to each",
    )
    codec.add_argument("--dtype", choices=sorted(DTYPE_CODES), default="bfloat16", help="input dtype (default bfloat16)")
    codec.add_argument("--chunks", type=positive_int, default=4, help="sample chunks of [2, 30, TOKENS, 192] (default 4)")
    codec.add_argument(
        "--tokens", type=positive_int, default=256, help="tokens per sample chunk (default 256; fewer for a quick run)"
    )
    codec.add_argument("--repeat", type=positive_int, default=5, help="timed runs per figure; the median is shown (default 5)")
    codec.set_defaults(handler=run_bench_codec)

    pipeline = kinds.add_parser("pipeline", help="compress and decompress against the machine's I/O bound, and the object store")
    pipeline.add_argument(
        "--mib",
        type=positive_int,
        default=512,
        help="MiB of bf16 sample KV cache, in whole 5.6 MiB chunks, at least one per file (default 512)",
    )
    pipeline.add_argument("--max-workers", type=positive_int, default=2, help="measure 1 to N workers (default 2)")
    codec_arguments(pipeline)
    pipeline.add_argument(
        "--files", type=positive_int, default=8, help="safetensors files the source is spread over; 1: a single file (default 8)"
    )
    pipeline.add_argument(
        "--small-block-kib",
        type=positive_int,
        default=16,
        metavar="KIB",
        help="the small-blocks row cuts the same bytes into blocks of this many KiB (a divisor of a "
        "sample chunk's 5760 KiB, smaller than it; default 16)",
    )
    pipeline.add_argument(
        "--lossless",
        default=DEFAULT_LOSSLESS,
        metavar="CODEC[:LEVEL]",
        help=f"the archive's lossless stage (default {DEFAULT_LOSSLESS})",
    )
    pipeline.add_argument(
        "--address", type=non_empty, help="Ray cluster to join, or inline (default: RAY_ADDRESS, else an embedded local Ray)"
    )
    pipeline.add_argument("--repeat", type=positive_int, default=3, help="runs per figure; the median is shown (default 3)")
    pipeline.set_defaults(handler=run_bench_pipeline)

    lossless = kinds.add_parser("lossless", help="archive size and speed of each lossless stage on a real KV cache")
    lossless.add_argument(
        "--source",
        type=non_empty,
        help="a KV cache in one .safetensors file, captured from the shipped model if missing (default: "
        "fp8ray demo's capture in out/demo, of --tokens tokens)",
    )
    lossless.add_argument(
        "--tokens",
        type=positive_int,
        help="when --source is missing, capture only the first N tokens of the shipped text (default: all of it)",
    )
    lossless.add_argument(
        "--stages", default="none,lz4,zstd:1,zstd:3,zstd:6", help="comma-separated (default none,lz4,zstd:1,zstd:3,zstd:6)"
    )
    codec_arguments(lossless)
    lossless.add_argument("--workers", type=positive_int, default=2, help="QuantWorker actors (default 2)")
    lossless.add_argument("--repeat", type=positive_int, default=5, help="runs per figure; the median is shown (default 5)")
    lossless.set_defaults(handler=run_bench_lossless)

    serve = kinds.add_parser(
        "serve", help="HTTP service throughput and latency vs a bare FastAPI/uvicorn app, with CPU per request by process"
    )
    serve.add_argument("--sizes", default="64K,1M,16M", help="block sizes, comma-separated, K/M suffixes (default 64K,1M,16M)")
    serve.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight (default 8)")
    serve.add_argument("--mib-per-size", type=positive_float, default=256.0, help="MiB sent per block size (default 256)")
    service_arguments(serve)
    serve.set_defaults(handler=run_bench_serve)

    lmcache = kinds.add_parser("lmcache", help="fp8ray's serde inside LMCache vs LMCache's own fp8 serde, on a real KV cache")
    lmcache.add_argument(
        "--mode",
        action="append",
        dest="modes",
        metavar="FP8:SCALING[:key=value...]",
        help="an fp8ray mode to measure, repeatable (default: the default mode and its fast alternative, "
        "e4m3fn:block:block_size=32:scale_dtype=bfloat16:scale_choice=amax)",
    )
    lmcache.add_argument("--tokens", type=positive_int, default=512, help="tokens of the shipped text to capture (default 512)")
    lmcache.add_argument("--chunk-tokens", type=positive_int, default=256, help="tokens per LMCache chunk (default 256)")
    lmcache.add_argument("--max-workers", type=positive_int, default=1, help="AsyncSerdeProcessor threads (default 1, LMCache's)")
    lmcache.add_argument(
        "--copies",
        type=positive_int,
        default=8,
        help="copies of the chunks each run stores, each in memory of its own (default 8: 16 chunks, 94 MB, more than "
        "the CPU's cache holds, as LMCache's chunks are when it stores them; 1: the same chunks every run, from the cache)",
    )
    lmcache.add_argument("--repeat", type=positive_int, default=9, help="timed runs per figure; the median is shown (default 9)")
    lmcache.set_defaults(handler=run_bench_lmcache)

    startup = kinds.add_parser(
        "startup", help="wall time of fp8ray --help beside python -c pass; of a one-shot compress beside its work"
    )
    startup.add_argument("--repeat", type=positive_int, default=9, help="runs of each; the best is shown (default 9)")
    startup.add_argument(
        "--compress-mib",
        type=lambda text: [positive_float(size) for size in text.split(",")],
        metavar="M[,M...]",
        help="also time `fp8ray compress` of a bf16 file of each size (MiB) beside its work (e.g. 1,512)",
    )
    startup.add_argument(
        "--addresses",
        type=address_list,
        default=["inline", "default"],
        metavar="A[,A...]",
        help="the --address of each compress timed; 'default' gives none (default inline,default)",
    )
    startup.set_defaults(handler=run_bench_startup)


def address_list(text: str) -> list[str]:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:  # the work done, then an empty table
        raise argparse.ArgumentTypeError(f"names no address: {text!r}")
    return addresses


def run_bench_codec(args) -> int:
    import torch

    from ..bench.codec import bench_codec, describe_machine, format_table
    from ..codec import CodecOptions
    from ..codec.formats import SCALINGS
    from ..errors import InvalidOptionError

    # --scaling is a list here (a row each): the other options apply to every row, but
    # --block-size to block's only.
    given = given_codec_options(args)
    given.pop("scaling", None)
    CodecOptions.parse(given)  # a bad value fails here, not as every row left out
    modes = []
    for scaling in args.scaling or SCALINGS:
        options = {**given, "scaling": scaling}
        if scaling != "block":
            options.pop("block_size", None)
        try:
            modes.append(CodecOptions.parse(options))
        except InvalidOptionError:
            if args.scaling:  # asked for: say why it cannot be measured
                raise
            # else a scaling the given options do not apply to (mse needs token or block)
    rows, costs = bench_codec(modes, getattr(torch, args.dtype), args.chunks, args.repeat, args.tokens)
    title = f"fp8ray bench codec: {args.dtype} input, {args.chunks} x [2, 30, {args.tokens}, 192]\n{describe_machine()}"
    print(format_table(rows, costs, title))
    return 0


def run_bench_pipeline(args) -> int:
    from ..bench.pipeline import bench_pipeline

    print(
        bench_pipeline(
            args.mib,
            args.max_workers,
            codec_options(args),
            args.repeat,
            args.lossless,
            args.address,
            args.files,
            args.small_block_kib,
        )
    )
    return 0


def run_bench_lossless(args) -> int:
    import os

    from ..bench.lossless import bench_lossless
    from ..errors import InvalidOptionError, SourceError
    from ..io.archive import canonical_lossless, parse_lossless
    from .demo import DEMO_DIR, captured_cache

    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    for stage in stages:
        parse_lossless(stage)
    # A row each: none, or one run twice as often (zstd:03 is zstd:3).
    if not stages or len({canonical_lossless(stage) for stage in stages}) < len(stages):
        raise InvalidOptionError(f"--stages {args.stages!r}: name each lossless stage once", field="stages")
    # The demo's capture of as many tokens by default: one of fewer is never taken for it.
    source = args.source if args.source is not None else str(captured_cache(DEMO_DIR, args.tokens))
    if os.path.exists(source):
        if not os.path.isfile(source):
            raise SourceError(f"--source {source} is not a file: give one .safetensors file")
        if args.source is not None and args.tokens is not None:  # it would not be captured again
            raise InvalidOptionError(f"--tokens captures a missing --source, and {source} exists", field="tokens")
    else:
        from ..eval.capture import capture
        from ..eval.eval_model import DEFAULT_TEXT

        if not source.endswith(".safetensors"):  # before its folder is made
            raise SourceError(f"--source {source} does not exist, and a capture is written to a .safetensors file")
        os.makedirs(os.path.dirname(source) or ".", exist_ok=True)
        capture(source, DEFAULT_TEXT, tokens=args.tokens)
    print(bench_lossless(source, stages, codec_options(args), args.workers, args.repeat))
    return 0


def run_bench_serve(args) -> int:
    from ..bench.serve import bench_serve, parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(bench_serve(sizes, args.concurrency, int(args.mib_per_size * 2**20), service_args(args)))
    return 0


def run_bench_lmcache(args) -> int:
    import os

    from ..bench.lmcache import FAST_MODE, bench_lmcache, capture_chunks, describe, format_table
    from ..codec import CodecOptions
    from ..errors import InvalidOptionError

    modes = [CodecOptions.from_mode(m) for m in args.modes] if args.modes else [CodecOptions(), CodecOptions.from_mode(FAST_MODE)]
    if args.tokens < args.chunk_tokens:
        raise InvalidOptionError(
            f"--tokens {args.tokens} is less than one chunk of --chunk-tokens {args.chunk_tokens}", field="tokens"
        )
    from ..lmcache.registry import lmcache_serde_classes

    lmcache_serde_classes()  # LMCache not installed: said now, not after the model's capture (a minute)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # before this run's own work
    chunks = capture_chunks(args.tokens, args.chunk_tokens)
    chunks = [c for c in chunks if c.shape == chunks[0].shape]  # full chunks only: one layout, as a store has
    rows = bench_lmcache(chunks, modes, args.repeat, args.max_workers, args.copies)
    print(format_table(rows, describe(chunks, args.tokens, args.max_workers, load, args.copies)))
    return 0


def run_bench_startup(args) -> int:
    from ..bench.startup import bench_compress, bench_startup

    print(bench_startup(args.repeat))
    if args.compress_mib:
        print(bench_compress(args.compress_mib, args.addresses, args.repeat))
    return 0
