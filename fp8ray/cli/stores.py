"""``fp8ray lmcache-compress`` and ``lmcache-decompress``: LMCache filesystem stores."""

from __future__ import annotations

import json

from .common import engine_arguments, progress, warn


def add_commands(commands) -> None:
    from ..codec.formats import FORMATS

    for name, help_text in (
        ("lmcache-compress", "convert an LMCache filesystem store to the files of LMCache's fp8 serde"),
        ("lmcache-decompress", "convert an LMCache fp8-serde filesystem store back to the layout's dtype"),
    ):
        parser = commands.add_parser(name, help=help_text)
        parser.add_argument("source", help="the store's directory (LMCache's base_path)")
        parser.add_argument("destination", help="a new directory; renamed into place when every file is converted")
        parser.add_argument("--layout", required=True, help="dtype and shape of one chunk, e.g. bfloat16:2,30,256,192")
        parser.add_argument("--fp8", choices=sorted(FORMATS), default="e4m3fn", help="fp8 format of the store (default e4m3fn)")
        parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")
        engine_arguments(parser)
        parser.set_defaults(handler=run_store_command)


def run_store_command(args) -> int:
    from ..engine.stores import convert_store

    state: dict = {}

    def on_scan(total: int) -> None:
        state["bar"], state["update"] = progress(args, lambda: total)

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
            warn(f"skipped {skipped['name']}: {skipped['reason']}")
        print(
            f"{report.mode}ed {report.files} chunk files ({len(report.skipped)} skipped) into {report.destination}: "
            f"{report.bytes_before / 2**20:.1f} MiB -> {report.bytes_after / 2**20:.1f} MiB, "
            f"{report.input_gbps:.2f} GB/s of input on {report.workers} workers"
        )
    return 0
