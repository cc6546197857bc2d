"""``fp8ray bench startup``: the wall time of ``fp8ray --help`` beside the interpreter's own
start (``python -c pass``), best of several runs each, and their ratio; with
``compress_mib``, the wall time of a one-shot ``fp8ray compress`` of that many MiB beside
its work.

The work is ``compress_archive``'s own time (its report's ``seconds``) in this process,
inline, once the kernels are loaded (a first run loads them): what the command does
once it has started. The wall is the whole command, from exec to exit: Python's start,
the imports, the kernels' loading, the address's start (an embedded Ray's, inline none)
and the work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import BadInputError, InvalidOptionError

# A plain mode and no lossless stage: the codec's speed does not hide the rest.
MODE = ("--scaling", "tensor", "--lossless", "none")
BLOCK_MIB = 8  # the 512 MiB as 64 blocks of 8 MiB


def best_wall(argv: list[str], runs: int) -> float:
    """The shortest wall time of ``runs`` runs of ``argv`` (each must exit 0)."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        best = min(best, time.perf_counter() - start)
    return best


def bench_startup(runs: int) -> str:
    bare = best_wall([sys.executable, "-c", "pass"], runs)
    help_ = best_wall([sys.executable, "-m", "fp8ray.cli", "--help"], runs)
    return (
        f"fp8ray bench startup (best of {runs}): fp8ray --help {help_ * 1000:.0f} ms, "
        f"python -c pass {bare * 1000:.0f} ms: {help_ / bare:.1f}x the interpreter's own start"
    )


def bench_compress(sizes_mib: list[float], addresses: list[str], runs: int) -> str:
    """A table: for each size, the work (best of ``runs``) and, for each address, the
    best wall of ``fp8ray compress SRC DST --address A`` and the command's own report of
    its seconds (kernel loading included), in a scratch directory removed afterwards."""
    from ..engine.address import default_address

    lines = [
        f"one-shot fp8ray compress {' '.join(MODE)} --json, best of {runs} "
        f"(work: compress_archive inline in this process, kernels loaded; "
        f"the default address here is {default_address()})",
        "",
        "| size | address | work | wall | wall / work | the command's own seconds |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    scratch = tempfile.mkdtemp(prefix="fp8ray-startup-")
    try:
        for mib in sizes_mib:
            source = write_source(Path(scratch), mib)
            work = best_work(source, Path(scratch) / "work.fp8", runs)
            for address in addresses:
                wall, reported = best_command(source, Path(scratch) / "command.fp8", address, runs)
                row = (f"{mib:g} MiB", address, f"{work * 1000:.1f} ms", f"{wall:.2f} s")
                row += (f"{wall / work:.1f}x", f"{reported:.2f} s")
                lines.append(f"| {' | '.join(row)} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return "\n".join(lines)


def write_source(directory: Path, mib: float) -> Path:
    """A bf16 safetensors file of ``mib`` MiB: blocks of 8 MiB, then one of the rest."""
    import torch
    from safetensors.torch import save_file

    elements = int(mib * 2**20) // 2
    if not elements:
        raise InvalidOptionError(f"--compress-mib {mib:g} is less than one bf16 element", field="compress_mib")
    per_block = BLOCK_MIB * 2**20 // 2
    sizes = [per_block] * (elements // per_block) + ([elements % per_block] if elements % per_block else [])
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.k": torch.randn(size, generator=g).to(torch.bfloat16) for i, size in enumerate(sizes)}
    path = directory / f"kv{mib:g}.safetensors"
    save_file(tensors, str(path))
    return path


def best_work(source: Path, destination: Path, runs: int) -> float:
    from ..engine.archives import compress_archive
    from ..engine.pool import PoolSettings

    inline = PoolSettings(address="inline")
    best = float("inf")
    for run in range(runs + 1):  # the first loads the kernels: not counted
        shutil.rmtree(destination, ignore_errors=True)
        report = compress_archive(str(source), str(destination), scaling="tensor", lossless="none", pool=inline)
        if run:
            best = min(best, report.seconds)
    shutil.rmtree(destination, ignore_errors=True)
    return best


def best_command(source: Path, destination: Path, address: str, runs: int) -> tuple[float, float]:
    """The best wall of the command at ``address`` (``"default"``: none given), and the
    seconds its report gave in that run."""
    argv = [sys.executable, "-m", "fp8ray.cli", "compress", str(source), str(destination), *MODE, "--json"]
    if address != "default":
        argv += ["--address", address]
    best = (float("inf"), 0.0)
    for _ in range(runs):
        shutil.rmtree(destination, ignore_errors=True)
        start = time.perf_counter()
        result = subprocess.run(argv, capture_output=True, text=True)
        if result.returncode:  # its own one line, not CalledProcessError's traceback
            said = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
            raise BadInputError(f"the timed compress (--address {address}) failed: {said}", field="addresses")
        wall = time.perf_counter() - start
        best = min(best, (wall, json.loads(result.stdout)["seconds"]))
    shutil.rmtree(destination, ignore_errors=True)
    return best
