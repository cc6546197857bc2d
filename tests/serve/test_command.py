"""`fp8ray serve`'s command line, without starting Ray."""

from __future__ import annotations

import pytest


def test_an_empty_host_is_refused_as_an_empty_address_is():
    """`--host ''` bound every interface ("listening on http://:18640"): as `--host "$HOST"`
    with HOST unset, it is refused, not taken as the widest address."""
    from fp8ray.cli import build_parser

    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", "--host", ""])
    assert refused.value.code == 2


def test_the_address_printed_is_the_ports_only_on_a_serve_this_command_started(monkeypatch):
    """On a cluster whose Serve already runs, --port is not where it answers: the line
    said it was whenever the command held a connection, a cluster's too."""
    import fp8ray.engine.runtime as runtime
    from fp8ray.cli.serve import listening_on

    monkeypatch.setattr(runtime, "_started_dir", "/tmp/fp8ray-x")  # an embedded Ray
    assert listening_on("127.0.0.1", 18640) == "http://127.0.0.1:18640"
    monkeypatch.setattr(runtime, "_started_dir", None)  # a cluster joined
    assert "18640" not in listening_on("127.0.0.1", 18640)
