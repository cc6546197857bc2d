"""The ``fp8ray`` command line. Thin: each command's module parses its arguments, calls
the library and prints; this module dispatches and turns every error into one line.

Command modules: :mod:`~fp8ray.cli.archives` (compress, decompress, verify, inspect, get),
:mod:`~fp8ray.cli.stores` (lmcache-compress, lmcache-decompress), :mod:`~fp8ray.cli.evaluate`
(capture, fidelity, eval-model), :mod:`~fp8ray.cli.serve`, :mod:`~fp8ray.cli.bench`,
:mod:`~fp8ray.cli.demo`. Each has ``add_commands(commands)``, which adds its subparsers
with ``set_defaults(handler=run)``. Option names, choices and defaults come from light
modules (:mod:`fp8ray.codec.names`, :mod:`fp8ray.io.lossless`); torch, numba, pyarrow and
Ray are imported inside the handlers, so ``fp8ray --help`` and ``--version`` load none
of them (``tests/cli/test_startup.py``).

This module imports only :mod:`~fp8ray.cli.interrupts` before :func:`main` has put its
signal handlers in place: an interrupt at any moment after that ends the command with
exit 130 and one line, never a traceback.
"""

from __future__ import annotations

import os
import signal
import sys

from ..errors import Fp8rayError
from .common import close_bars, refuse_standard_input
from .interrupts import forget_caught_interrupt, interrupted_state, interrupts, output_stamp, quiet_teardown
from .jobs import check_job_paths

# The extra (pyproject.toml [project.optional-dependencies]) that brings each module an
# optional feature imports (the module a failed import names, or a package of it). A
# module not named here has no extra: the error alone is said.
EXTRAS = {
    "models": ("transformers", "gguf", "matplotlib", "safetensors"),
    "serve": ("ray.serve", "fastapi", "starlette", "uvicorn", "httpx"),
    # LMCache's own imports (lmcache itself: fp8ray.lmcache.install)
    "lmcache": ("cpuinfo", "cachetools", "aiofiles", "sortedcontainers", "cryptography", "msgspec", "zmq", "blake3"),
}


def install_hint(exc: ImportError) -> str:
    """What installs the module ``exc`` says is missing: a pip command, or "" where
    fp8ray has no extra for it (its own failure, or a broken environment)."""
    missing = exc.name or ""

    def within(module: str) -> bool:
        return missing == module or missing.startswith(module + ".")

    if within("lmcache"):
        from ..lmcache.install import INSTALL_COMMAND

        return INSTALL_COMMAND
    return next((f"pip install 'fp8ray[{extra}]'" for extra, modules in EXTRAS.items() if any(map(within, modules))), "")


def build_parser():
    import argparse

    from .. import __version__
    from . import archives, bench, demo, evaluate, serve, stores

    class OneLineErrors(argparse.ArgumentParser):
        """argparse, but a mistake in the arguments is one line, as every other refusal
        (argparse prints the whole usage first): its subcommands' parsers are of this class too.
        No option is taken by a prefix of its name: ``--force`` was ``--force-replace``,
        which deletes what the archive does not describe."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, allow_abbrev=False, **kwargs)

        def error(self, message: str):
            self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

        def parse_args(self, args=None, namespace=None):
            """As argparse's, but an unknown option is named by the command it was given
            to (argparse leaves it to the top parser: "fp8ray: error: ... (see fp8ray --help)")."""
            parsed, extras = self.parse_known_args(args, namespace)
            if extras:
                self._chosen(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
            return parsed

        def _chosen(self, parsed):
            """The parser of the (sub)command ``parsed`` holds, its innermost."""
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
                    return action.choices[getattr(parsed, action.dest)]._chosen(parsed)
            return self

    parser = OneLineErrors(prog="fp8ray", description="Compress LLM KV caches to fp8.")
    parser.add_argument("--version", action="version", version=f"fp8ray {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (archives, stores, evaluate, serve, bench, demo):
        module.add_commands(commands)
    return parser


# Each interrupt caught, kept (with its frames) until the process exits. One that lands
# inside numba's compiler leaves an LLVM module half handed to LLVM; llvmlite would free
# it a second time as the traceback's frames go, and the process died of SIGSEGV after
# its "interrupted" line (2 runs in 100-150 of a decompress interrupted early, here and on
# the trees before). At interpreter shutdown llvmlite frees nothing.
_INTERRUPTS: list[KeyboardInterrupt] = []


def main(argv: list[str] | None = None) -> int:
    if sys.stderr is None:  # started with it closed (2>&-): print(file=None) would write to standard output
        _null_standard_error()
    # As the program itself (argv from the command line), an interrupt that comes once the
    # command has ended is ignored: the process is only exiting, its work done.
    with interrupts(exiting=argv is None):
        args = before = None
        started = False
        try:
            args = build_parser().parse_args(argv)
            before = output_stamp(args)  # to tell, if interrupted, whether the command wrote its output
            started = True
            return _run(args)
        except KeyboardInterrupt as interrupt:  # SIGINT or SIGTERM (interrupts), once the clean-up has run
            _INTERRUPTS.append(interrupt)
            forget_caught_interrupt()
            if argv is None:
                quiet_teardown()
            if args is None:  # interrupted while parsing: what the command would have touched
                args = _parsed_quietly(argv)
            if not started:  # the command did not run: its output is as it was
                before = output_stamp(args)
            print(f"fp8ray: interrupted: {interrupted_state(args, before)}", file=sys.stderr, flush=True)
            return 130


def _parsed_quietly(argv: list[str] | None):
    """The arguments, parsed again without printing (help, usage errors), or None."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return build_parser().parse_args(argv)
        except (SystemExit, Exception):  # noqa: BLE001 (a bad command line: nothing was done)
            return None


class _StandardOutput:
    """``sys.stdout`` as a command runs, telling its own failed writes (a report to a full
    disk, ``> /dev/full``) from the command's: ``failed`` is set before the error goes on."""

    def __init__(self, stream):
        self._stream = stream
        self.failed = False

    def write(self, text: str) -> int:
        return self._checked(self._stream.write, text)

    def flush(self) -> None:
        self._checked(self._stream.flush)

    def _checked(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:  # the reader left: said as such
            raise
        except OSError:
            self.failed = True
            raise

    def __getattr__(self, name):  # isatty, fileno, buffer (get -o - writes there, checked itself)...
        return getattr(self._stream, name)


def _null_standard_error() -> None:
    """Point descriptor 2 and ``sys.stderr`` at /dev/null, for a process started with
    standard error closed: a file opened later would otherwise take descriptor 2, and
    whatever native code (Ray, gRPC) writes there would land in it."""
    fd = os.open(os.devnull, os.O_WRONLY)
    if fd != 2:
        os.dup2(fd, 2)
        os.close(fd)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 (for the process's life)


def _drop_standard_output() -> None:
    """Point standard output at /dev/null once writing to it failed (a closed pipe, a full
    disk): Python would meet the failure again as it flushes standard output at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _run(args) -> int:
    if sys.stdout is None:  # started with it closed (>&-): get -o - says so, the rest print nothing
        return _run_command(args, None)
    stdout = sys.stdout = _StandardOutput(sys.stdout)
    try:
        return _run_command(args, stdout)
    finally:
        sys.stdout = stdout._stream


def _run_command(args, stdout: _StandardOutput | None) -> int:
    try:
        check_job_paths(args)
        refuse_standard_input(args)
        if os.environ.get("FP8RAY_NUM_THREADS"):  # checked once: a bad value inside a decode read as damage
            from ..codec.cpu import num_threads

            num_threads()
        try:
            code = args.handler(args)
            if stdout is not None:  # a buffered report fails here, not in the exit's flush (exit 120)
                stdout.flush()
            return code
        finally:
            close_bars()
    except ImportError as exc:  # an optional extra that is not installed
        hint = install_hint(exc)
        said = hint and hint not in str(exc)  # fp8ray's own message may give it already
        print(f"fp8ray: error: {exc}" + (f"; install it with: {hint}" if said else ""), file=sys.stderr)
        return 1
    except BrokenPipeError:  # the output's reader left (`| head`): it took what it wanted, as a killed writer says nothing
        _drop_standard_output()
        return 128 + signal.SIGPIPE
    except OSError as exc:
        if stdout is not None and stdout.failed:  # its reason alone named nothing: the work may be whole, the report not
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            print(f"fp8ray: error: cannot write to standard output: {reason}", file=sys.stderr)
            _drop_standard_output()
        else:
            print(f"fp8ray: error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, Fp8rayError) as exc:
        print(f"fp8ray: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if not type(exc).__module__.startswith("ray."):
            raise  # a bug of fp8ray's: its traceback is what to report
        # Ray wraps what went wrong remotely in its own classes, with remote tracebacks in
        # the text: say what the cause was, in one line.
        cause = getattr(exc, "cause", None) or exc
        print(f"fp8ray: error: {type(cause).__name__}: {str(cause).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
