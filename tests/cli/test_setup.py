"""scripts/setup is idempotent, and a rerun on a set-up checkout prints nothing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_rerun_of_setup_is_quiet():
    def setup() -> subprocess.CompletedProcess:
        return subprocess.run(["scripts/setup"], cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=600)

    if not (REPO / ".venv" / ".fp8ray-installed").exists():
        assert setup().returncode == 0  # the install a checkout set up before the stamp gets once
    result = setup()
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr
