"""The jobs, submitted for real, as the README shows them: Ray started from fp8ray's
environment (`. .venv/bin/activate && ray start --head`), then `ray job submit`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from _util import free_ports
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
ACTIVATE = f". {Path(sys.executable).parent / 'activate'}"  # the README's `. .venv/bin/activate`


def user_env() -> dict:
    """A shell as a user has it: Ray's auth mode pinned (README), no cluster address, and
    nothing of this test process's interpreter on PATH."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    env.pop("VIRTUAL_ENV", None)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if p != bin_dir)
    return env


@pytest.fixture
def ray_head():
    """A real Ray head with its dashboard (the job server), and only its processes stopped."""
    temp_dir = tempfile.mkdtemp(prefix="frj", dir="/tmp")  # short: Ray's socket paths are limited
    gcs_port, dashboard_port, client_port, agent_port, metrics_port = free_ports(5)
    start = (
        f"ray start --head --node-ip-address=127.0.0.1 --port={gcs_port} --include-dashboard=true "
        f"--dashboard-host=127.0.0.1 --dashboard-port={dashboard_port} --ray-client-server-port={client_port} "
        f"--dashboard-agent-listen-port={agent_port} --metrics-export-port={metrics_port} --num-cpus=2 "
        f"--temp-dir={temp_dir} --disable-usage-stats"
    )
    subprocess.run(
        ["bash", "-c", f"{ACTIVATE} && {start}"], cwd=REPO, env=user_env(), check=True, capture_output=True, timeout=120
    )
    try:
        yield f"http://127.0.0.1:{dashboard_port}"
    finally:
        ours = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
        family = {p.pid for p in ours}
        for p in ours:
            try:
                family |= {c.pid for c in p.children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed = []
        for pid in family:
            try:
                killed.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(killed, timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)  # its session folder was left in /tmp on every run


def readme_submit_lines(address: str) -> list[str]:
    """The README's `ray job submit` commands for the local cluster, continuation lines
    joined, its address replaced by the test cluster's."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.startswith("ray job submit --address http://127.0.0.1:8265 ")]
    assert lines, "the README shows no ray job submit line for a local cluster"
    return [line.replace("http://127.0.0.1:8265", address) for line in lines]


@pytest.mark.slow
def test_the_readme_job_lines_work_as_typed_from_outside_the_checkout(ray_head, kv_source, tmp_path):
    """The README's submit lines, typed in a directory outside the repository that holds
    kv/ (FP8RAY_JOBS set as the README sets it); then decompress the same way, and a
    relative path refused in one line showing the absolute form."""
    src, tensors = kv_source
    (tmp_path / "kv").mkdir()
    shutil.copy(src, tmp_path / "kv" / "a.safetensors")
    env = dict(user_env(), FP8RAY_JOBS=str(REPO / "jobs"))

    def submit(line: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", f"{ACTIVATE} && {line}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )

    for line in readme_submit_lines(ray_head):  # compress, then verify
        result = submit(line)
        assert result.returncode == 0 and "succeeded" in result.stdout, (line, (result.stdout + result.stderr)[-3000:])
    assert (tmp_path / "kv.fp8" / "_manifest.json").exists()
    base = f'ray job submit --address {ray_head} --working-dir "$FP8RAY_JOBS" -- python'
    result = submit(f'{base} decompress_archive.py "$PWD/kv.fp8" "$PWD/back"')
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    back = load_file(str(tmp_path / "back" / "a.safetensors"))
    assert set(back) == set(tensors) and all(back[k].shape == t.shape for k, t in tensors.items())

    result = submit(f"{base} compress_archive.py kv/ kv2.fp8")
    assert result.returncode != 0 and not (tmp_path / "kv2.fp8").exists()
    errors = {line for line in result.stdout.splitlines() if line.startswith("fp8ray: error:")}  # Ray shows the log twice
    (error,) = errors
    assert "'kv/' (type \"$PWD/kv/\")" in error and "'kv2.fp8' (type \"$PWD/kv2.fp8\")" in error, result.stdout[-3000:]


def test_a_job_run_by_a_python_without_fp8ray_says_so_in_one_line(tmp_path):
    bare = Path(sys.base_prefix) / "bin" / "python3"
    if subprocess.run([str(bare), "-c", "import fp8ray"], capture_output=True).returncode == 0:
        pytest.skip("the base interpreter has fp8ray installed")
    result = subprocess.run(
        [str(bare), "jobs/compress_archive.py", "a", "b"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not installed for" in lines[0] and "ray start --head" in lines[0], result.stderr
