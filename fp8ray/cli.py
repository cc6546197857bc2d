"""The ``fp8ray`` command line. Thin: it parses arguments and calls the library."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .formats import DTYPE_NAMES, FORMATS, SCALINGS


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8ray", description="Compress LLM KV caches to fp8.")
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="kind", required=True)
    codec = bench_kinds.add_parser("codec", help="codec throughput vs the torch reference and a memory copy")
    codec.add_argument("--fp8", choices=sorted(FORMATS), default="e4m3fn")
    codec.add_argument("--dtype", choices=sorted(DTYPE_NAMES.values()), default="bfloat16")
    codec.add_argument("--chunks", type=_positive_int, default=4, help="sample chunks of [2, 30, 256, 192] (default 4)")
    codec.add_argument("--block-size", type=_positive_int, default=128)
    codec.add_argument("--repeat", type=_positive_int, default=5)
    codec.add_argument("--scaling", choices=list(SCALINGS), action="append", help="repeatable; default all")

    demo = commands.add_parser("demo", help="compress a sample KV cache and report size, error and speed")
    demo.add_argument("--out", type=Path, default=Path("out/demo"))
    demo.add_argument("--chunks", type=_positive_int, default=8)
    demo.add_argument("--fp8", choices=sorted(FORMATS), default="e4m3fn")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            from .bench import bench_codec, describe_machine, format_table

            dtype = {v: k for k, v in DTYPE_NAMES.items()}[args.dtype]
            rows = bench_codec(
                args.fp8, dtype, args.chunks, args.block_size, args.repeat, tuple(args.scaling or SCALINGS)
            )
            title = f"fp8ray bench codec: {args.fp8}, {args.dtype} input, {args.chunks} x [2, 30, 256, 192]\n{describe_machine()}"
            print(format_table(rows, title))
        elif args.command == "demo":
            from .demo import run_demo

            print(run_demo(args.out, args.chunks, args.fp8))
    except (ValueError, TypeError, OSError) as exc:
        print(f"fp8ray: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
