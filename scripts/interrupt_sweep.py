"""Ctrl-C at random moments of an in-process ``fp8ray compress`` or ``decompress``
(``main`` called in this process, SIGINT sent to it by a timer, as
tests/cli/test_interrupts.py does at a dozen seeded points): how many runs were
interrupted, how many finished first, and in how many a temporary (``.tmp-`` in a name)
was left beside the output, or an interrupted run's line said something else than what
it left. A sweep of hundreds of points finds windows too narrow for the test.

    PYTHONPATH=<tree> RAY_AUTH_MODE=disabled .venv/bin/python scripts/interrupt_sweep.py \\
        [--command decompress] [--runs 300] [--max-delay 0.04] [--seed 1]

Run it with PYTHONPATH on two trees to compare them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import shutil
import signal
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test's own helper

from _util import interrupted_main  # noqa: E402


def make_reference(root: Path) -> None:
    """4 files of 6 blocks of 512 KiB, and their archive (a part a block)."""
    import torch
    from safetensors.torch import save_file

    from fp8ray.cli import main

    (root / "kv").mkdir()
    g = torch.Generator().manual_seed(19)
    for f in range(4):
        tensors = {f"layer{i}.k": torch.randn(8, 256, 128, generator=g).to(torch.bfloat16) for i in range(6)}
        save_file(tensors, str(root / "kv" / f"f{f}.safetensors"))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["compress", str(root / "kv"), str(root / "ref.fp8"), "--part-mb", "0.5", "--address", "inline"]) == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--command", choices=["compress", "decompress"], default="decompress")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--max-delay", type=float, default=0.04, help="seconds; each run's delay is uniform up to this")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    signal.signal(signal.SIGINT, lambda *_: None)  # one that comes as main returns
    root = Path(tempfile.mkdtemp(prefix="fp8ray-interrupt-sweep-"))
    try:
        make_reference(root)
        counts = {"interrupted": 0, "finished": 0, "temporary left": 0, "line wrong": 0}
        for run in range(args.runs):
            work = root / f"run{run}"
            work.mkdir()
            dest = work / ("kv.fp8" if args.command == "compress" else "out")
            source = root / ("kv" if args.command == "compress" else "ref.fp8")
            command = [args.command, str(source), str(dest), "--workers", "1", "--address", "inline"]
            code, err, _ = interrupted_main(command, rng.uniform(0.0, args.max_delay))
            counts["finished" if code == 0 else "interrupted"] += 1
            if any(".tmp-" in p.name for p in work.iterdir()):
                counts["temporary left"] += 1
            said_not_created = "not created" in err
            if code == 130 and "--resume" not in err and said_not_created == dest.exists():
                counts["line wrong"] += 1
            shutil.rmtree(work, ignore_errors=True)
        tally = ", ".join(f"{k} {v}" for k, v in counts.items())
        print(f"{args.command}, {args.runs} runs, SIGINT at 0-{args.max_delay} s: {tally}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
