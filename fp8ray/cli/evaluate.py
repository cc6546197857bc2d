"""``fp8ray capture``, ``fidelity`` and ``eval-model``: real KV caches and what fp8 does to them."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from ..errors import DestinationError, InvalidOptionError
from .common import json_argument, non_empty, positive_int, refuse_standard_output, warn

SHIPPED_TEXT = "fp8ray/eval/texts/lighthouse.txt"


def add_commands(commands) -> None:
    from ..codec.names import DTYPE_CODES

    capture = commands.add_parser("capture", help="run a causal LM over a text and save its KV cache as safetensors blocks")
    capture.add_argument("--out", required=True, help="the .safetensors file to write")
    capture.add_argument("--text", type=non_empty, required=True, help="a UTF-8 text file")
    capture.add_argument("--tokens", type=positive_int, help="capture the text's first N tokens (default: all)")
    capture.add_argument(
        "--model",
        type=non_empty,
        help="a .gguf file or Hugging Face model directory (default: the shipped SmolLM2-135M-Instruct)",
    )
    capture.add_argument(
        "--dtype", choices=sorted(DTYPE_CODES), default="bfloat16", help="dtype of the saved blocks (default bfloat16)"
    )
    capture.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    json_argument(capture)
    capture.set_defaults(handler=run_capture)

    fidelity = commands.add_parser("fidelity", help="error per key, per layer and K/V of an archive against its original")
    fidelity.add_argument("original", help="safetensors file or directory (or raw-block Parquet)")
    fidelity.add_argument("archive", help="fp8ray archive directory")
    fidelity.add_argument(
        "--key-pattern",
        help="regex with named groups layer and kv (k|v|key|value) for per-key tensors; searched, case-insensitive "
        "(default: names such as layer07.k, model.layer_7-v, layer7/value)",
    )
    json_argument(fidelity)
    fidelity.add_argument(
        "--plot",
        metavar="FILE",
        help="write relative error per layer for K and V to this image (.png, .svg, .pdf: from its suffix)",
    )
    fidelity.add_argument("--overwrite", action="store_true", help="replace an existing --plot file")
    fidelity.set_defaults(handler=run_fidelity)

    evaluate = commands.add_parser(
        "eval-model", help="the model's output change (KL, top-1, perplexity) per fp8 mode of its KV cache"
    )
    evaluate.add_argument("--text", type=non_empty, help=f"a UTF-8 text file (default: the shipped {SHIPPED_TEXT})")
    evaluate.add_argument("--prefix", type=positive_int, default=256, help="tokens whose cache is round-tripped (default 256)")
    evaluate.add_argument(
        "--continuation", type=positive_int, default=128, help="tokens fed after it, teacher-forced (default 128)"
    )
    evaluate.add_argument(
        "--modes",
        action="append",
        metavar="MODES",
        help="comma-separated FP8:SCALING[:key=value...] (the default mode's other options apply) or bfloat16/float16; "
        "repeatable (default: bfloat16 and every format x scaling); the reference row is always first",
    )
    evaluate.add_argument(
        "--model",
        type=non_empty,
        help="a .gguf file or Hugging Face model directory (default: the shipped SmolLM2-135M-Instruct)",
    )
    output = evaluate.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the rows as JSON")
    output.add_argument("--markdown", action="store_true", help="print a Markdown table (default: an aligned text table)")
    evaluate.add_argument(
        "--plot", metavar="FILE", help="also save a bar chart of KL per mode (format from its suffix: .png, .svg, .pdf)"
    )
    evaluate.add_argument("--overwrite", action="store_true", help="replace an existing --plot file")
    evaluate.set_defaults(handler=run_eval_model)


def check_output(option: str, path: str, *reads: str | None) -> None:
    """Refuse, before any work, an output ``path`` that is, holds or lies inside a file or
    directory the command reads (``reads``; None skipped): writing it could destroy what
    is read; or that is a device or a FIFO (its rename would put a file in its place).
    Its directory must exist, and take a new file (a read-only one was found only as the
    output was written, after the model ran)."""
    from ..io.paths import check_apart, check_not_special, os_reason, resolve

    refuse_standard_output(path, f"{option} writes a file")
    try:
        check_not_special(*resolve(path), path)
    except DestinationError as exc:
        raise DestinationError(f"{option}: {exc}") from None
    for read in reads:
        if read is not None:
            try:
                check_apart(str(read), path)
            except DestinationError as exc:
                raise DestinationError(f"{option}: {exc}") from None
    parent = Path(path).resolve().parent  # a link's target's (a link to nothing included)
    if not parent.is_dir():
        raise DestinationError(f"{option}: directory {parent} does not exist")
    try:  # a file made and removed: permissions, a read-only mount, ACLs, as the write will meet them
        fd, probe = tempfile.mkstemp(prefix=".fp8ray-check-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DestinationError(f"{option}: cannot write in directory {parent}: {os_reason(exc)}") from None


def check_plot(path: str | None, overwrite: bool, *reads: str | None) -> None:
    """:func:`check_output` of a ``--plot`` file, and its format (from its suffix), before
    any work; an existing one is replaced only with ``overwrite``, as every output is,
    which without a ``--plot`` (None) replaces nothing and is refused."""
    from ..errors import ArchiveExistsError
    from ..eval.plots import plot_format

    if path is None:
        if overwrite:
            raise InvalidOptionError("--overwrite replaces a --plot file: give --plot FILE, or leave --overwrite out")
        return

    check_output("--plot", path, *reads)
    if Path(path).is_dir():  # found only as it was written, after a long run
        raise DestinationError(f"--plot: {path} is a directory; name a file")
    plot_format(path)
    if os.path.lexists(path) and not overwrite:
        raise ArchiveExistsError(f"--plot: {path} already exists (pass --overwrite to replace it)")


def model_read(model: str | None) -> str | None:
    """The model file or directory a command will read: ``--model``, else the shipped
    GGUF file (None if it is missing: loading it reports that)."""
    if model is not None:
        return model
    from ..errors import SourceError
    from ..eval.models import shipped_model_path

    try:
        return str(shipped_model_path())
    except SourceError:
        return None


def run_capture(args) -> int:
    from ..eval.capture import capture
    from ..io.paths import size_text

    check_output("--out", args.out, args.text, model_read(args.model))
    report = capture(args.out, args.text, args.tokens, args.model, args.dtype, args.overwrite)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(
            f"captured {report.tokens} tokens of {report.model}: {2 * report.layers} blocks of "
            f"[{report.kv_heads}, {report.tokens}, {report.head_dim}] {report.dtype} "
            f"({size_text(report.bytes)}) in {report.path}"
        )
    return 0


def run_fidelity(args) -> int:
    from ..eval.fidelity import DEFAULT_KEY_PATTERN, fidelity_report, format_report, plot_layers

    key_pattern = DEFAULT_KEY_PATTERN if args.key_pattern is None else args.key_pattern
    check_plot(args.plot, args.overwrite, args.original, args.archive)
    report = fidelity_report(args.original, args.archive, key_pattern=key_pattern)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, allow_nan=False))
    else:
        print(format_report(report))
    if args.plot is not None:  # after the report: a plot that cannot be drawn does not lose it
        sys.stdout.flush()
        plot_layers(report, args.plot)
        if not args.json:
            warn(f"plot written to {args.plot}")
    return 0


def run_eval_model(args) -> int:
    from ..eval.eval_model import (
        DEFAULT_MODES,
        DEFAULT_TEXT,
        evaluate_text,
        format_markdown,
        format_text,
        plot,
        report_dict,
    )

    text = args.text or str(DEFAULT_TEXT)
    for group in args.modes or ():  # "--modes ,", "a,,b": refused before the model loads, not run as fewer modes
        if not all(m.strip() for m in group.split(",")):
            raise InvalidOptionError(f"--modes {group!r} has an empty mode: name each mode, separated by commas", field="modes")
    modes = [m for group in args.modes for m in group.split(",")] if args.modes else list(DEFAULT_MODES)
    check_plot(args.plot, args.overwrite, text, model_read(args.model))
    loaded, results = evaluate_text(text, args.prefix, args.continuation, modes, args.model)
    title = (
        f"fp8ray eval-model: {loaded.name} ({str(loaded.dtype).removeprefix('torch.')}), {Path(text).name}, "
        f"prefix {args.prefix} + continuation {args.continuation} tokens"
    )
    if args.json:
        report = report_dict(loaded.name, text, args.prefix, args.continuation, results)
        print(json.dumps(report, indent=1, allow_nan=False))
    else:
        print(title + "\n")
        print(format_markdown(results) if args.markdown else format_text(results))
    if args.plot:  # after the results: a plot that cannot be drawn does not lose them
        sys.stdout.flush()
        plot(results, args.plot, title)
    return 0
