"""Every shell and Python block of README.md and docs/*.md, run as written.

A fenced block's language says what it is: ``bash``, ``sh``, ``shell`` and ``console``
blocks run with ``bash -e``, ``python`` blocks with this environment's Python; any other
language (``text`` for synopses, layouts and formulas, ``json``) is not a command and is
not run. A block with no language fails its test: say what it is.

A marker, an HTML comment on the line before a block, says what a block needs:

- ``<!-- doc-run: server -->``: a running ``fp8ray serve``. The module starts one, as the
  README types it (127.0.0.1:8000), and gives the block the ``RAY_ADDRESS`` it prints.
- ``<!-- doc-run: lmcache -->``: the ``lmcache`` extra, which the test environment has.
- ``<!-- doc-run: cluster -->``: the block starts a local ``ray start --head`` cluster;
  it runs with its temporary folder as ``RAY_TMPDIR``, and the cluster's processes
  (found by it) are stopped by PID after the block.
- ``<!-- doc-run: skip REASON -->``: not run, for the reason given; only for what cannot
  run here (a cloud cluster, the environment's own installation).

Every block runs with a ``TMPDIR`` of its own, removed after it, so what a block makes
with ``tempfile`` is not left behind. Words after the marker's kind (a reason, a note) are free text. Blocks run in order
within their file, in one scratch directory per file, so a later block may use what an
earlier one wrote (running one block's test runs the earlier ones of its file first). The
scratch directory looks like a checkout (links to the repository's entries, `.venv`
included) and holds what the docs assume the reader has: ``kv/`` (a directory of
safetensors KV caches), ``kv.safetensors`` and ``block.bin`` (one raw bf16 chunk of
``[2, 30, 256, 192]``). Shell blocks run with the environment's ``bin`` on PATH, as
after ``. .venv/bin/activate``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "shell", "console")
PYTHON = ("python",)
KINDS = ("server", "lmcache", "cluster", "skip")
BLOCK_TIMEOUT_S = 600

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*doc-run:\s*(?P<kind>\S+)\s*(?P<note>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    kind: str | None  # the marker's kind, if any
    note: str
    code: str

    @property
    def name(self) -> str:
        shown = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{shown}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent = len(opening["indent"])
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{path.name}:{i + 1}: a code block that is never closed"
        code = "\n".join(line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines[i + 1 : end]) + "\n"
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        found.append(
            Block(path, i + 1, opening["lang"], marker["kind"] if marker else None, marker["note"] if marker else "", code)
        )
        i = end + 1
    return found


BLOCKS = [block for path in DOCS for block in blocks_of(path)]


def runs(block: Block) -> bool:
    return block.lang in SHELL + PYTHON and block.kind != "skip"


# --- what the docs assume: a checkout, KV caches, a server, a cluster ---------------


def kv_cache(seed: int) -> dict:
    import torch

    from fp8ray.eval.sample import sample_kv_chunk

    return {
        f"layer{i}.{kv}": sample_kv_chunk(layers=1, tokens=64, seed=seed * 100 + i * 2 + (kv == "v"), dtype=torch.bfloat16)[0]
        for i in range(4)
        for kv in ("k", "v")
    }


def make_scratch(root: Path) -> Path:
    """A directory that looks like the checkout, holding the inputs the docs assume."""
    import torch
    from safetensors.torch import save_file

    for entry in REPO.iterdir():
        if entry.name not in (".git", "out", ".pytest_cache", "__pycache__"):
            (root / entry.name).symlink_to(entry)
    (root / "kv").mkdir()
    for name, seed in (("a", 1), ("b", 2)):
        save_file(kv_cache(seed), str(root / "kv" / f"{name}.safetensors"), metadata={"tenant": name})
    shutil.copy(root / "kv" / "a.safetensors", root / "kv.safetensors")
    block = torch.randn(2, 30, 256, 192, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    (root / "block.bin").write_bytes(block.view(torch.uint8).numpy().tobytes())
    return root


def base_env() -> dict:
    """A shell as after `. .venv/bin/activate`, with this checkout's fp8ray imported
    (Ray workers too) and Ray's auth mode pinned as the README says."""
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return env


def processes_with(name: str, value: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(name) == value:
                found.append(p)
        except psutil.Error:
            pass
    return found


def kill_all(processes: list[psutil.Process]) -> None:
    for p in processes:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=30)


class Server:
    """`fp8ray serve` as the README starts it, and the RAY_ADDRESS its first line names."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "fp8ray"), "serve"],
            env=base_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + 240
        first = ""
        while time.monotonic() < deadline and not first.startswith("fp8ray serve: listening"):
            first = self.proc.stdout.readline()
            if not first and self.proc.poll() is not None:
                break
        found = re.search(r"RAY_ADDRESS=(\S+)", first)
        if not found:
            self.stop()
            raise AssertionError(f"fp8ray serve did not start: {first!r}")
        self.ray_address = found[1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # it removes the app and the Ray it started
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                kill_all([psutil.Process(self.proc.pid)])


class FileRun:
    """The blocks of one Markdown file, run in order in one scratch directory."""

    def __init__(self, path: Path, scratch: Path, server):
        self.blocks = [b for b in BLOCKS if b.path == path]
        self.scratch = scratch
        self.server = server
        self.outcome: dict[int, str | None] = {}  # line -> None (ran) or what went wrong

    def run_through(self, block: Block) -> None:
        for earlier in self.blocks:
            if earlier.line not in self.outcome and runs(earlier):
                try:
                    self.outcome[earlier.line] = None
                    self.run(earlier)
                except AssertionError as exc:
                    self.outcome[earlier.line] = str(exc)
            if earlier == block:
                break
        failed_before = [f"{self.path_name}:{line}" for line, why in self.outcome.items() if why and line < block.line]
        assert not failed_before, f"an earlier block of the file failed: {failed_before}"
        assert self.outcome[block.line] is None, self.outcome[block.line]

    @property
    def path_name(self) -> str:
        return str(self.blocks[0].path.relative_to(REPO))

    def run(self, block: Block) -> None:
        env = base_env()
        if block.kind == "lmcache":
            import importlib.util

            assert importlib.util.find_spec("lmcache"), f"{block.name} needs the lmcache extra, which scripts/setup installs"
        if block.kind == "server":
            env["RAY_ADDRESS"] = self.server().ray_address
        # A temporary folder of the block's own, removed after it: what a block makes with
        # tempfile is not left in /tmp. Short: Ray's socket paths are limited.
        block_tmp = tempfile.mkdtemp(prefix="fdb", dir="/tmp")
        env["TMPDIR"] = block_tmp
        if block.kind == "cluster":
            env["RAY_TMPDIR"] = block_tmp
        source = self.scratch / f".block_{block.line}.{'py' if block.lang in PYTHON else 'sh'}"
        source.write_text(block.code)
        argv = [sys.executable, str(source)] if block.lang in PYTHON else ["bash", "-e", str(source)]
        try:
            result = subprocess.run(argv, cwd=self.scratch, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"{block.name} ran over {BLOCK_TIMEOUT_S} s: {str(exc.stdout)[-1000:]} {str(exc.stderr)[-2000:]}"
            ) from None
        finally:
            if block.kind == "cluster":
                kill_all(processes_with("RAY_TMPDIR", block_tmp))
            shutil.rmtree(block_tmp, ignore_errors=True)
        assert result.returncode == 0, (
            f"{block.name} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        )


@pytest.fixture(scope="module")
def server():
    """One `fp8ray serve` for the module, started by the first block that needs it."""
    started: list[Server] = []

    def get() -> Server:
        if not started:
            started.append(Server())
        return started[0]

    yield get
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def file_runs(tmp_path_factory, server):
    runs_by_path: dict[Path, FileRun] = {}

    def get(path: Path) -> FileRun:
        if path not in runs_by_path:
            runs_by_path[path] = FileRun(path, make_scratch(tmp_path_factory.mktemp(path.stem.lower())), server)
        return runs_by_path[path]

    return get


def plan(block: Block) -> str:
    """``"run"``, ``"skip"`` or ``"not run"`` (not a command); a block that says nothing
    of what it is, or a marker that does not fit it, fails."""
    assert block.lang, (
        f"{block.name}: a code block with no language; tag it (text for what is not a command, bash or python to run it)"
    )
    assert block.kind is None or block.kind in KINDS, (
        f"{block.name}: unknown doc-run marker {block.kind!r}; expected one of {KINDS}"
    )
    if block.kind == "skip":
        assert block.note, f"{block.name}: a doc-run skip marker must give its reason"
        assert block.lang in SHELL + PYTHON, f"{block.name}: a {block.lang} block is never run; drop its skip marker"
        return "skip"
    if block.lang not in SHELL + PYTHON:
        assert block.kind is None, f"{block.name}: a {block.lang} block is not run; its doc-run marker says otherwise"
        return "not run"  # a synopsis, layout, formula or sample
    return "run"


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_doc_block_runs_as_written(block: Block, file_runs):
    what = plan(block)
    if what == "skip":
        pytest.skip(block.note)
    if what == "run":
        file_runs(block.path).run_through(block)


def test_a_block_that_says_nothing_of_itself_fails(tmp_path):
    """An untagged block, an unknown marker, a skip without a reason: each fails its test."""
    doc = tmp_path / "DOC.md"
    doc.write_text(
        "Text.\n\n```\nfp8ray --version\n```\n\n<!-- doc-run: sever -->\n```bash\ncurl x\n```\n\n"
        "<!-- doc-run: skip -->\n```python\npass\n```\n\n"
        "- a list:\n\n  <!-- doc-run: skip needs a GPU -->\n  ```python\n  if True:\n      pass\n  ```\n"
        "\n```text\nfp8ray compress SRC DST\n```\n"
    )
    untagged, unknown, reasonless, indented, synopsis = blocks_of(doc)
    for bad, says in ((untagged, "no language"), (unknown, "unknown doc-run marker"), (reasonless, "must give its reason")):
        with pytest.raises(AssertionError, match=says):
            plan(bad)
    assert (indented.kind, indented.note, indented.code) == ("skip", "needs a GPU", "if True:\n    pass\n")
    assert plan(indented) == "skip" and plan(synopsis) == "not run"


def test_the_extractor_finds_every_block_and_its_marker():
    """Every fence of every doc is a block (so none slips past the runner), and the README's
    markers are read."""
    for path in DOCS:
        fences = sum(1 for line in path.read_text().splitlines() if line.strip().startswith("```"))
        assert fences == 2 * len([b for b in BLOCKS if b.path == path]), path
    kinds = {b.kind for b in BLOCKS if b.path.name == "README.md"}
    assert {"server", "cluster"} <= kinds, kinds
