"""What the sdist and the wheel carry, built as a user builds them (from the tracked
files, by setuptools' own build backend): the sdist a checkout's worth (tests that run,
the docs the README links, the jobs and cluster files, the license), the wheel the
package alone with its license."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[set[str], set[str]]:
    """The names in the sdist (below its top folder) and in the wheel."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout, to build from its tracked files")
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.decode()
    for name in filter(None, tracked.split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    build = f"from setuptools import build_meta as b; b.build_sdist({str(out)!r}); b.build_wheel({str(out)!r})"
    result = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    with tarfile.open(sdist) as t:
        in_sdist = {name.split("/", 1)[1] for name in t.getnames() if "/" in name}
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
    return in_sdist, in_wheel


def test_the_sdist_carries_the_license_the_docs_the_tests_and_the_jobs(built):
    in_sdist, _ = built
    linked = set(re.findall(r"\]\(((?:docs/)?[\w.-]+\.md)", (REPO / "README.md").read_text()))
    assert linked and linked <= in_sdist, linked - in_sdist  # the README's links resolve in it
    tracked = subprocess.run(["git", "ls-files", "tests"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    tests = {name for name in tracked.split() if name.endswith(".py")}
    assert tests <= in_sdist, sorted(tests - in_sdist)[:5]  # tests/_util.py included: they run
    assert {"LICENSE", "cluster.yaml", "serve_config.yaml", "pyproject.toml"} <= in_sdist
    assert any(name.startswith("jobs/") for name in in_sdist)
    assert not [name for name in in_sdist if "__pycache__" in name or name.endswith((".nbi", ".nbc"))]


def test_the_wheel_carries_the_package_and_its_license_alone(built):
    _, in_wheel = built
    tops = {name.split("/", 1)[0] for name in in_wheel}
    assert tops == {"fp8ray", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in in_wheel)
    assert "fp8ray/eval/texts/lighthouse.txt" in in_wheel  # package data: the demo's text
