"""``fp8ray lmcache-compress`` and ``lmcache-decompress``: LMCache filesystem stores."""

from __future__ import annotations

import json

from ..errors import InvalidOptionError
from .common import (
    codec_arguments,
    engine_arguments,
    given_codec_options,
    plain_form_argument,
    pool_settings,
    progress,
    rate,
    refuse_standard_output,
    warn,
    warn_each,
)

FRAME_OPTIONS = ("scaling", "block_size", "scale_dtype", "scale_choice")  # only frames have them


def add_commands(commands) -> None:
    from ..codec.names import FP8_CODES

    for name, help_text in (
        ("lmcache-compress", "convert an LMCache filesystem store to the files of LMCache's fp8 or fp8ray serde"),
        ("lmcache-decompress", "convert an LMCache fp8 or fp8ray store back to the layout's dtype"),
    ):
        parser = commands.add_parser(name, help=help_text)
        parser.add_argument("source", help="the store's directory (LMCache's base_path)")
        parser.add_argument("destination", help="a new directory; renamed into place when every file is converted")
        parser.add_argument("--layout", required=True, help="dtype and shape of one chunk, e.g. bfloat16:2,30,256,192")
        parser.add_argument(
            "--fp8",
            choices=sorted(FP8_CODES),
            default="e4m3fn",
            help="fp8 format of plain fp8 files, and of the frames written (default e4m3fn)",
        )
        if name == "lmcache-compress":
            parser.add_argument(
                "--serde",
                choices=("fp8", "fp8ray"),
                default="fp8",
                help="the LMCache serde whose files to write: fp8 (LMCache's own, 1 byte per element) or "
                "fp8ray (scaled, checked frames; fp8ray.lmcache.register()) (default fp8)",
            )
            codec_arguments(parser, (*FRAME_OPTIONS, "nonfinite"))
        parser.add_argument(
            "--overwrite",
            action="store_true",
            help="replace an existing destination holding only a store's files (once the new store is complete)",
        )
        parser.add_argument("--parents", action="store_true", help="create the destination's missing parent directories")
        parser.add_argument(
            "--expect-model",
            metavar="MODEL",
            help="refuse a store holding a chunk of another model (each chunk's file name records its model)",
        )
        plain_form_argument(parser)
        engine_arguments(parser)
        parser.set_defaults(handler=run_store_command)


def run_store_command(args) -> int:
    from ..codec import CodecOptions
    from ..engine.stores import convert_store
    from ..io.paths import printable, size_text

    compress = args.command == "lmcache-compress"
    target = args.serde if compress else "raw"
    given = given_codec_options(args) if compress else {}
    frame_options = sorted(set(given) & set(FRAME_OPTIONS))
    if frame_options and target != "fp8ray":
        flags = ", ".join("--" + o.replace("_", "-") for o in frame_options)
        raise InvalidOptionError(f"{flags} apply to --serde fp8ray only (plain fp8 files have no scales)", field="serde")
    options = CodecOptions.parse({**given, "fp8": args.fp8})
    refuse_standard_output(args.destination, f"{args.command} writes a store directory")
    state: dict = {}

    def on_scan(total: int) -> None:
        state["bar"], state["update"] = progress(args, lambda: total, unit="file")

    report = convert_store(
        args.source,
        args.destination,
        args.layout,
        target,
        options=options,
        pool=pool_settings(args),
        overwrite=args.overwrite,
        parents=args.parents,
        progress=lambda n: state.get("update") and state["update"](n),
        on_scan=on_scan,
        expect_model=args.expect_model,
        plain_form=args.plain_form,
        announce=warn,
    )
    if state.get("bar") is not None:
        state["bar"].close()
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))  # ensure_ascii: names come out escaped
        return 0
    warn_each([f"skipped {ascii(s['name'])}: {printable(s['reason'])}" for s in report.skipped], "skipped")
    if report.unchanged:
        warn(f"{len(report.unchanged)} chunk files were already {target} files: copied unchanged")
    sources = ", ".join(f"{n} {form}" for form, n in sorted(report.converted_from.items()))
    print(
        f"{report.mode}ed {report.files} chunk files ({sources}) to {target} into {printable(report.destination)} "
        f"({len(report.unchanged)} copied unchanged, {len(report.skipped)} skipped): "
        f"{size_text(report.bytes_before)} -> {size_text(report.bytes_after)}, "
        f"{rate(report.input_gbps)} of input on {report.workers} workers"
    )
    return 0
