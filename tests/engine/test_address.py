"""The default address: without ``--address`` and ``RAY_ADDRESS``, a command (and
``PoolSettings()``) joins the cluster a ``ray start`` runs on this machine, else runs its
workers inline without importing Ray; a ``ray_current_cluster`` file left by a cluster
that is gone means inline, at once.

Every command here runs with its own ``RAY_TMPDIR``, so that the ``ray_current_cluster``
it reads is this test's, never that of a cluster someone else runs on the machine."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from _util import free_port, free_ports, processes_with_ray_tmp

from fp8ray.engine import address as addresses

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# Compresses with the command line's defaults, then starts a pool from PoolSettings();
# prints what ran where, and whether Ray was imported at all.
RUN = r"""
import json, os, sys
import psutil
from fp8ray import PoolSettings, QuantPool
from fp8ray.cli import main

code = main(["compress", sys.argv[1], sys.argv[2], "--scaling", "tensor", "--json"])
with QuantPool(PoolSettings(num_workers=1)) as pool:
    address, inline, pids = pool.address, pool.inline, [i.pid for i in pool.worker_info()]
    parents = [psutil.Process(pid).ppid() for pid in pids]  # a Ray worker's: its raylet
print(json.dumps({"code": code, "address": address, "inline": inline, "worker_pids": pids, "parents": parents,
                  "ray_imported": "ray" in sys.modules, "children": [p.pid for p in psutil.Process().children(recursive=True)]}))
"""


def env_for(ray_tmp: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp)
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture
def ray_tmp():
    path = tempfile.mkdtemp(prefix="fad", dir="/tmp")  # short: Ray's socket paths are limited
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("address") / "kv.safetensors"
    save_file({"layer0.k": torch.randn(2, 64, 256).to(torch.bfloat16)}, str(path))
    return path


def run(source: Path, destination: Path, ray_tmp: str, timeout: float = 300) -> tuple[dict, int]:
    """RUN in a fresh Python with ``RAY_TMPDIR=ray_tmp``: its outcome and its PID."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN, str(source), str(destination)],
        env=env_for(ray_tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), proc.pid


def write_cluster_file(ray_tmp: str, address: str) -> None:
    os.makedirs(os.path.join(ray_tmp, "ray"), exist_ok=True)
    Path(ray_tmp, "ray", "ray_current_cluster").write_text(address)


def test_ray_temp_dir_is_rays_own(monkeypatch, tmp_path):
    """The directory the address file is looked for in is the one Ray 2.60 itself uses."""
    from ray._common.utils import get_default_ray_temp_dir

    for variables in ({"RAY_TMPDIR": str(tmp_path / "a")}, {"TMPDIR": str(tmp_path / "b")}, {}):
        monkeypatch.delenv("RAY_TMPDIR", raising=False)
        monkeypatch.delenv("TMPDIR", raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        assert addresses.ray_temp_dir() == get_default_ray_temp_dir(), variables


def test_a_cluster_is_running_only_where_its_port_answers(monkeypatch, ray_tmp):
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    assert addresses.running_local_cluster() is None  # no file
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        live = f"127.0.0.1:{listening.getsockname()[1]}"
        write_cluster_file(ray_tmp, live + "\n")
        assert addresses.running_local_cluster() == live
    gone = f"127.0.0.1:{free_port()}"  # nothing listens there any more
    for text in (gone, "not an address", "", "127.0.0.1:port"):
        write_cluster_file(ray_tmp, text)
        start = time.perf_counter()
        assert addresses.running_local_cluster() is None, text
        assert time.perf_counter() - start < addresses.ANSWER_SECONDS + 0.5, text


def test_the_default_address_in_order(monkeypatch, ray_tmp):
    """RAY_ADDRESS first, then a running local cluster, else inline (in a process not
    already connected to Ray: this test's own Ray, if any, hidden from it)."""
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert addresses.default_address() == addresses.INLINE
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        live = f"127.0.0.1:{listening.getsockname()[1]}"
        write_cluster_file(ray_tmp, live)
        assert addresses.default_address() == live
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
        assert addresses.default_address() == "10.0.0.1:6379"


@pytest.mark.parametrize("cluster_file", ["none", "stale"])
def test_without_a_cluster_a_command_runs_inline_and_never_imports_ray(source, tmp_path, ray_tmp, cluster_file):
    if cluster_file == "stale":  # what a cluster that crashed leaves: the file, no one at the port
        write_cluster_file(ray_tmp, f"127.0.0.1:{free_port()}")
    outcome, pid = run(source, tmp_path / "kv.fp8", ray_tmp, timeout=120)
    assert outcome["code"] == 0 and (tmp_path / "kv.fp8" / "_manifest.json").exists()
    assert outcome["address"] == "inline" and outcome["inline"]
    assert outcome["worker_pids"] == [pid] and not outcome["ray_imported"], outcome  # the worker: the process itself
    assert outcome["children"] == []  # no raylet, no Ray worker: nothing started
    assert os.listdir(ray_tmp) == (["ray"] if cluster_file == "stale" else [])  # no Ray session written


@pytest.fixture
def local_cluster(ray_tmp):
    """A `ray start --head` as a user runs it (recorded in RAY_TMPDIR's ray_current_cluster),
    on ports of its own; its processes stopped by PID afterwards."""
    flags = [
        "--port",
        "--ray-client-server-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
    ]
    ports = dict(zip(flags, free_ports(len(flags))))
    gcs_port = ports["--port"]
    argv = [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false"]
    argv += [f"{flag}={port}" for flag, port in ports.items()] + ["--disable-usage-stats"]
    try:
        subprocess.run(argv, env=env_for(ray_tmp), check=True, capture_output=True, timeout=180)
        recorded = Path(ray_tmp, "ray", "ray_current_cluster").read_text().strip()  # the GCS at the machine's own IP
        assert recorded.endswith(f":{gcs_port}"), recorded
        yield recorded
    finally:
        ours = processes_with_ray_tmp(ray_tmp)
        for p in ours:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(ours, timeout=5)
        for p in alive:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass


@pytest.mark.slow
def test_with_a_local_cluster_running_a_command_joins_it(source, tmp_path, ray_tmp, local_cluster):
    outcome, pid = run(source, tmp_path / "kv.fp8", ray_tmp)
    assert outcome["code"] == 0 and (tmp_path / "kv.fp8" / "_manifest.json").exists()
    assert outcome["address"] == local_cluster and not outcome["inline"]  # PoolSettings()
    # The pool's worker was started by that cluster's raylet (still running), not by a Ray
    # the command started (gone with it).
    raylets = {p.pid for p in processes_with_ray_tmp(ray_tmp) if p.name() == "raylet"}
    assert len(raylets) == 1 and set(outcome["parents"]) == raylets, (outcome, raylets)
    # The command and the pool were each a driver (a job) of that cluster: their logs are
    # in its session (an embedded Ray's would be in a session of its own, removed with it).
    logs = glob.glob(os.path.join(ray_tmp, "ray", "session_latest", "logs", f"python-core-driver-*_{pid}.log"))
    assert len(logs) == 2, sorted(os.listdir(os.path.join(ray_tmp, "ray", "session_latest", "logs")))
    result = compress_at("auto", "--address", source, tmp_path / "auto.fp8", ray_tmp)  # auto: that cluster too
    assert result.returncode == 0 and (tmp_path / "auto.fp8" / "_manifest.json").exists(), result.stderr


def test_on_a_cluster_workers_it_cannot_hold_yet_wait_for_it_to_grow(source, tmp_path, ray_tmp, local_cluster):
    """A cluster's autoscaler may add nodes (cluster.yaml's head has no CPU): QuantWorkers
    it cannot place now wait, up to the start timeout. They were refused at once, as on
    an embedded Ray: "3 QuantWorkers need 3 CPU(s), and the Ray this command started has 2"."""
    said = pool_start(ray_tmp, f"num_workers=3, address={local_cluster!r}, start_timeout=3")
    # What the cluster has in all (it said "lacks 1 CPU(s)" beside its totals, 2 CPUs)
    assert re.match(
        r"only [0-2] of 3 QuantWorkers started within 3 s: each needs 1 CPU\(s\) and 0 GPU\(s\), and the cluster "
        r"has \d+ CPU\(s\) and 0 GPU\(s\) in all \(other actors, another QuantPool's, may hold some\)$",
        said,
    ), said
    # The command says what it waits for once START_NOTICE_SECONDS have gone, then fails
    # at its --start-timeout (it was silent for the whole timeout, 120 s by default).
    argv = [str(BIN / "fp8ray"), "compress", str(source), str(tmp_path / "kv.fp8"), "--address", local_cluster, "--workers", "3"]
    result = subprocess.run([*argv, "--start-timeout", "12"], env=env_for(ray_tmp), capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 2, result.stderr
    assert re.match(
        r"fp8ray: [0-2] of 3 QuantWorkers started in 10 s; waiting up to 12 s in all \(start_timeout, --start-timeout\): "
        r"each needs 1 CPU",
        lines[0],
    ), lines
    assert re.match(r"fp8ray: error: only [0-2] of 3 QuantWorkers started within 12 s: each needs", lines[1]), lines


def test_an_embedded_ray_checked_to_hold_the_workers_says_nothing_while_they_start(ray_tmp):
    """Its actors are only slow to start (a loaded machine): the line about waiting for a
    cluster to place them would mislead (here after 1 ms, where it says it after 10 s)."""
    code = (
        "import fp8ray.engine.backends as backends\n"
        "backends.START_NOTICE_SECONDS = 0.001\n"
        "from fp8ray import PoolSettings, QuantPool\n"
        "with QuantPool(PoolSettings(num_workers=1, address='local')):\n"
        "    print('started')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env_for(ray_tmp), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "started", result.stderr[-3000:]
    assert "QuantWorkers started in" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_the_embedded_rays_folder_of_a_killed_run_goes_at_the_next_start(ray_tmp):
    """A driver killed outright (SIGKILL, the OOM killer) takes its embedded Ray with it,
    but left its folder (logs, sockets) in RAY_TMPDIR for ever; the next start removes it,
    and leaves alone a folder not marked as one of its own. A service's folder (HAProxy's
    files) too, in /tmp where RAY_TMPDIR is too long for HAProxy's sockets."""
    die = (
        "import os\n"
        "import fp8ray.engine.runtime as runtime\n"
        "from fp8ray.serve.environment import StateFolder\n"
        "runtime.connect_ray('local', 1)\n"
        "print(runtime._started_dir, StateFolder().path, flush=True)\n"
        "os._exit(0)\n"  # as SIGKILL would: no clean-up
    )
    result = subprocess.run([sys.executable, "-c", die], env=env_for(ray_tmp), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    left, service_left = map(Path, result.stdout.split())
    assert service_left.parent == Path("/tmp") and service_left.is_dir()
    _, alive = psutil.wait_procs(processes_with_ray_tmp(ray_tmp), timeout=30)  # Ray's processes end with their driver
    assert not alive and left.parent == Path(ray_tmp) and left.is_dir()
    unmarked = Path(ray_tmp, "fp8ray-numba-0")  # another folder of the same prefix: not the embedded Ray's
    unmarked.mkdir()
    assert pool_start(ray_tmp, "num_workers=1, address='local'") == "started"
    assert not left.exists() and not service_left.exists() and unmarked.is_dir()
    assert [p.name for p in Path(ray_tmp).iterdir()] == ["fp8ray-numba-0"]  # the second run's own went with it


def pool_start(ray_tmp: str, settings: str, inside: str | None = None) -> str:
    """What a QuantPool of ``PoolSettings(<settings>)`` says as it starts, in a fresh
    Python with ``RAY_TMPDIR=ray_tmp``: 'started', or its PoolStartError; ``inside``: the
    settings of a pool started first, and running meanwhile."""
    start = (
        "try:\n"
        f"    with QuantPool(PoolSettings({settings})):\n"
        "        print('started')\n"
        "except PoolStartError as exc:\n"
        "    print(exc)\n"
    )
    if inside is not None:
        start = f"with QuantPool(PoolSettings({inside})):\n" + textwrap.indent(start, "    ")
    code = "from fp8ray import PoolSettings, QuantPool\nfrom fp8ray.errors import PoolStartError\n" + start
    result = subprocess.run([sys.executable, "-c", code], env=env_for(ray_tmp), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def compress_at(address: str, given: str, source, out, ray_tmp) -> subprocess.CompletedProcess:
    """``fp8ray compress source out`` with ``address`` given as ``--address`` or as ``RAY_ADDRESS``."""
    env = env_for(ray_tmp)
    argv = [str(BIN / "fp8ray"), "compress", str(source), str(out)]
    if given == "RAY_ADDRESS":
        env["RAY_ADDRESS"] = address
    else:
        argv += ["--address", address]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("given", ["--address", "RAY_ADDRESS"])
def test_an_address_where_no_cluster_answers_is_refused_at_once(source, tmp_path, ray_tmp, given):
    """Ray retries such an address for minutes, printing its warnings: a command says in one
    line that nothing answers there, and writes nothing."""
    gone = f"127.0.0.1:{free_port()}"
    result = compress_at(gone, given, source, tmp_path / "out.fp8", ray_tmp)
    named = f"{gone} (RAY_ADDRESS)" if given == "RAY_ADDRESS" else f"{gone}:"
    assert result.returncode == 1 and result.stderr.startswith(f"fp8ray: error: no Ray cluster answers at {named}"), result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "out.fp8").exists()


@pytest.fixture
def http_port():
    """A port that answers HTTP/1, as a dashboard's does."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_a_port_that_is_not_a_gcs_is_refused_at_once(source, tmp_path, ray_tmp, http_port):
    """The dashboard's port (ray job submit's) passed the check that something answers;
    Ray then retried it for 14 minutes, holding Ctrl-C."""
    result = compress_at(f"127.0.0.1:{http_port}", "--address", source, tmp_path / "out.fp8", ray_tmp)
    assert result.returncode == 1 and result.stderr.startswith(
        f"fp8ray: error: 127.0.0.1:{http_port} answers, but not as a Ray cluster's GCS or client server does (gRPC): "
        "the dashboard's port"
    ), result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "out.fp8").exists()
    result = compress_at(f"http://127.0.0.1:{http_port}", "--address", source, tmp_path / "out.fp8", ray_tmp)
    assert result.returncode == 1 and f"address 'http://127.0.0.1:{http_port}' is a URL" in result.stderr, result.stderr


def test_an_interrupt_while_ray_fails_to_start_is_answered_not_dropped(ray_tmp):
    """A SIGINT held while ray.init ran was dropped when the start then failed: the
    command ended with the start's error, not exit 130."""
    code = (
        "import os, signal\n"
        "import fp8ray.engine.runtime as runtime\n"
        "def failing_init(**_):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    raise RuntimeError('the start failed')\n"
        "runtime.ray.init = failing_init\n"
        "try:\n"
        "    runtime.connect_ray('local', 1)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env_for(ray_tmp),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert result.stdout.strip() == "interrupted", result.stdout + result.stderr[-2000:]
    assert os.listdir(ray_tmp) == []  # the embedded Ray's folder went with it


def test_auto_is_the_cluster_ray_start_records_or_refused_at_once(source, tmp_path, ray_tmp):
    """Ray's own 'auto' retried a cluster gone (a stale ray_current_cluster) for minutes,
    and without one joined any embedded Ray it found running."""
    result = compress_at("auto", "--address", source, tmp_path / "out.fp8", ray_tmp)
    recorded = os.path.join(ray_tmp, "ray", "ray_current_cluster")
    assert result.returncode == 1 and result.stderr == (
        f"fp8ray: error: no Ray cluster runs on this machine (address 'auto' is the one ray start records in {recorded}, "
        "its port answering): start one (ray start --head), or give its HOST:PORT\n"
    ), result.stderr
    os.makedirs(os.path.dirname(recorded), exist_ok=True)
    Path(recorded).write_text(f"127.0.0.1:{free_port()}")  # a cluster gone
    result = compress_at("auto", "RAY_ADDRESS", source, tmp_path / "out.fp8", ray_tmp)
    assert result.returncode == 1 and "no Ray cluster runs on this machine (address 'auto' (RAY_ADDRESS)" in result.stderr


@pytest.mark.parametrize("address", ["bogus", "host:notaport", ":6379"])
@pytest.mark.parametrize("given", ["--address", "RAY_ADDRESS"])
def test_an_address_of_no_known_form_is_refused_naming_the_forms(source, tmp_path, ray_tmp, given, address):
    """Ray's own messages ('Invalid address format: bogus', a 'Malformed host' traceback
    line) named no form an address may take."""
    result = compress_at(address, given, source, tmp_path / "out.fp8", ray_tmp)
    named = f"{address!r} (RAY_ADDRESS)" if given == "RAY_ADDRESS" else repr(address)
    assert result.returncode == 1 and result.stderr == (
        f"fp8ray: error: address {named} is not a Ray address: give HOST:PORT or ray://HOST:PORT (a cluster), "
        "auto (the cluster ray start runs here), local (an embedded Ray) or inline (no Ray)\n"
    ), result.stderr
    assert not (tmp_path / "out.fp8").exists()


def test_gpus_the_pools_own_ray_lacks_are_refused_at_once(ray_tmp):
    """An embedded Ray (``address="local"``) gets no more GPUs than this machine has, and
    nothing else joins it: workers asking for one are refused at once, naming the GPUs,
    not after the start timeout (600 s here) with a message blaming the CPUs too."""
    said = pool_start(ray_tmp, "num_workers=1, gpus_per_worker=1, address='local', start_timeout=600")
    assert said == (
        "1 QuantWorkers need 1 GPU(s), and the Ray this command started has 0: lower --workers or --gpus-per-worker, "
        "or join a cluster with --address"
    ), said
    assert not processes_with_ray_tmp(ray_tmp)


@pytest.mark.parametrize(
    "settings, threads",
    [
        ("num_workers={many}, address='inline'", "{many}"),
        ("num_workers={half}, cpus_per_worker=2.5, address='inline'", "{half2}"),  # 2 codec threads each, 2.5 CPUs
        ("num_workers={many}, cpus_per_worker=0.01, address='local'", "{many}"),  # a process each, whatever its CPUs
    ],
)
def test_a_pool_on_this_machine_alone_is_refused_beyond_four_threads_per_cpu(ray_tmp, settings, threads):
    """``--workers 1000`` on a 2-CPU machine started a thousand Ray worker processes
    (gigabytes of memory) and failed after the start timeout; inline, a thousand threads.
    Refused at once, before Ray starts; up to the limit a pool starts."""
    limit = addresses.LOCAL_THREADS_PER_CPU * (os.cpu_count() or 1)
    sizes = {"many": limit + 1, "half": limit // 2 + 1, "half2": int(2.5 * (limit // 2 + 1))}  # as the Ray it starts counts
    said = pool_start(ray_tmp, settings.format(**sizes))
    assert said == (
        f"{threads.format(**sizes)} codec threads (QuantWorkers times CPUs per worker) on this machine alone, which "
        f"has {os.cpu_count()} CPU(s): more than {limit} only add memory and wait for the CPUs: lower --workers, or "
        "join a cluster with --address"
    ), said
    assert os.listdir(ray_tmp) == []  # no Ray started
    assert pool_start(ray_tmp, f"num_workers={limit}, address='inline'") == "started"


def test_a_pool_joining_another_pools_embedded_ray_is_bounded_too(ray_tmp):
    """The embedded Ray another pool of this process started is this machine's alone as
    well: a pool joining it (by no address: the one connected) was not checked."""
    many = addresses.LOCAL_THREADS_PER_CPU * (os.cpu_count() or 1) + 1
    first = "num_workers=1, cpus_per_worker=0.5, address='local'"
    said = pool_start(ray_tmp, f"num_workers={many}, cpus_per_worker=0.01", inside=first)
    assert said.startswith(f"{many} codec threads (QuantWorkers times CPUs per worker) on this machine alone"), said
    assert os.listdir(ray_tmp) == []


def test_a_pool_joining_a_cluster_is_not_bounded_by_this_machine(ray_session):
    """The limit is for a pool on this machine alone: one joining a Ray (here the
    session's, a cluster of its own) asks the cluster, which may grow."""
    from fp8ray import QuantPool

    many = addresses.LOCAL_THREADS_PER_CPU * (os.cpu_count() or 1) + 1
    with QuantPool(num_workers=many, cpus_per_worker=0.01) as pool:
        assert len(pool.worker_info()) == many


def test_pools_of_two_threads_share_one_embedded_ray_which_the_last_to_close_removes(ray_tmp):
    """Two threads entering ``QuantPool(address="local")`` at once both called ray.init:
    one failed ("called ray.init twice"), its clean-up shut Ray down under the other, and
    a stray default Ray and a session folder were left. Now the second joins the first's
    Ray, which stays until the last pool closes; then the Ray and its folder are gone."""
    code = (
        "import threading, ray, torch\n"
        "from fp8ray import QuantPool, decode\n"
        "first_closed, results = threading.Event(), {}\n"
        "def job(i):\n"
        "    with QuantPool(num_workers=1, cpus_per_worker=0.5, address='local') as pool:\n"
        "        x = torch.full((4, 8), float(i + 1))\n"
        "        if i == 0:\n"
        "            results[i] = torch.equal(decode(pool.encode_many([x])[0]), x)\n"
        "        else:\n"
        "            first_closed.wait(120)  # the other pool closed: this one's Ray must still be there\n"
        "            results[i] = torch.equal(decode(pool.encode_many([x])[0]), x)\n"
        "    if i == 0:\n"
        "        first_closed.set()\n"
        "threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(results == {0: True, 1: True}, ray.is_initialized())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env_for(ray_tmp), capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stdout) == (0, "True False\n"), result.stderr[-3000:]
    assert os.listdir(ray_tmp) == []  # the embedded Ray's folder went with the last pool
    assert "Started a local Ray instance" not in result.stderr  # no stray default Ray


def test_an_embedded_ray_no_pool_closed_is_removed_as_the_process_exits(ray_tmp):
    """A notebook's pool entered and never exited left the embedded Ray's session folder."""
    code = "from fp8ray import QuantPool\nQuantPool(num_workers=1, cpus_per_worker=0.5, address='local').__enter__()\n"
    result = subprocess.run([sys.executable, "-c", code], env=env_for(ray_tmp), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.listdir(ray_tmp) == []


def test_a_sigterm_inside_ray_init_is_held_as_any_other(ray_tmp):
    """ray.init puts its own SIGTERM handler (sys.exit(15)) in place of the one holding
    signals as it starts: a SIGTERM then ended the command with exit code 15 and no line
    (README: 130, and one line). Here ray.init is stood in for by what it does first, then
    the signal; the pool's caller gets it after Ray is stopped, as its own handler's call."""
    code = (
        "import signal, sys\n"
        "import ray\n"
        "from fp8ray.engine import runtime\n"
        "def init(**kwargs):\n"
        "    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init does first\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "ray.init = init\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))\n"
        "try:\n"
        "    runtime.connect_ray('local', 1)\n"
        "except KeyboardInterrupt:\n"
        "    print('held', got, runtime.started_embedded(), ray.is_initialized())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env_for(ray_tmp), capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, f"held [{int(signal.SIGTERM)}] False False\n"), result.stderr[-3000:]
    assert os.listdir(ray_tmp) == []  # the embedded Ray's own directory went with it


def test_a_process_connected_to_ray_refuses_another_address(ray_session):
    """A process holds one Ray connection: an address naming another Ray is refused, not
    silently taken for the one connected; the connected one, by any name of this machine,
    by no address at all, or as ``local`` or ``auto`` (it runs on this machine), is joined."""
    from fp8ray import QuantPool
    from fp8ray.errors import InvalidOptionError

    connected = ray_session.get_runtime_context().gcs_address
    port = int(connected.rpartition(":")[2])
    for same in (None, connected, f"127.0.0.1:{port}", f"localhost:{port}", "auto", "local"):
        with QuantPool(num_workers=1, cpus_per_worker=0.25, address=same) as pool:
            assert pool.worker_info()[0].device == "cpu", same
    other = free_port()
    for asked in (f"127.0.0.1:{other}", f"ray://127.0.0.1:{other}"):  # another cluster; a client it is not
        named = f"Ray at {asked}"
        with pytest.raises(InvalidOptionError, match=f"already connected to Ray at {connected}.*{named} was asked for"):
            with QuantPool(num_workers=1, cpus_per_worker=0.25, address=asked):
                pass
    assert ray_session.is_initialized()
