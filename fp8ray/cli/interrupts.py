"""What an interrupt does to a command: SIGINT or SIGTERM becomes one
:class:`KeyboardInterrupt` in the main thread (:class:`interrupts`), and the command's
last line says what it left (:func:`interrupted_state`).

Imports nothing heavy: :func:`fp8ray.cli.main` installs the handlers before it loads
anything else, so an interrupt at any moment, even while torch or Ray is being imported,
ends the command with exit 130 and one line.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


class interrupts:
    """SIGINT and SIGTERM raise :class:`KeyboardInterrupt` once, in the main thread; any
    that follow are ignored, so the clean-up the first one started (workers settling,
    parts removed, Ray stopped) runs to its end. A signal the process ignores stays
    ignored; the handlers before it are put back on exit (or, ``exiting``, the signals
    left ignored: the process only ends after it). Elsewhere than in the main thread,
    nothing changes.

    A signal waits (it is delivered again every :attr:`RETRY_S`) while the main thread
    runs code that an exception would leave broken (:func:`_unsafe_to_interrupt`):
    - the import of another package than fp8ray: an import cut short leaves its package
      half loaded, and torch half loaded crashes the process (SIGSEGV, no message) when
      it is loaded again or at exit;
    - numba's or llvmlite's code (loading or compiling a kernel, freeing an LLVM object):
      llvmlite takes its lock in Python (``_LLVMLock.__enter__``); cut short there, the
      main thread keeps it, and a worker thread's next LLVM call waits for ever (an
      inline decompress hung so in CI, after a SIGINT);
    - a destructor (``__del__``): Python drops an exception raised there ("Exception
      ignored in ..."), and with it the interrupt;
    - another package's ``__enter__`` or ``__exit__``, called by fp8ray's code: cut short
      between taking a lock and returning, or before releasing it, they keep it (the
      futures' conditions ``concurrent.futures.wait`` takes one by one, in Python; a
      worker thread then waits for ever to set its result). fp8ray's own context
      managers, and what runs inside them, are interrupted as ever.
    A signal waits :attr:`MAX_WAIT_S` at most, then lands where the main thread is: such
    code blocked for longer (another process's file lock) must not keep Ctrl-C or a
    SIGTERM from ending the command."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    RETRY_S = 0.02
    MAX_WAIT_S = 10.0  # a cold numba compile of every kernel takes about 3 s here

    def __init__(self, exiting: bool = False):
        self.exiting = exiting  # the process ends next: leave the signals ignored instead

    def __enter__(self):
        self.fired = False
        self.saved = None
        self.active = True
        self.retrying = False
        self.waiting_since = None  # when the signal now waiting first came
        if threading.current_thread() is threading.main_thread():
            # A signal ignored when the process started (a background job's SIGINT) stays so.
            self.saved = {sig: signal.getsignal(sig) for sig in self.SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
            for sig in self.saved:
                signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if self.fired:
            return
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        if _unsafe_to_interrupt(frame) and time.monotonic() - self.waiting_since < self.MAX_WAIT_S:
            if not self.retrying:
                self.retrying = True
                threading.Timer(self.RETRY_S, self._deliver_again, (signum,)).start()
            return
        self.fired = True
        raise KeyboardInterrupt

    def _deliver_again(self, signum: int) -> None:
        self.retrying = False
        if self.active:
            os.kill(os.getpid(), signum)

    def __exit__(self, *exc) -> None:
        self.active = False
        for sig, handler in (self.saved or {}).items():
            if self.exiting:
                handler = signal.SIG_IGN
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def forget_caught_interrupt() -> None:
    """Tell CPython that the :class:`KeyboardInterrupt` just caught was handled. One raised
    inside code run from a string (``exec``/``eval`` of text: numba's and dataclasses'
    generated functions are) sets a flag that, under ``python -m``, makes the interpreter
    kill itself with SIGINT once it has exited, whatever the exit code (CPython's
    ``run_eval_code_obj``; exit -2 instead of 130, after the one line). The start of any
    string ``exec`` clears that flag."""
    exec("", {})


def quiet_teardown() -> None:
    """An interrupt that lands while numba compiles can cut an llvmlite object short in its
    making; as the process ends, its destructor fails and Python prints "Exception ignored
    in ..." and a traceback after the command's one line. Such failures say nothing about
    what the command left: once it has said that, the exiting process drops them. (Only
    the program itself calls this; ``main`` called in another process leaves its hook.)"""
    sys.unraisablehook = lambda unraisable: None


# Packages whose Python code holds locks and native state (LLVM's) between two calls.
NATIVE_STATE_PACKAGES = ("numba", "llvmlite")


def _unsafe_to_interrupt(frame) -> bool:
    """Whether ``frame`` or a frame that called it runs the import of a module other than
    fp8ray's own (whose modules load again cleanly after an interrupted import) or
    importlib's own code outside a module's body, code of
    :data:`NATIVE_STATE_PACKAGES`, or a destructor; or whether, below fp8ray's innermost
    frame, another package's code is entering or leaving a context."""
    in_fp8ray = False  # whether a frame between here and ``frame`` is fp8ray's
    in_module_body = False  # whether a frame between here and ``frame`` is an fp8ray module's import
    while frame is not None:
        module = frame.f_globals.get("__name__")
        module = module if isinstance(module, str) else ""  # code run from a string may set anything
        in_fp8ray = in_fp8ray or module.split(".")[0] == "fp8ray"
        if frame.f_code.co_name == "__del__" or module.split(".")[0] in NATIVE_STATE_PACKAGES:
            return True
        if not in_fp8ray and frame.f_code.co_name in ("__enter__", "__exit__"):
            return True
        loaded_by_import = frame.f_back is not None and _in_importlib(frame.f_back)
        if frame.f_code.co_name == "<module>" and loaded_by_import:
            if not module.startswith("fp8ray"):
                return True
            in_module_body = True
        elif _in_importlib(frame) and not in_module_body:
            # The import machinery itself, before or after a module's body (under load, a
            # retry lands there): cut short, it drops the module from sys.modules.
            return True
        frame = frame.f_back
    return False


def _in_importlib(frame) -> bool:
    return frame.f_code.co_filename.startswith("<frozen importlib")


ABSENT = "absent"  # an output_stamp: nothing at the output's path


def output_stamp(args) -> tuple[int, int, int] | str | None:
    """What is at the command's output now, to tell after an interrupt whether the command
    put it there: a local file's or directory's identity and modification time (a
    replacement is renamed into place: a new identity; a resumed archive gains entries: a
    new time), :data:`ABSENT`, or None where that cannot be told (an object store, a
    command that writes nothing, arguments not parsed)."""
    uri = _output_uri(args)
    if uri is None or "://" in uri:
        return None
    try:
        st = os.stat(uri)
    except FileNotFoundError:
        return ABSENT
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


def _output_uri(args) -> str | None:
    command = getattr(args, "command", "")
    if command in ("compress", "lmcache-compress", "lmcache-decompress"):
        return args.destination
    if command == "decompress":
        return args.output
    return None


def interrupted_state(args, before: tuple[int, int, int] | str | None = None) -> str:
    """What an interrupted command left, in a few words, from what is on disk now
    (``args`` None: interrupted before its arguments were parsed). ``before``: the
    :func:`output_stamp` taken as the command began; an output that has changed since was
    put there, complete, by the command (its outputs appear by rename only when complete)."""
    if args is None:
        return "nothing done"
    command = getattr(args, "command", "")
    try:
        finished = before is not None and output_stamp(args) not in (before, ABSENT, None)
        if command == "compress":
            return _compress_state(args.destination, finished)
        if command in ("decompress", "lmcache-compress", "lmcache-decompress"):
            output = args.output if command == "decompress" else args.destination
            if finished:
                return f"{_shown(output)} is complete: the {command} had finished"
            return f"nothing written; {_left_as_found(output)}"
        if command in ("verify", "inspect", "fidelity"):
            return f"{command} only reads: nothing changed"
    except Exception:  # noqa: BLE001
        # What is there cannot be read, or the interrupt cut an import short (torch half
        # loaded cannot be loaded again): say nothing wrong about it, in the one line.
        pass
    return f"{command} stopped before it finished"


def _shown(uri: str) -> str:
    from ..io.paths import redact

    return redact(uri)


def _left_as_found(uri: str) -> str:
    from ..io.paths import resolve

    fs, path = resolve(uri)
    import pyarrow.fs as pafs

    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return f"{_shown(uri)} not created"
    return f"{_shown(uri)} left as it was"


def _compress_state(uri: str, finished: bool) -> str:
    import pyarrow.fs as pafs

    from ..io.paths import resolve

    fs, path = resolve(uri)
    shown = _shown(uri)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        return f"nothing written; {shown} not created"
    from ..io import archive  # loads the codec (torch): only once there is an archive to look at

    names = {e.base_name for e in fs.get_file_info(pafs.FileSelector(path))}
    if archive.MANIFEST_NAME in names:
        if finished:
            return f"{shown} holds the complete archive: the compress had finished"
        return f"{shown} left as it was (the archive it holds is unchanged)"
    plan = archive.read_plan(fs, path) if archive.PLAN_NAME in names else None
    if plan is None:
        return f"nothing written; {shown} left as it was"
    total = len(plan.parts)
    done = sum(archive.read_sidecar(fs, path, i) is not None for i in range(total))
    return f"{done} of {total} parts done in {shown}; rerun with --resume to keep them"
