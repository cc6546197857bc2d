"""What every command shares: argument types, the codec and engine options, the
progress bar, printing, and what an interrupt does."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ..codec.options import CHOICES, DEFAULT_OPTIONS, CodecOptions


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
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


def codec_arguments(parser: argparse.ArgumentParser, names: tuple[str, ...] = CodecOptions.names()) -> None:
    """``--fp8``, ``--scaling``, ... for the codec options ``names``. Each left out keeps
    the default mode's value; each given overrides only itself."""
    group = parser.add_argument_group(
        "codec options", f"default mode: {DEFAULT_OPTIONS.label()}; an option given overrides only itself"
    )
    for name in names:
        flag = "--" + name.replace("_", "-")
        default = getattr(DEFAULT_OPTIONS, name)
        if name == "scale_choice":
            shown = "mse for token and block scaling, else amax"
        else:
            shown = str(default)
        if name == "block_size":
            group.add_argument(flag, type=positive_int, metavar="N", help=f"{_CODEC_HELP[name]} (default {shown})")
        else:
            group.add_argument(flag, choices=CHOICES[name], help=f"{_CODEC_HELP[name]} (default {shown})")


def given_codec_options(args: argparse.Namespace) -> dict:
    """The codec options given on the command line, by name."""
    return {name: getattr(args, name) for name in CodecOptions.names() if getattr(args, name, None) is not None}


def codec_options(args: argparse.Namespace) -> CodecOptions:
    """The codec options the command line gave, over the default mode."""
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
        help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray); "
        "'inline': no Ray, the workers on threads of this process (fastest start for a local job)",
    )
    json_argument(group)



def pool_settings(args: argparse.Namespace):
    """The :class:`~fp8ray.engine.pool.PoolSettings` that ``engine_arguments`` asked for."""
    from ..engine.pool import PoolSettings

    return PoolSettings(num_workers=args.workers, gpus_per_worker=getattr(args, "gpus_per_worker", 0.0), address=args.address)

def json_argument(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON (no progress bar)")


def progress(args, total):
    """``(bar, update)``: a tqdm bar on stderr for interactive runs, ``(None, None)``
    under --json or without a TTY. ``total`` is a callable, so the blocks are counted
    only when a bar is shown."""
    if getattr(args, "json", False) or not sys.stderr.isatty():
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=total(), unit="block", file=sys.stderr)
    return bar, bar.update


def warn(message: str) -> None:
    print(f"fp8ray: {message}", file=sys.stderr)


class interrupts:
    """SIGINT and SIGTERM raise :class:`KeyboardInterrupt` once, in the main thread; any
    that follow are ignored, so the clean-up the first one started (workers settling,
    parts removed, Ray stopped) runs to its end. A signal the process ignores stays
    ignored; the handlers before it are put back on exit (or, ``exiting``, the signals
    left ignored: the process only ends after it). Elsewhere than in the main thread,
    nothing changes."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, exiting: bool = False):
        self.exiting = exiting  # the process ends next: leave the signals ignored instead

    def __enter__(self):
        self.fired = False
        self.saved = None
        if threading.current_thread() is threading.main_thread():
            # A signal ignored when the process started (a background job's SIGINT) stays so.
            self.saved = {sig: signal.getsignal(sig) for sig in self.SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
            for sig in self.saved:
                signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        for sig, handler in (self.saved or {}).items():
            if self.exiting:
                handler = signal.SIG_IGN
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def interrupted_state(args) -> str:
    """What an interrupted command left, in a few words, from what is on disk now."""
    command = getattr(args, "command", "")
    try:
        if command == "compress":
            return _compress_state(args.destination)
        if command in ("decompress", "lmcache-compress", "lmcache-decompress"):
            output = args.output if command == "decompress" else args.destination
            return f"nothing written; {_left_as_found(output)}"
        if command in ("verify", "inspect", "fidelity"):
            return f"{command} only reads: nothing changed"
    except (OSError, ValueError):  # what is there cannot be read: say nothing wrong about it
        pass
    return f"{command} stopped before it finished"


def _left_as_found(uri: str) -> str:
    from ..io.paths import redact, resolve

    fs, path = resolve(uri)
    import pyarrow.fs as pafs

    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return f"{redact(uri)} not created"
    return f"{redact(uri)} left as it was"


def _compress_state(uri: str) -> str:
    import pyarrow.fs as pafs

    from ..io import archive
    from ..io.paths import redact, resolve

    fs, path = resolve(uri)
    shown = redact(uri)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        return f"nothing written; {shown} not created"
    names = {e.base_name for e in fs.get_file_info(pafs.FileSelector(path))}
    if archive.MANIFEST_NAME in names:
        return f"{shown} left as it was (the archive it holds is unchanged)"
    plan = archive.read_plan(fs, path) if archive.PLAN_NAME in names else None
    if plan is None:
        return f"nothing written; {shown} left as it was"
    total = len(plan.parts)
    done = sum(archive.read_sidecar(fs, path, i) is not None for i in range(total))
    return f"{done} of {total} parts done in {shown}; rerun with --resume to keep them"
