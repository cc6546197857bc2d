"""What every command shares: argument types, the codec and engine options, the
progress bar and printing. Nothing here loads torch, pyarrow or Ray: help is built from it."""

from __future__ import annotations

import argparse
import sys

from ..codec.names import CHOICES, DEFAULT_MODE, OPTION_NAMES, mode_label


def non_empty(text: str) -> str:
    """A string option's value, refused when empty: ``--against "$SRC"`` with SRC unset
    must not run as if the option were left out."""
    if not text:
        raise argparse.ArgumentTypeError("is empty: give a value, or leave the option out")
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def port_number(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 1 to 65535, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


_CODEC_HELP = {
    "fp8": "fp8 format",
    "scaling": "one scale per tensor, channel (last dim index), token (last dim row) or block",
    "block_size": "elements per scale under block scaling",
    "scale_dtype": "how each scale is stored",
    "scale_choice": "amax, or mse: the least-squared-error scale of 8 (token and block scaling)",
    "nonfinite": "error refuses NaN/inf input; keep stores it",
}


def codec_arguments(parser: argparse.ArgumentParser, names: tuple[str, ...] = OPTION_NAMES) -> None:
    """``--fp8``, ``--scaling``, ... for the codec options ``names``. Each left out keeps
    the default mode's value; each given overrides only itself."""
    group = parser.add_argument_group(
        "codec options", f"default mode: {mode_label(**DEFAULT_MODE)}; an option given overrides only itself"
    )
    for name in names:
        flag = "--" + name.replace("_", "-")
        default = DEFAULT_MODE[name]
        if name == "scale_choice":
            shown = "mse for token and block scaling, else amax"
        else:
            shown = str(default)
        if name == "block_size":
            group.add_argument(flag, type=positive_int, metavar="N", help=f"{_CODEC_HELP[name]} (default {shown})")
        else:
            group.add_argument(flag, choices=CHOICES[name], help=f"{_CODEC_HELP[name]} (default {shown})")


def given_codec_options(args: argparse.Namespace) -> dict:
    """The codec options given on the command line, by name; ``--block-size`` refused
    where it would do nothing (another scaling than block)."""
    given = {name: getattr(args, name) for name in OPTION_NAMES if getattr(args, name, None) is not None}
    scalings = given.get("scaling", DEFAULT_MODE["scaling"])
    scalings = scalings if isinstance(scalings, list) else [scalings]  # bench codec's: a row each
    if "block_size" in given and "block" not in scalings:
        from ..errors import InvalidOptionError

        raise InvalidOptionError(f"--block-size applies to --scaling block, not {', '.join(scalings)}", field="block_size")
    return given


def codec_options(args: argparse.Namespace):
    """The :class:`~fp8ray.codec.CodecOptions` the command line gave, over the default mode."""
    from ..codec.options import CodecOptions

    return CodecOptions.parse(given_codec_options(args))


def engine_arguments(parser: argparse.ArgumentParser, gpus: bool = True) -> None:
    group = parser.add_argument_group("engine options")
    group.add_argument("--workers", type=positive_int, default=2, help="QuantWorker actors (default 2)")
    if gpus:
        group.add_argument(
            "--gpus-per-worker", type=non_negative_float, default=0.0, help="GPUs per worker; fractions share one (default 0)"
        )
    group.add_argument(
        "--address",
        type=non_empty,
        help="Ray cluster to join; 'local': start an embedded Ray for this command; 'inline': no Ray, the "
        "workers on threads of this process (default: RAY_ADDRESS, else the cluster a `ray start` runs on "
        "this machine, else inline)",
    )
    group.add_argument(
        "--start-timeout",
        type=positive_float,
        default=120.0,
        help="seconds to wait for the workers to start on a Ray cluster before failing (default 120)",
    )
    json_argument(group)


def pool_settings(args: argparse.Namespace):
    """The :class:`~fp8ray.engine.pool.PoolSettings` that ``engine_arguments`` asked for."""
    from ..engine.pool import PoolSettings

    return PoolSettings(
        num_workers=args.workers,
        gpus_per_worker=getattr(args, "gpus_per_worker", 0.0),
        address=args.address,
        start_timeout=args.start_timeout,
    )


def plain_form_argument(parser, applies: str = "") -> None:
    """``--plain-form``: what an LMCache store's plain files are where their sizes cannot tell."""
    parser.add_argument(
        "--plain-form",
        choices=("raw", "fp8"),
        help=f"{applies}the store's plain files are raw chunks (no serde) or LMCache fp8 ones: needed where a store holds "
        "files of both sizes (a raw chunk of half the tokens is an fp8 chunk's size)",
    )


def json_argument(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON (no progress bar)")


def progress(args, total, unit: str = "block"):
    """``(bar, update)``: a tqdm bar on stderr for interactive runs, ``(None, None)``
    under --json or without a TTY. ``total`` is a callable, so the ``unit`` s are counted
    only when a bar is shown."""
    if getattr(args, "json", False) or not sys.stderr.isatty():
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=total(), unit=unit, file=sys.stderr)
    _BARS.append(bar)
    return bar, bar.update


_BARS: list = []  # shown and maybe open: a command that fails closes them before its error line


def close_bars() -> None:
    """End every bar shown: an error printed after one would land on the bar's line, and
    the bar be drawn again below it."""
    while _BARS:
        _BARS.pop().close()


def refuse_standard_output(path: str, writes: str, instead: str = "") -> None:
    """Refuse ``-`` where a command writes ``writes`` (files, a directory), not a stream:
    it made a file or directory named ``-``."""
    if path == "-":
        from ..errors import DestinationError

        raise DestinationError(f"{writes}, not standard output ('-'): name the output (./- for one named -){instead}")


# The arguments of the commands that name a file or directory they read, as each is shown
# (compress's --model is a name, not a file).
INPUT_ARGUMENTS = {"source": "source", "archive": "archive", "against": "--against", "original": "original", "text": "--text"}


def refuse_standard_input(args: argparse.Namespace) -> None:
    """Refuse ``-`` as a file to read: no command reads standard input, and "source -
    does not exist" did not say so."""
    for name, shown in INPUT_ARGUMENTS.items():
        if getattr(args, name, None) == "-":
            from ..errors import SourceError

            raise SourceError(f"{shown} '-': fp8ray reads files, not standard input; name a file (./- for one named -)")


def rate(gbps: float) -> str:
    """A speed as a line shows it: GB/s, or MB/s below 0.1 GB/s (a job of small blocks
    read "0.00 GB/s")."""
    return f"{gbps:.2f} GB/s" if gbps >= 0.1 else f"{gbps * 1000:.2f} MB/s"


def warn(message: str) -> None:
    print(f"fp8ray: {message}", file=sys.stderr)


LISTED_LINES = 20  # of a list of problems or skipped entries on stderr; --json has them all


def warn_each(lines: list[str], what: str) -> None:
    """One stderr line each for the first :data:`LISTED_LINES` of ``lines``, then how many
    more there are (a verify against the wrong tree printed 98,931 lines)."""
    for line in lines[:LISTED_LINES]:
        warn(line)
    if len(lines) > LISTED_LINES:
        warn(f"... and {len(lines) - LISTED_LINES} more {what} (--json lists them all)")
