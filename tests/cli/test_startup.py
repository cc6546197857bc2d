"""Start-up: `fp8ray --help`, `--version` and every command's `--help` load none of the
heavy packages (torch, numba, pyarrow, Ray) and answer in a fraction of a second; Ctrl-C
at any moment of a command's start, while those packages load included, ends it with exit
130 and one line, never a traceback or a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FP8RAY = [sys.executable, "-m", "fp8ray.cli"]
HEAVY = ("torch", "numba", "pyarrow", "ray")


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled")


def imported(stderr: str) -> set[str]:
    """Top-level packages named by ``-X importtime``'s lines."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["compress", "--help"]])
def test_the_command_answers_help_and_version_without_heavy_imports(argv):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fp8ray.cli", *argv], env=env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: fp8ray" in result.stdout or result.stdout.startswith("fp8ray ")
    names = imported(result.stderr)
    assert "fp8ray" in names  # the importtime lines were read
    assert not names & set(HEAVY), sorted(names & set(HEAVY))


def test_every_commands_help_and_import_fp8ray_need_no_heavy_package():
    """Each command's (and bench kind's) --help, found from the parser itself so that a new
    command is covered, and `import fp8ray` with its public names listed, in one process."""
    code = """
import argparse, contextlib, io, sys
import fp8ray
from fp8ray.cli import build_parser, main

def commands(parser, prefix):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, [*prefix, name])
            return
    yield prefix

assert sorted(fp8ray.__all__)  # names only: nothing loaded
seen = list(commands(build_parser(), []))
for argv in seen:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main([*argv, "--help"])
        except SystemExit as exc:
            assert exc.code == 0, argv
print(len(seen), sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY)))
""".replace("HEAVY", repr(HEAVY))
    result = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    count, heavy = result.stdout.split(" ", 1)
    assert int(count) >= 15 and heavy.strip() == "[]", result.stdout


def test_import_fp8ray_keeps_its_public_names():
    """`from fp8ray import ...` as the README writes it still gives the codec, loaded then;
    torch only once a tensor is encoded."""
    code = (
        "import sys, fp8ray; a = 'torch' in sys.modules; from fp8ray import Fp8Codec, decode, CodecOptions; "
        "b = 'torch' in sys.modules; import torch; Fp8Codec().encode(torch.ones(4)); "
        "print(a, b, Fp8Codec.__module__, decode.__module__, CodecOptions.__module__)"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    expected = ["False", "False", "fp8ray.codec.fp8codec", "fp8ray.codec.fp8codec", "fp8ray.codec.options"]
    assert result.stdout.split() == expected, result.stderr[-2000:]


def test_the_cli_flags_are_the_codec_options():
    """The command line's option names and default mode (fp8ray.codec.names, no torch) are
    CodecOptions' own."""
    from fp8ray.codec import DEFAULT_OPTIONS, CodecOptions
    from fp8ray.codec.names import DEFAULT_MODE, OPTION_NAMES, mode_label

    assert CodecOptions.names() == OPTION_NAMES
    assert CodecOptions(**DEFAULT_MODE) == DEFAULT_OPTIONS
    assert mode_label(**DEFAULT_MODE) == DEFAULT_OPTIONS.label()


def best_wall(argv: list[str], runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, env=env(), capture_output=True, check=True, timeout=60)
        best = min(best, time.perf_counter() - start)
    return best


def test_help_takes_a_fraction_of_a_second():
    """Best of 5, beside the interpreter's own start (best of 5 of `python -c pass`): the
    goal is 0.3 s in all here; loading torch alone takes over a second."""
    bare = best_wall([sys.executable, "-c", "pass"])
    help_ = best_wall([*FP8RAY, "--help"])
    assert help_ - bare < 0.3, f"fp8ray --help {help_:.3f} s, python -c pass {bare:.3f} s"


# Moments after the start (s): the first lands in the parser, the others in the handler's
# imports of numba and pyarrow, numba's first kernel load, or the work (the whole command
# takes about 0.55 s here; torch is not loaded). Before about 0.05 s the process is still
# in Python's own start-up, before any fp8ray code runs.
MOMENTS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("startup") / "kv.safetensors"
    save_file({"layer0.k": torch.randn(4, 64, 64).to(torch.bfloat16)}, str(path))
    return path


def test_an_inline_compress_of_safetensors_loads_no_torch(source, tmp_path):
    """The one-shot compress reads files as bytes and encodes them on the CPU kernels:
    torch (about a second of its start-up) is never imported, nor Ray."""
    dest = tmp_path / "kv.fp8"
    code = (
        "import sys\n"
        "from fp8ray.cli import main\n"
        f"status = main(['compress', {str(source)!r}, {str(dest)!r}, '--address', 'inline', '--json'])\n"
        "print(status, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray'}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "0 []", result.stdout[-2000:]
    assert (dest / "_manifest.json").exists()


def test_a_worker_pays_numbas_start_as_it_starts_not_in_its_first_block():
    """numba's first call in a process loads its registries (0.1 s, whichever function):
    a QuantWorker does that as it is made, so a job's first block (and the seconds the
    job reports as work) holds none of it."""
    code = (
        "from fp8ray.codec import checksum\n"
        "from fp8ray.engine.worker import QuantWorker\n"
        "before = len(checksum._combine.signatures)\n"
        "QuantWorker()\n"
        "print(before, len(checksum._combine.signatures))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["0", "1"], result.stdout


@pytest.mark.parametrize("moment", MOMENTS)
def test_ctrl_c_while_the_command_starts_exits_130_in_one_line(source, tmp_path, moment):
    """SIGINT as a terminal sends it, `moment` seconds after the start of an inline
    compress (its start-up loads numba and pyarrow); CI starts children with SIGINT
    ignored, so the child restores the default first, as a shell does."""
    dest = tmp_path / "kv.fp8"
    proc = subprocess.Popen(
        [*FP8RAY, "compress", str(source), str(dest), "--address", "inline"],
        env=env(),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(moment)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    if proc.returncode == 0:  # finished first (a fast machine): nothing to check but the archive
        assert (dest / "_manifest.json").exists()
        return
    assert proc.returncode == 130, f"exit {proc.returncode}: {err[-2000:]}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp8ray: interrupted: "), err[-2000:]
    assert "Traceback" not in err
    assert not dest.exists() or not any(dest.iterdir()), sorted(dest.iterdir())
    assert took < 30, f"took {took:.1f} s to end"


def _run_as_program(package, main: str) -> subprocess.CompletedProcess:
    """Run ``main`` as the ``__main__`` of the package directory ``package`` (made here),
    with ``python -m``, as the ``fp8ray`` program itself runs."""
    package.mkdir()
    (package / "__main__.py").write_text(main)
    return subprocess.run(
        [sys.executable, "-m", package.name],
        env=dict(env(), PYTHONPATH=f"{REPO}:{package.parent}"),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_an_interrupt_caught_in_code_run_from_a_string_still_exits_130(tmp_path):
    """A KeyboardInterrupt raised inside ``exec`` of text (numba's generated code, where
    Ctrl-C at about 1.2 s lands) and caught by the command: under ``python -m`` CPython
    would kill the process with SIGINT at exit (-2) unless the command says it handled it."""
    result = _run_as_program(
        tmp_path / "interrupted_in_exec",
        "import sys\n"
        "import fp8ray.cli\n"
        "fp8ray.cli._run = lambda args: exec('raise KeyboardInterrupt', {})\n"
        "sys.exit(fp8ray.cli.main(['inspect', 'nowhere']))\n",
    )
    assert result.returncode == 130, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert result.stderr.startswith("fp8ray: interrupted: "), result.stderr[-2000:]


def test_an_interrupted_command_ends_in_its_one_line_whatever_fails_in_teardown(tmp_path):
    """An interrupt inside numba's compile can leave an llvmlite object half made, whose
    destructor fails as the process ends ("Exception ignored in ..."): the interrupted
    program's stderr is still its one line."""
    result = _run_as_program(
        tmp_path / "interrupted_mid_object",
        "import sys\n"
        "import fp8ray.cli\n"
        "class HalfMade:\n"
        "    def __del__(self):\n"
        "        raise AttributeError('no _as_parameter_')\n"
        "def run(args):\n"
        "    global kept\n"
        "    kept = HalfMade()\n"
        "    raise KeyboardInterrupt\n"
        "fp8ray.cli._run = run\n"
        "sys.argv = ['fp8ray', 'inspect', 'nowhere']\n"
        "code = fp8ray.cli.main()\n"
        "del kept\n"
        "sys.exit(code)\n",
    )
    assert result.returncode == 130, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert result.stderr.splitlines() == ["fp8ray: interrupted: inspect only reads: nothing changed"], result.stderr[-2000:]


def test_bench_startup_prints_help_beside_the_bare_interpreter(capsys):
    import re

    from fp8ray.cli import main

    assert main(["bench", "startup", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    found = re.fullmatch(
        r"fp8ray bench startup \(best of 2\): fp8ray --help (\d+) ms, python -c pass (\d+) ms: "
        r"([0-9.]+)x the interpreter's own start\n",
        out,
    )
    assert found, out
    help_ms, bare_ms, ratio = int(found[1]), int(found[2]), float(found[3])
    assert 0 < bare_ms <= help_ms and abs(ratio - help_ms / bare_ms) < 0.1 + 0.05 * ratio


def test_bench_startup_times_a_one_shot_compress_beside_its_work(capsys):
    """The command's wall (Python's start, imports, kernels, the work) beside the work
    alone (kernels loaded): its row, and the ratio between them."""
    import re

    from fp8ray.cli import main

    assert main(["bench", "startup", "--repeat", "1", "--compress-mib", "4", "--addresses", "inline"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"^\| 4 MiB \| inline \| ([0-9.]+) ms \| ([0-9.]+) s \| ([0-9.]+)x \| ([0-9.]+) s \|$", out, re.M)
    assert found, out
    work, wall, ratio, reported = float(found[1]) / 1000, float(found[2]), float(found[3]), float(found[4])
    assert 0 < work < reported < wall, out  # the command's own seconds include loading its kernels
    assert abs(ratio - wall / work) < 0.1 + 0.05 * ratio, out
