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
from _util import processes_with_ray_tmp

FP8RAY = [sys.executable, "-m", "fp8ray.cli"]
SEED = 19
# (command, address, points) of the commands run as processes: 12 points, 2 of them on an
# embedded Ray (seconds to start); and 12 more of the command run inline in this process
# (no start-up cost). The delays after the command is at work, from 0 to (about) its length.
PLAN = [("compress", "inline", 5), ("decompress", "inline", 5), ("compress", "local", 1), ("decompress", "local", 1)]
IN_PROCESS = [("compress", 6), ("decompress", 6)]
DELAY = {"compress": 0.3, "decompress": 0.04}


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
    src = reference / "kv"
    outcomes = []
    for command, address, points in PLAN:
        for point in range(points):
            work = tmp_path / f"{command}-{address}-{point}"
            work.mkdir()
            sig = signal.SIGTERM if point == 3 else signal.SIGINT
            delay = rng.uniform(0.0, DELAY[command])
            if command == "compress":
                dest = work / "kv.fp8"
                args = ["compress", str(src), str(dest), "--part-mb", "0.5", "--workers", "1"]
                ready = (lambda _, d=dest: d.exists()) if address == "inline" else _ray_starting
            else:
                dest = work / "out"
                args = ["decompress", str(reference / "ref.fp8"), str(dest), "--workers", "1"]
                ready = (lambda _, w=work: any(".tmp-" in p.name for p in w.iterdir())) if address == "inline" else _ray_starting
            if address == "local":
                delay = rng.uniform(0.0, 4.0)  # while Ray starts, or later
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
    outcomes += _in_process_points(reference, tmp_path, rng)
    assert len(outcomes) == 24 and sum(o != "finished" for o in outcomes) >= 16, outcomes


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
        rerun.append("--resume")
    elif code == 130:
        assert "not created" in err and not dest.exists(), f"{label}: {err}"
    if code == 130:
        assert main(rerun) == 0, label
    expected = reference / ("ref.fp8" if args[0] == "compress" else "ref.out")
    assert _tree(dest) == _tree(expected), label
    return outcome


def _in_process_points(reference, tmp_path, rng) -> list[str]:
    """The command run by ``main`` in this process, SIGINT sent to it by a timer: only
    while it runs (an outer handler takes one that comes as it returns)."""
    import contextlib
    import io
    import threading

    from fp8ray.cli import main

    outcomes = []
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        for command, points in IN_PROCESS:
            for point in range(points):
                work = tmp_path / f"{command}-in-process-{point}"
                work.mkdir()
                if command == "compress":
                    dest = work / "kv.fp8"
                    args = ["compress", str(reference / "kv"), str(dest), "--part-mb", "0.5", "--workers", "1"]
                else:
                    dest = work / "out"
                    args = ["decompress", str(reference / "ref.fp8"), str(dest), "--workers", "1"]
                delay = rng.uniform(0.0, DELAY[command])
                lock, running = threading.Lock(), [True]

                def interrupt(lock=lock, running=running):  # this try's own, bound now
                    with lock:
                        if running[0]:
                            os.kill(os.getpid(), signal.SIGINT)

                timer = threading.Timer(delay, interrupt)
                err = io.StringIO()
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    timer.start()
                    sent = time.monotonic()
                    try:
                        code = main([*args, "--address", "inline"])
                    finally:
                        with lock:
                            running[0] = False
                        timer.cancel()
                    took = time.monotonic() - sent - delay
                time.sleep(0.05)  # a signal still pending lands on the outer handler
                outcomes.append(
                    _check(
                        f"{command} in process, SIGINT at {delay:.2f} s", code, err.getvalue(), took, work, dest, args, reference
                    )
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
