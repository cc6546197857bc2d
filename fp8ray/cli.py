"""The ``fp8ray`` command line. Thin: it parses arguments and calls the library."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path


from .errors import Fp8rayError
from .formats import DTYPE_NAMES, FORMATS, SCALE_CHOICES, SCALE_DTYPES, SCALINGS


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


# Commands that live beside the feature they drive. Each module has
# ``add_commands(commands, bench_kinds)`` that adds its subparsers with
# ``set_defaults(handler=run)``, where ``run(args) -> int``; it imports heavy packages
# (transformers, Ray Serve) inside ``run`` so ``fp8ray --help`` stays fast.
COMMAND_MODULES: tuple[str, ...] = ("fp8ray.serve_cli", "fp8ray.fidelity", "fp8ray.lmcache_store", "fp8ray.capture", "fp8ray.evalmodel")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8ray", description="Compress LLM KV caches to fp8.")
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="kind", required=True)
    codec = bench_kinds.add_parser("codec", help="codec throughput vs the torch reference and a memory copy")
    codec.add_argument("--fp8", choices=sorted(FORMATS), default="e4m3fn")
    codec.add_argument("--dtype", choices=sorted(DTYPE_NAMES.values()), default="bfloat16")
    codec.add_argument("--chunks", type=positive_int, default=4, help="sample chunks of [2, 30, 256, 192] (default 4)")
    codec.add_argument("--block-size", type=positive_int, default=128)
    codec.add_argument("--repeat", type=positive_int, default=5)
    codec.add_argument("--scaling", choices=list(SCALINGS), action="append", help="repeatable; default all, and block 32 bfloat16 mse")
    codec.add_argument("--scale-dtype", choices=list(SCALE_DTYPES), default="float32")
    codec.add_argument("--scale-choice", choices=list(SCALE_CHOICES), default="amax", help="mse: token and block scaling only")

    compress = commands.add_parser("compress", help="compress a safetensors file/directory or raw-block Parquet into an archive")
    compress.add_argument("source")
    compress.add_argument("destination")
    # No codec option given: the KV default mode (fp8ray.formats.KV_DEFAULTS); any given:
    # the others as Fp8Codec defaults them (e4m3fn, tensor, 128, float32, amax).
    kv = "with no codec option: e4m3fn, block 32, bfloat16 scales, mse"
    compress.add_argument("--fp8", choices=sorted(FORMATS), help="default e4m3fn")
    compress.add_argument("--scaling", choices=list(SCALINGS), help=f"default tensor ({kv})")
    compress.add_argument("--block-size", type=positive_int, help="elements per block scale (default 128)")
    compress.add_argument("--scale-dtype", choices=list(SCALE_DTYPES), help="default float32")
    compress.add_argument("--scale-choice", choices=list(SCALE_CHOICES), help="default amax; mse: least-error scales (token, block)")
    compress.add_argument("--part-mb", type=positive_float, default=64.0, help="input MiB per Parquet part (default 64)")
    compress.add_argument("--resume", action="store_true", help="keep the parts an interrupted run finished")
    compress.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    engine_arguments(compress)

    decompress = commands.add_parser("decompress", help="decode an archive into a .safetensors file")
    decompress.add_argument("archive")
    decompress.add_argument("output")
    decompress.add_argument("--overwrite", action="store_true")
    engine_arguments(decompress)

    verify = commands.add_parser("verify", help="check every part and frame; with --against, error metrics per key")
    verify.add_argument("archive")
    verify.add_argument("--against", metavar="SOURCE")
    engine_arguments(verify, gpus=False)

    inspect = commands.add_parser("inspect", help="print an archive's manifest summary")
    inspect.add_argument("archive")
    inspect.add_argument("--json", action="store_true")

    pipeline = bench_kinds.add_parser("pipeline", help="end-to-end compress on a local Ray vs the codec alone")
    pipeline.add_argument("--chunks", type=positive_int, default=16)
    pipeline.add_argument("--max-workers", type=positive_int, default=2)
    pipeline.add_argument("--scaling", choices=list(SCALINGS), help="default: the KV default mode (block 32, bfloat16 scales, mse)")
    pipeline.add_argument("--repeat", type=positive_int, default=3)

    demo = commands.add_parser("demo", help="capture a real KV cache, compress, verify, measure and decompress it on a local Ray")
    demo.add_argument("--out", type=Path, default=Path("out/demo"))
    demo.add_argument("--tokens", type=positive_int, help="tokens of the shipped text to capture (default: all, about 880)")
    demo.add_argument("--fp8", choices=sorted(FORMATS), help="default e4m3fn")
    demo.add_argument("--scaling", choices=list(SCALINGS), help="default tensor (with no codec option: e4m3fn, block 32, bfloat16 scales, mse)")
    demo.add_argument("--workers", type=positive_int, default=2)

    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(commands, bench_kinds)
    return parser


def engine_arguments(parser: argparse.ArgumentParser, gpus: bool = True) -> None:
    parser.add_argument("--workers", type=positive_int, default=2, help="QuantWorker actors (default 2)")
    if gpus:
        parser.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs per worker; fractions share one")
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (no progress bar)")


def _progress(args, total):
    """A tqdm bar on stderr for interactive runs; None under --json or without a TTY.
    ``total`` is a callable, so the blocks are counted only when a bar is shown."""
    if args.json or not sys.stderr.isatty():
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=total(), unit="block", file=sys.stderr)
    return bar, bar.update


def _run_engine_command(args) -> int:
    from . import operations
    from .archive import read_manifest
    from .sources import list_blocks, resolve

    if args.command == "compress":
        bar, update = _progress(args, lambda: len(list_blocks(args.source)))
        report = operations.compress_archive(
            args.source, args.destination, fp8=args.fp8, scaling=args.scaling, block_size=args.block_size,
            scale_dtype=args.scale_dtype, scale_choice=args.scale_choice,
            workers=args.workers, gpus_per_worker=args.gpus_per_worker, address=args.address,
            resume=args.resume, overwrite=args.overwrite, part_bytes=int(args.part_mb * 2**20), progress=update,
        )
        summary = (
            f"compressed {report.blocks} blocks into {report.parts} parts ({report.parts_reused} reused): "
            f"{report.raw_bytes / 2**20:.1f} MiB -> {report.archive_bytes / 2**20:.1f} MiB ({report.ratio:.2f}x), "
            f"{report.input_gbps:.2f} GB/s of input on {report.workers} workers ({', '.join(report.devices) or 'no new parts'})"
        )
    elif args.command == "decompress":
        bar, update = _progress(args, lambda: read_manifest(*resolve(args.archive))["blocks"])
        report = operations.decompress_archive(
            args.archive, args.output, workers=args.workers, gpus_per_worker=args.gpus_per_worker,
            address=args.address, overwrite=args.overwrite, progress=update,
        )
        summary = f"decompressed {report.blocks} blocks ({report.raw_bytes / 2**20:.1f} MiB) into {report.output}"
    else:
        bar, update = _progress(args, lambda: read_manifest(*resolve(args.archive))["blocks"])
        report = operations.verify_archive(args.archive, against=args.against, workers=args.workers, address=args.address, progress=update)
        summary = f"{report.blocks} blocks in {report.parts} parts: " + ("ok" if report.ok else f"{len(report.errors)} problem(s)")
        if report.metrics:
            worst = max(report.metrics.items(), key=lambda kv: kv[1]["rel_fro"])
            summary += f"; worst relative error {worst[1]['rel_fro']:.3%} ({worst[0]!r})"
    if bar is not None:
        bar.close()
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(summary)
    if args.command == "verify" and not report.ok:
        for error in report.errors:
            print(f"fp8ray: {error}", file=sys.stderr)
        print(f"fp8ray: error: archive {args.archive} failed verification ({len(report.errors)} problem(s))", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "handler", None) is not None:
            return args.handler(args)
        if args.command == "bench" and args.kind == "pipeline":
            from .bench import bench_pipeline

            print(bench_pipeline(args.chunks, args.max_workers, args.scaling, args.repeat))
        elif args.command == "bench":
            from .bench import KV_MODE, bench_codec, describe_machine, format_table

            dtype = {v: k for k, v in DTYPE_NAMES.items()}[args.dtype]
            rows = bench_codec(
                args.fp8, dtype, args.chunks, args.block_size, args.repeat, tuple(args.scaling or SCALINGS),
                args.scale_dtype, args.scale_choice, extra_modes=() if args.scaling else (KV_MODE,),
            )
            title = f"fp8ray bench codec: {args.fp8}, {args.dtype} input, {args.chunks} x [2, 30, 256, 192]\n{describe_machine()}"
            print(format_table(rows, title))
        elif args.command in ("compress", "decompress", "verify"):
            return _run_engine_command(args)
        elif args.command == "inspect":
            from .operations import inspect_archive

            info = inspect_archive(args.archive)
            if args.json:
                print(json.dumps(info, indent=1))
            else:
                codec = info["codec"]
                print(
                    f"{args.archive}: {info['blocks']} blocks in {len(info['parts'])} parts, {codec['fp8']} / {codec['scaling']}"
                    f"{' / block ' + str(codec['block_size']) if codec['scaling'] == 'block' else ''}"
                    f" / {codec.get('scale_dtype', 'float32')} scales by {codec.get('scale_choice', 'amax')}; "
                    f"{info['raw_bytes'] / 2**20:.1f} MiB -> {info['archive_bytes'] / 2**20:.1f} MiB ({info['ratio']:.2f}x); "
                    f"fp8ray {info['fp8ray_version']}"
                )
        elif args.command == "demo":
            from .demo import run_demo

            print(run_demo(args.out, args.tokens, args.workers, fp8=args.fp8, scaling=args.scaling))
    except ImportError as exc:  # an optional extra that is not installed
        print(f"fp8ray: error: {exc}; install fp8ray with its extras: pip install 'fp8ray[models,serve]'", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError, Fp8rayError) as exc:
        print(f"fp8ray: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
