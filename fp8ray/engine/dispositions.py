"""Keeping this process's signal dispositions while a call resets them (``ray.shutdown``).

``ray.shutdown`` uninstalls Ray's failure signal handlers by setting SIGTERM, among
others, back to the default action (``RayLog::UninstallSignalAction``), whatever handler
the process had: Python's ``signal.getsignal`` still names the process's handler, but a
SIGTERM then kills the process outright (exit 143, no clean-up, no message). Python can
set a disposition only from the main thread, which the call blocks; so a watcher thread
puts the saved ones back through ``sigaction(2)`` as soon as it sees them changed, which
narrows the second in which a SIGTERM kills to milliseconds.
Linux only (glibc's ``struct sigaction``); elsewhere the call simply runs.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
from collections.abc import Callable

# How often the watcher looks. A reset disposition stays reset that long, or until the
# watcher next gets the GIL: milliseconds on a loaded machine (1.4-7 ms measured on 2
# busy cores, against the 1.2 s of ray.shutdown without it), so the window is narrowed,
# not closed.
WATCH_SECONDS = 0.002


class _Sigaction(ctypes.Structure):
    """glibc's ``struct sigaction`` on Linux (x86-64 and AArch64 alike)."""

    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * (128 // ctypes.sizeof(ctypes.c_ulong))),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


_sigaction = None
if sys.platform.startswith("linux"):
    _sigaction = ctypes.CDLL(None, use_errno=True).sigaction
    _sigaction.argtypes = [ctypes.c_int, ctypes.POINTER(_Sigaction), ctypes.POINTER(_Sigaction)]


def _action(sig: int) -> _Sigaction:
    action = _Sigaction()
    _sigaction(sig, None, ctypes.byref(action))
    return action


def keeping_dispositions(call: Callable[[], object], signals=(signal.SIGTERM, signal.SIGINT)) -> None:
    """Run ``call()``, putting each of ``signals``' dispositions back whenever it changes
    while the call runs (at most :data:`WATCH_SECONDS` later)."""
    if _sigaction is None:
        call()
        return
    saved = {sig: _action(sig) for sig in signals}
    done = threading.Event()

    def put_back() -> None:
        for sig, action in saved.items():
            if bytes(_action(sig)) != bytes(action):  # the whole struct: no field's place assumed
                _sigaction(sig, ctypes.byref(action), None)

    def watch() -> None:
        while not done.wait(WATCH_SECONDS):
            put_back()

    watcher = threading.Thread(target=watch, name="fp8ray-dispositions", daemon=True)
    try:
        watcher.start()
    except RuntimeError:  # as the interpreter exits (Python 3.12+ starts no thread in atexit): no one to keep
        call()
        return
    try:
        call()
    finally:
        done.set()
        watcher.join()
        put_back()  # a reset in its last moments too
