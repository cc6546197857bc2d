"""The environment `fp8ray serve` starts Ray with, without starting it."""

from __future__ import annotations

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
