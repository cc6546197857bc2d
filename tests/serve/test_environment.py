"""The environment `fp8ray serve` starts Ray with, without starting it."""

from __future__ import annotations

import os
from pathlib import Path

from fp8ray.serve.environment import HAPROXY_FILES, HAPROXY_PORTS, HAPROXY_SWITCHES, SERVE_SWITCHES, apply_serve_environment


def test_each_setting_is_set_once_and_one_already_given_is_kept(tmp_path):
    environ = {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_HAPROXY_STATS_PORT": "8404"}
    applied = apply_serve_environment(str(tmp_path), haproxy=True, environ=environ)
    assert applied == {name: environ[name] for name in applied}
    assert environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "8404"
    assert environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == SERVE_SWITCHES["RAY_SERVE_THROUGHPUT_OPTIMIZED"]
    for name in HAPROXY_FILES:  # HAProxy's files under the run's directory, removed with it
        assert Path(environ[name]).parent == tmp_path or Path(environ[name]) == tmp_path, (name, environ[name])
    metrics_port = int(environ["RAY_SERVE_HAPROXY_METRICS_PORT"])
    assert 0 < metrics_port < 65536 and metrics_port != 8404


def test_every_name_is_one_that_serve_reads():
    """A misspelt name would be set and ignored: each RAY_SERVE_ one is in Serve's constants."""
    import ray.serve._private.constants as constants

    source = Path(constants.__file__).read_text()
    for name in [*SERVE_SWITCHES, *HAPROXY_SWITCHES, *HAPROXY_FILES, *HAPROXY_PORTS]:
        if name.startswith("RAY_SERVE_"):
            assert f'"{name}"' in source, name


def test_haproxy_only_when_asked_for(tmp_path):
    """Ray's HAProxy serves its statistics and metrics on every interface: not by default."""
    environ: dict[str, str] = {}
    applied = apply_serve_environment(str(tmp_path), environ=environ)
    assert set(applied) == set(SERVE_SWITCHES) and not any("HA_PROXY" in n or "HAPROXY" in n for n in environ), environ


def test_workers_the_commands_own_ray_cannot_place_are_refused_naming_what_is_short():
    """`fp8ray serve` on a Ray it started: nothing will join it, so QuantWorkers that do
    not fit would wait forever, with no line printed."""
    import pytest

    from fp8ray.engine.runtime import check_placeable
    from fp8ray.errors import PoolStartError
    from fp8ray.serve import ServiceOptions

    two_cpus = {"CPU": 2.0, "memory": 1e9}

    def _placeable(service, have):
        check_placeable(service.workers, service.cpus_per_worker, service.gpus_per_worker, have)

    _placeable(ServiceOptions(workers=2), two_cpus)
    _placeable(ServiceOptions(workers=4, cpus_per_worker=0.5), two_cpus)
    with pytest.raises(PoolStartError, match=r"^3 QuantWorkers need 3 CPU\(s\), and the Ray this command started has 2: lower"):
        _placeable(ServiceOptions(workers=3), two_cpus)
    with pytest.raises(PoolStartError, match=r"need 1 GPU\(s\), and the Ray this command started has 0: .*--gpus-per-worker"):
        _placeable(ServiceOptions(workers=1, gpus_per_worker=1.0), two_cpus)


def test_a_haproxy_socket_path_longer_than_haproxy_takes_is_refused_naming_it():
    """HAProxy refuses a socket path over 97 bytes with only "Fatal errors found in
    configuration"; Serve puts the sockets under a folder named by the 56-digit node id.
    Refused before Ray starts, naming the path, the limit and what to change."""
    import pytest

    from fp8ray.errors import InvalidOptionError
    from fp8ray.serve.environment import HAPROXY_SOCKET_MAX, HAPROXY_SOCKETS, NODE_ID_CHARS, check_haproxy_sockets

    def environ_in(folder: str) -> dict[str, str]:
        environ: dict[str, str] = {}
        apply_serve_environment(folder, haproxy=True, environ=environ)
        return environ

    longest_leaf = max(len(HAPROXY_FILES[name]) for name in HAPROXY_SOCKETS)
    fits = HAPROXY_SOCKET_MAX - NODE_ID_CHARS - longest_leaf - 2  # the two slashes
    check_haproxy_sockets(environ_in("/" + "d" * (fits - 1)))
    long = "/" + "d" * fits
    shown = rf"{long}/<node id>/metrics.sock would be 98 bytes long, over HAProxy's limit of 97: set RAY_SERVE_HAPROXY"
    with pytest.raises(InvalidOptionError, match=rf"^--haproxy: HAProxy's socket {shown}"):
        check_haproxy_sockets(environ_in(long))


def test_the_serve_commands_folder_is_short_and_swept_as_the_embedded_rays():
    """Its HAProxy sockets fit under /tmp, and its prefix is one the embedded start sweeps."""
    from fp8ray.engine.runtime import RAY_FOLDER_PREFIX
    from fp8ray.serve.environment import STATE_PREFIX, check_haproxy_sockets

    assert STATE_PREFIX.startswith(RAY_FOLDER_PREFIX)
    environ: dict[str, str] = {}
    apply_serve_environment(f"/tmp/{STATE_PREFIX}xxxxxxxx", haproxy=True, environ=environ)  # mkdtemp's 8 characters
    check_haproxy_sockets(environ)


def test_the_serve_commands_folder_goes_to_tmp_where_ray_tmpdir_is_too_long_for_haproxy(tmp_path, monkeypatch):
    """A deep RAY_TMPDIR (a test's, a job's) put HAProxy's sockets past its limit: `bench
    serve` failed once Ray had started. The folder then goes to /tmp, where they fit."""
    from fp8ray.serve.environment import StateFolder, check_haproxy_sockets, state_parent

    monkeypatch.setenv("RAY_TMPDIR", "/r")  # short enough (only its name is looked at)
    assert state_parent() == "/r"
    deep = tmp_path / ("d" * 40)
    deep.mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(deep))
    assert state_parent() == "/tmp"
    state = StateFolder()
    try:
        assert os.path.dirname(state.path) == "/tmp"
        environ: dict[str, str] = {}
        apply_serve_environment(state.path, haproxy=True, environ=environ)
        check_haproxy_sockets(environ)
    finally:
        state.remove()
    assert not os.path.exists(state.path)
