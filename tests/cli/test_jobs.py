"""The jobs, submitted for real: `ray start --head` on 127.0.0.1 and JobSubmissionClient."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """A real Ray head with its dashboard (the job server), and only its processes stopped."""
    temp_dir = tempfile.mkdtemp(prefix="frj", dir="/tmp")  # short: Ray's socket paths are limited
    gcs_port, dashboard_port = free_port(), free_port()
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PATH=f"{bin_dir}:{os.environ['PATH']}")
    env.pop("RAY_ADDRESS", None)
    cmd = [
        str(bin_dir / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}", "--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=120)
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


@pytest.mark.slow
def test_compress_then_decompress_jobs_succeed(ray_head, kv_source, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    src, tensors = kv_source
    client = JobSubmissionClient(ray_head)
    runtime_env = {"working_dir": str(REPO), "env_vars": {"RAY_AUTH_MODE": "disabled"}}

    def run(entrypoint: str) -> str:
        job = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        deadline = time.time() + 300
        while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
            assert time.time() < deadline, f"job {job} still {status}"
            time.sleep(1)
        logs = client.get_job_logs(job)
        assert status == JobStatus.SUCCEEDED, logs[-3000:]
        return logs

    arch, out = tmp_path / "arch", tmp_path / "out.safetensors"
    logs = run(f"python jobs/compress_archive.py {src} {arch} --workers 2 --scaling token --json")
    assert '"blocks": 12' in logs
    assert (arch / "_manifest.json").exists()
    run(f"python jobs/verify_archive.py {arch} --against {src}")
    run(f"python jobs/decompress_archive.py {arch} {out}")
    back = load_file(str(out))
    assert set(back) == set(tensors) and all(back[k].shape == t.shape for k, t in tensors.items())
