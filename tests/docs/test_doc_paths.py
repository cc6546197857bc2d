"""Every path of this repository that the docs name exists: a doc that cites a test, a
script or a module as its evidence cites one a reader can open."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
# A path under one of the repository's own folders, as the docs write them (`tests/io/test_x.py`).
REPO_PATH = re.compile(r"(?<![\w/.-])((?:fp8ray|tests|scripts|jobs|docs)/[\w/.-]*\w)")


def cited_paths(text: str) -> list[str]:
    return REPO_PATH.findall(text)


def test_the_pattern_finds_the_paths_a_doc_cites():
    text = "see `tests/lmcache/test_x.py` and scripts/demo, not a/tests/y.py nor fp8ray.io.paths"
    assert cited_paths(text) == ["tests/lmcache/test_x.py", "scripts/demo"]


def test_every_path_the_docs_cite_exists():
    missing = [f"{doc.name}: {path}" for doc in DOCS for path in cited_paths(doc.read_text()) if not (REPO / path).exists()]
    cited = sum(len(cited_paths(doc.read_text())) for doc in DOCS)
    assert cited > 50, cited  # the pattern still finds what the docs cite
    assert not missing, missing
