"""Ctrl-C (SIGINT to the command's process group, as a terminal sends it) and SIGTERM at
random, seeded points of `fp8ray compress` and `decompress`: exit 130 with one line saying
what was left, no process or folder left behind, and a rerun gives byte-identical output.
Most points run the workers inline (`--address inline`); a few start the embedded Ray."""

from __future__ import annotations

import functools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _util import InterruptedAfter, interrupted_main, processes_with_ray_tmp

from fp8ray.io.paths import TMP_MARK

FP8RAY = [sys.executable, "-m", "fp8ray.cli"]
SEED = 19
# (command, address, points) of the commands run as processes: 12 points, 2 of them on an
# embedded Ray (seconds to start); and 12 more of the command run inline in this process
# (no start-up cost). The delays after the command is at work: from 0 to its length, as
# measured in this process (warm) before the points.
PLAN = [("compress", "inline", 5), ("decompress", "inline", 5), ("compress", "local", 1), ("decompress", "local", 1)]
IN_PROCESS = [("compress", 6), ("decompress", 6)]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A source of 4 files (24 blocks of 512 KiB), its archive (one part a block) and what
    decompress gives back, made without interruption."""
    import torch
    from safetensors.torch import save_file

    from fp8ray.cli import main

    root = tmp_path_factory.mktemp("irq")
    src = root / "kv"
    src.mkdir()
    g = torch.Generator().manual_seed(SEED)
    for f in range(4):
        save_file(
            {f"layer{i}.k": torch.randn(8, 256, 128, generator=g).to(torch.bfloat16) for i in range(6)},
            str(src / f"f{f}.safetensors"),
        )
    assert main(["compress", str(src), str(root / "ref.fp8"), "--part-mb", "0.5", "--address", "inline", "--json"]) == 0
    assert main(["decompress", str(root / "ref.fp8"), str(root / "ref.out"), "--address", "inline", "--json"]) == 0
    return root


def _command(command: str, reference: Path, work: Path) -> tuple[list[str], Path]:
    """The command's arguments (one worker, the reference's parts) and its output, in ``work``."""
    if command == "compress":
        dest = work / "kv.fp8"
        return ["compress", str(reference / "kv"), str(dest), "--part-mb", "0.5", "--workers", "1"], dest
    dest = work / "out"
    return ["decompress", str(reference / "ref.fp8"), str(dest), "--workers", "1"], dest


def _lengths(reference: Path, tmp_path: Path) -> dict[str, float]:
    """How long each command takes, run inline in this process, warm and uninterrupted:
    the points are drawn within it, so that most land while it works, whatever this
    machine's speed."""
    import contextlib
    import io

    from fp8ray.cli import main

    length = {}
    for command in ("compress", "decompress"):
        work = tmp_path / f"{command}-timed"
        work.mkdir()
        args, _ = _command(command, reference, work)
        for _ in range(2):  # the first run loads what the command needs
            shutil.rmtree(work)
            work.mkdir()
            with contextlib.redirect_stdout(io.StringIO()):
                start = time.monotonic()
                assert main([*args, "--address", "inline"]) == 0
                length[command] = time.monotonic() - start
        shutil.rmtree(work)
    return length


def _interrupt(args: list[str], cwd: Path, ready, delay: float, sig: int) -> tuple[int, str, float]:
    """Run fp8ray ``args``, wait until ``ready(ray_tmp)`` (the command is at work) plus ``delay``
    seconds, send ``sig`` to its process group; its exit code, stderr and the seconds it
    took to end after the signal."""
    ray_tmp = tempfile.mkdtemp(prefix="irq", dir="/tmp")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [*FP8RAY, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not ready(ray_tmp) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        sent = time.monotonic()
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - sent
        left = processes_with_ray_tmp(ray_tmp)
        assert not left, f"processes left running: {[p.pid for p in left]}"
        assert os.listdir(ray_tmp) == [], f"left in RAY_TMPDIR: {os.listdir(ray_tmp)}"
        return proc.returncode, err, took
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # only the group this test started
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _ray_starting(ray_tmp: str) -> bool:
    """Whether the embedded Ray has begun to start (its temporary directory exists)."""
    return bool(os.listdir(ray_tmp))


def _no_temporaries(directory: Path) -> None:
    assert not [p.name for p in directory.iterdir() if ".tmp-" in p.name], sorted(p.name for p in directory.iterdir())


@pytest.mark.slow
def test_an_interrupt_at_any_point_exits_130_saying_what_it_left(reference, tmp_path):
    rng = random.Random(SEED)
    length = _lengths(reference, tmp_path)
    outcomes = []
    for command, address, points in PLAN:
        for point in range(points):
            work = tmp_path / f"{command}-{address}-{point}"
            work.mkdir()
            sig = signal.SIGTERM if point == 3 else signal.SIGINT
            delay = rng.uniform(0.0, length[command])
            args, dest = _command(command, reference, work)
            if address == "local":
                ready, delay = _ray_starting, rng.uniform(0.0, 4.0)  # while Ray starts, or later
            elif command == "compress":
                ready = lambda _, d=dest: d.exists()  # noqa: E731
            else:
                ready = lambda _, w=work: any(".tmp-" in p.name for p in w.iterdir())  # noqa: E731
            code, err, took = _interrupt([*args, "--address", address], work, ready, delay, sig)
            outcomes.append(
                _check(
                    f"{command} --address {address}, {signal.Signals(sig).name} {delay:.2f} s after ready",
                    code,
                    err,
                    took,
                    work,
                    dest,
                    args,
                    reference,
                )
            )
    outcomes += _in_process_points(reference, tmp_path, rng, length)
    finished = sum(o == "finished" for o in outcomes)
    print(f"interrupt points: {len(outcomes) - finished} interrupted, {finished} finished first (lengths {length})")
    assert len(outcomes) == 24 and finished <= 8, outcomes


def _check(label, code, err, took, work, dest, args, reference) -> str:
    """Exit 130 and one line, no temporary left; the rerun it asks for (a plain one else)
    gives what an uninterrupted run gives."""
    from fp8ray.cli import main

    lines = err.strip().splitlines()
    if code == 0:  # it finished before the signal: only its output to check
        outcome = "finished"
    else:
        assert code == 130, f"{label}: exit {code}, stderr {err[-2000:]}"
        assert len(lines) == 1 and lines[0].startswith("fp8ray: interrupted: "), f"{label}: {err[-2000:]}"
        assert took < 30, f"{label}: took {took:.1f} s to end"
        outcome = lines[0]
    _no_temporaries(work)
    rerun = [*args, "--address", "inline", "--json"]
    if "--resume" in err:
        assert dest.is_dir() and (dest / "_plan.json").exists(), f"{label}: {err}"
        assert main([*rerun, "--resume"]) == 0, label
    elif code == 130 and "had finished" in err:  # the output was in place, complete, as the signal came
        assert dest.exists(), f"{label}: {err}"
    elif code == 130:
        assert "not created" in err and not dest.exists(), f"{label}: {err}"
        assert main(rerun) == 0, label
    expected = reference / ("ref.fp8" if args[0] == "compress" else "ref.out")
    assert _tree(dest) == _tree(expected), label
    return outcome


def _in_process_points(reference, tmp_path, rng, length: dict[str, float]) -> list[str]:
    """The command run by ``main`` in this process, SIGINT sent to it by a timer: only
    while it runs (an outer handler takes one that comes as it returns)."""
    outcomes = []
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        for command, points in IN_PROCESS:
            for point in range(points):
                work = tmp_path / f"{command}-in-process-{point}"
                work.mkdir()
                args, dest = _command(command, reference, work)
                delay = rng.uniform(0.0, length[command])
                code, err, took = interrupted_main([*args, "--address", "inline"], delay)
                outcomes.append(
                    _check(f"{command} in process, SIGINT at {delay:.2f} s", code, err, took, work, dest, args, reference)
                )
    finally:
        signal.signal(signal.SIGINT, previous)
    return outcomes


def test_an_interrupted_compress_keeps_its_finished_parts_for_resume(reference, tmp_path, monkeypatch, capsys):
    """Ctrl-C after the third part: the line counts the parts kept, and --resume finishes
    the archive byte-identical to an uninterrupted run."""
    from fp8ray.cli import main
    from fp8ray.engine.worker import QuantWorker

    finished = []
    compress_part = QuantWorker.compress_part

    @functools.wraps(compress_part)  # still QuantWorker.compress_part to the pool
    def then_interrupt(self, *args):
        result = compress_part(self, *args)
        finished.append(result)
        if len(finished) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread, as a Ctrl-C is
        return result

    monkeypatch.setattr(QuantWorker, "compress_part", then_interrupt)
    dest = tmp_path / "kv.fp8"
    args = ["compress", str(reference / "kv"), str(dest), "--part-mb", "0.5", "--workers", "1", "--address", "inline"]
    assert main(args) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    done = int(
        re.fullmatch(
            rf"fp8ray: interrupted: (\d+) of 24 parts done in {re.escape(str(dest))}; rerun with --resume to keep them", err[0]
        )[1]
    )
    assert 3 <= done < 24
    monkeypatch.setattr(QuantWorker, "compress_part", compress_part)
    assert main([*args, "--resume", "--json"]) == 0
    assert _tree(dest) == _tree(reference / "ref.fp8")


def _interrupted_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("command", ["compress", "decompress"])
def test_an_interrupt_as_the_output_directory_is_made_leaves_nothing(reference, tmp_path, monkeypatch, capsys, command):
    """A Ctrl-C that arrives while the directory is being made (raised as the call
    returns): the directory goes too, and the line says nothing was created."""
    from fp8ray.cli import main
    from fp8ray.engine import archives as engine_archives
    from fp8ray.io import destinations
    from fp8ray.io.paths import resolve_output

    dest = tmp_path / ("kv.fp8" if command == "compress" else "out")

    def resolve_dest(uri):
        return (InterruptedAfter("create_dir"), resolve_output(uri)[1]) if uri == str(dest) else resolve_output(uri)

    monkeypatch.setattr(destinations if command == "compress" else engine_archives, "resolve_output", resolve_dest)
    source = reference / ("kv" if command == "compress" else "ref.fp8")
    assert main([command, str(source), str(dest), "--address", "inline"]) == 130
    assert _interrupted_line(capsys) == f"fp8ray: interrupted: nothing written; {dest} not created"
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_as_compress_makes_its_local_directory_leaves_nothing(reference, tmp_path, monkeypatch, capsys):
    """As above, on the local filesystem, where the directory is made by mkdir (which,
    unlike pyarrow's create_dir, fails on one made meanwhile): still this run's to remove."""
    from fp8ray.cli import main
    from fp8ray.io import destinations

    dest, real_mkdir = tmp_path / "kv.fp8", os.mkdir

    def mkdir_then_interrupt(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        if path == str(dest):
            raise KeyboardInterrupt

    monkeypatch.setattr(destinations.os, "mkdir", mkdir_then_interrupt)
    assert main(["compress", str(reference / "kv"), str(dest), "--address", "inline"]) == 130
    assert _interrupted_line(capsys) == f"fp8ray: interrupted: nothing written; {dest} not created"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["compress", "decompress"])
def test_an_interrupt_once_the_output_is_in_place_says_it_is_complete(reference, tmp_path, monkeypatch, capsys, command):
    """A Ctrl-C that arrives after the output was renamed into place, before the command
    returned: the line says the output is complete (it is), not that it was there before."""
    from fp8ray.cli import main
    from fp8ray.engine import archives as engine_archives

    name = f"{command}_archive"
    finished = getattr(engine_archives, name)

    def then_interrupt(*args, **kwargs):
        finished(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_archives, name, then_interrupt)
    source = reference / ("kv" if command == "compress" else "ref.fp8")
    dest = tmp_path / ("kv.fp8" if command == "compress" else "out")
    args = [command, str(source), str(dest), "--address", "inline", *(["--part-mb", "0.5"] if command == "compress" else [])]
    assert main(args) == 130
    said = "holds the complete archive" if command == "compress" else "is complete"
    assert _interrupted_line(capsys) == f"fp8ray: interrupted: {dest} {said}: the {command} had finished"
    assert _tree(dest) == _tree(reference / ("ref.fp8" if command == "compress" else "ref.out"))
    # The same interrupt as the command begins, its output there from before: left as it was.
    monkeypatch.setattr(engine_archives, name, lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main([*args, "--overwrite"]) == 130
    left = "left as it was (the archive it holds is unchanged)" if command == "compress" else "left as it was"
    assert _interrupted_line(capsys).endswith(f"{dest} {left}")


@pytest.mark.parametrize("renames", [1, 2])
def test_an_interrupt_as_overwrite_swaps_the_archives_leaves_one_whole_archive(reference, tmp_path, monkeypatch, capsys, renames):
    """--overwrite puts the new archive in place by two renames (the old one aside, the
    new one in): interrupted after the first, the old archive is put back; after the
    second, the new one stays. Either way the line says which, and nothing is left hidden."""
    from fp8ray.cli import main

    dest = tmp_path / "kv.fp8"
    shutil.copytree(reference / "ref.fp8", dest)
    rename, done = os.rename, []

    def rename_then_interrupt(src, dst):
        rename(src, dst)
        if TMP_MARK in os.path.basename(src) + os.path.basename(dst) and str(dest) in (str(src), str(dst)):
            done.append(dst)  # one of the swap's renames
            if len(done) == renames:
                raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", rename_then_interrupt)
    args = ["compress", str(reference / "kv"), str(dest), "--part-mb", "0.5", "--address", "inline", "--overwrite"]
    assert main(args) == 130
    said = (
        "left as it was (the archive it holds is unchanged)"
        if renames == 1
        else "holds the complete archive: the compress had finished"
    )
    assert _interrupted_line(capsys) == f"fp8ray: interrupted: {dest} {said}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.fp8"]
    assert _tree(dest) == _tree(reference / "ref.fp8")


# Run in a fresh process: SIGINT to itself while the main thread is somewhere an exception
# would leave broken, under fp8ray's handlers; what it prints is where the interrupt landed.
UNSAFE_MOMENT = """
import os, signal, sys, threading, time
from fp8ray.cli.interrupts import interrupts

def interrupt_here():  # the handler runs at one of these bytecodes, not after them
    os.kill(os.getpid(), signal.SIGINT)
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        pass

with interrupts():
    done = []
    try:
{body}
        time.sleep(5)  # the signal, delivered again, lands here
        print("never interrupted")
    except KeyboardInterrupt:
        print("interrupted after", *done)
{after}
sys.stdout.flush()
os._exit(0)  # not waiting for a thread stuck on a lock
"""
LLVM_LOCK = """
        import llvmlite.binding as llvm
        from llvmlite.binding import ffi
        def on_acquire():  # llvmlite calls it inside _LLVMLock.__enter__, the lock held
            ffi.unregister_lock_callback(on_acquire, on_release)
            interrupt_here()
        def on_release():
            pass
        ffi.register_lock_callback(on_acquire, on_release)
        llvm.get_process_triple()
        done.append("the LLVM call")
"""
# Whether another thread can still call LLVM (llvmlite's lock was released).
LLVM_FROM_ANOTHER_THREAD = """
import llvmlite.binding as llvm
other = threading.Thread(target=llvm.get_process_triple, daemon=True)
other.start()
other.join(10)
print("LLVM free" if not other.is_alive() else "LLVM locked")
"""
DESTRUCTOR = """
        class Resource:
            def __del__(self):
                interrupt_here()
                done.append("the destructor")
        resource = Resource()
        del resource
"""
CONTEXT_ENTERED = """
        lock = threading.Lock()
        class Locked:  # as concurrent.futures' _AcquireFutures: takes locks in Python
            def __enter__(self):
                lock.acquire()
                interrupt_here()
            def __exit__(self, *exc):
                lock.release()
        with Locked():
            done.append("the context")
"""
LOCK_FROM_ANOTHER_THREAD = """
other = threading.Thread(target=lambda: lock.acquire() and lock.release(), daemon=True)
other.start()
other.join(10)
print("lock free" if not other.is_alive() else "lock held")
"""
FP8RAY_SETUP = """
        import contextlib
        fp8ray_like = {"__name__": "fp8ray.stand_in", "contextlib": contextlib, "interrupt_here": interrupt_here}
        exec(\'\'\'
@contextlib.contextmanager
def setting_up(done):  # fp8ray's own, entered by contextlib's __enter__
    try:
        interrupt_here()
    except KeyboardInterrupt:
        done.append("inside fp8ray's own setup")
        raise
    yield
\'\'\', fp8ray_like)
        with fp8ray_like["setting_up"](done):
            done.append("never")
"""
BLOCKED_FOR_LONG = """
        interrupts.MAX_WAIT_S = 0.5
        numba_like = {"__name__": "numba.core.stand_in", "time": time, "interrupt_here": interrupt_here}
        exec(\'\'\'
def compile_for_ever(done):
    start = time.monotonic()
    interrupt_here()
    try:
        while time.monotonic() < start + 10:
            pass
    except KeyboardInterrupt:
        done.append("inside numba's code" if time.monotonic() < start + 3 else "late")
        raise
\'\'\', numba_like)
        numba_like["compile_for_ever"](done)
"""
IMPORT = """
        import interrupted_module
"""
# Whether the module was loaded whole, asked after the interrupt: a retry of the signal
# may land between the import's end and a next statement (seen under load), not inside.
IMPORTED = """
print(getattr(sys.modules.get("interrupted_module"), "LOADED", "not loaded whole"))
"""


@pytest.mark.parametrize(
    "body, after, said",
    [
        (LLVM_LOCK, LLVM_FROM_ANOTHER_THREAD, ["interrupted after the LLVM call", "LLVM free"]),
        (DESTRUCTOR, "", ["interrupted after the destructor"]),
        (CONTEXT_ENTERED, LOCK_FROM_ANOTHER_THREAD, ["interrupted after the context", "lock free"]),
        (IMPORT, IMPORTED, ["interrupted after", "the whole module"]),
        (FP8RAY_SETUP, "", ["interrupted after inside fp8ray's own setup"]),
        (BLOCKED_FOR_LONG, "", ["interrupted after inside numba's code"]),
    ],
    ids=["llvmlite-lock", "destructor", "context-entered", "import", "fp8ray-setup", "blocked-for-long"],
)
def test_a_signal_waits_until_the_main_thread_leaves_code_an_exception_would_break(tmp_path, body, after, said):
    """Inside llvmlite's lock (taken in Python: cut short there, the main thread kept it
    and an inline worker's next LLVM call waited for ever, a CI hang), a destructor (the
    exception, and the interrupt, would be dropped), another package's ``__enter__`` that
    has taken a lock (kept for ever) or another package's import (left half loaded), the
    interrupt waits and lands once that code has returned. Inside fp8ray's own context
    manager's setup it lands at once; in such code blocked for longer than MAX_WAIT_S,
    it lands there."""
    (tmp_path / "interrupted_module.py").write_text(
        "from __main__ import interrupt_here\ninterrupt_here()\nLOADED = 'the whole module'\n"
    )
    script = UNSAFE_MOMENT.format(body=body, after=after)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), str(tmp_path)])),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert result.stdout.strip().splitlines() == said, result.stdout + result.stderr[-2000:]


def test_the_import_machinery_itself_is_no_place_to_land(tmp_path, monkeypatch):
    """Under load a retried signal landed in importlib's own frames, before or after a
    module's body (the frame checked had no module body above it): the import failed and
    the module was dropped, half loaded. Deterministically: the frames of a finder that
    importlib calls."""
    from fp8ray.cli.interrupts import _unsafe_to_interrupt

    seen = []

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "no_such_module_for_the_test":
                seen.append(sys._getframe().f_back)  # importlib's _find_spec
            return None

    monkeypatch.setattr(sys, "meta_path", [Finder, *sys.meta_path])
    with pytest.raises(ImportError):
        import no_such_module_for_the_test  # noqa: F401
    [importlib_frame] = seen
    assert importlib_frame.f_code.co_filename.startswith("<frozen importlib")
    assert _unsafe_to_interrupt(importlib_frame)
    assert not _unsafe_to_interrupt(sys._getframe())  # this test's own frame: lands at once


def test_a_sigterm_as_the_embedded_ray_stops_is_held_not_fatal(reference, tmp_path):
    """ray.shutdown sets SIGTERM back to the default action (RayLog::UninstallSignalAction):
    a SIGTERM in the second it takes (timeout, systemd, Kubernetes near a run's end) ended
    the command at once, exit 143 with no line, leaving a hidden partial output and the
    embedded Ray's folder. The disposition is now put back as Ray resets it, and the
    signal held until the clean-up is done: exit 130 with the command's line, nothing left.
    Here the signal is sent from inside ray.shutdown, once Ray has reset it."""
    ray_tmp = tempfile.mkdtemp(prefix="fst", dir="/tmp")
    out = tmp_path / "out"
    code = (
        "import os, signal, sys, time, ray\n"
        "from fp8ray.cli import main\n"
        "real = ray.shutdown\n"
        "def shutdown(*args, **kwargs):\n"
        "    real(*args, **kwargs)\n"
        "    time.sleep(0.2)  # Ray's reset is in place, for the watcher to find (milliseconds, loaded)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.05)\n"
        "ray.shutdown = shutdown\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["decompress", str(reference / "ref.fp8"), str(out), "--address", "local", "--workers", "1"]
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled")
    try:
        result = subprocess.run(
            [sys.executable, "-c", code, *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
        )
        assert result.returncode == 130, (result.returncode, result.stderr[-3000:])
        assert result.stderr.splitlines()[-1].startswith("fp8ray: interrupted"), result.stderr
        assert "Traceback" not in result.stderr
        assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []  # no hidden partial output
        assert os.listdir(ray_tmp) == [] and not processes_with_ray_tmp(ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
