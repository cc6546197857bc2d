"""Each ``fp8ray bench`` subcommand, run through the command itself on a tiny input, so
that a benchmark cannot rot: it exits 0, prints the lines it promises, and every figure
in them is a finite number. The figures themselves are never asserted (BENCHMARKS.md
records them); runs are in-process, on the session's Ray, as tests/cli's are.
"""

from __future__ import annotations

import math
import os
import re

import pytest

from fp8ray.cli import main
from fp8ray.engine.address import LOCAL_THREADS_PER_CPU

# The shipped text's first tokens and the smallest LMCache chunk worth a table: the
# shipped model's KV cache, captured once per process (the model loads once) by the two
# benches that need it.
KV_TOKENS = 32


def bench(capsys, *argv: str) -> list[str]:
    """The lines ``fp8ray bench ARGV`` printed, after checking that it exited 0."""
    code = main(["bench", *argv])
    out, err = capsys.readouterr()
    assert code == 0, f"fp8ray bench {' '.join(argv)} exited {code}: {err}"
    return out.splitlines()


def figure(text: str) -> float:
    """A printed figure (``1.23``, ``180.3x``, ``2.634%``, ``737280``), checked finite."""
    value = float(text.strip().removesuffix("x").removesuffix("%"))
    assert math.isfinite(value), f"figure {text!r} is not finite"
    return value


def numbers(line: str) -> list[float]:
    """Every number in a line of prose, checked finite (``nan`` and ``inf`` included, to fail)."""
    found = re.findall(r"(?<![\w.])(?:\d+(?:\.\d+)?|nan|inf)(?![\w.])", line)
    return [figure(n) for n in found]


def table(lines: list[str], header_start: str, labels: int) -> list[tuple[list[str], list[float]]]:
    """The rows of the Markdown table whose header starts with ``header_start``: each its
    ``labels`` leading text cells and its figures (every other cell, all finite)."""
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    assert lines[start + 1].startswith("|---") or lines[start + 1].startswith("|--:")
    header = lines[start].strip("|").split("|")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(header), f"row {line!r} has {len(cells)} cells, the header {len(header)}"
        figures = [figure(part) for cell in cells[labels:] for part in cell.split(",")]
        rows.append((cells[:labels], figures))
    return rows


def test_bench_codec(capsys):
    lines = bench(capsys, "codec", "--chunks", "1", "--tokens", "8", "--repeat", "1")
    assert lines[0] == "fp8ray bench codec: bfloat16 input, 1 x [2, 30, 8, 192]"
    rows = table(lines, "| mode | direction |", labels=2)
    # Every scaling (token and block searched, each beside its plain twin), four directions each.
    modes = dict.fromkeys(mode for (mode, _), _ in rows)
    assert len(modes) == 7 and all(len(figures) == 5 for _, figures in rows)
    assert [direction for (_, direction), _ in rows] == ["encode", "encode, new frame", "decode", "decode, new tensor"] * 7
    costs = [line for line in lines if line.startswith("search cost:")]
    assert len(costs) == 2, lines
    for line in costs:  # ratio, the two GB/s, the rounds, the two fractions of the copy
        assert "of its plain twin" in line and "timed in turn" in line and len(numbers(line.split(" encodes at ")[1])) == 6


def test_bench_codec_block_size_goes_to_the_block_rows_and_a_bad_one_fails(capsys):
    """--scaling (a list here) compared as a string refused every --block-size with
    --scaling block (a BENCHMARKS.md command); a bad value left every row out, exit 0."""
    lines = bench(capsys, "codec", "--scaling", "block", "--scaling", "tensor", "--block-size", "16", *SMALL)
    modes = dict.fromkeys(mode for (mode, _), _ in table(lines, "| mode | direction |", labels=2))
    assert list(modes) == [
        "e4m3fn, block 16, bfloat16 scales by mse",
        "e4m3fn, block 16, bfloat16 scales by amax",
        "e4m3fn, tensor, bfloat16 scales by amax",
    ]
    assert main(["bench", "codec", "--block-size", str(2**40), *SMALL]) == 1
    assert "block_size must be a positive integer" in capsys.readouterr().err
    assert main(["bench", "codec", "--scaling", "token", "--block-size", "16", *SMALL]) == 1
    assert "--block-size applies to --scaling block, not token" in capsys.readouterr().err


SMALL = ("--chunks", "1", "--tokens", "4", "--repeat", "1")


@pytest.mark.usefixtures("ray_session")
def test_bench_pipeline(capsys):
    lines = bench(capsys, "pipeline", "--mib", "1", "--files", "1", "--max-workers", "1", "--repeat", "1")
    assert lines[0].startswith("fp8ray bench pipeline: 1 x [2, 30, 256, 192] bfloat16")
    [alone] = [line for line in lines if line.startswith("codec alone, in this process")]
    assert len(numbers(alone.split("):")[1])) == 2
    [(_, figures)] = table(lines, "| workers |", labels=0)
    assert figures[0] == 1 and len(figures) == 10
    [store] = [line for line in lines if line.startswith("object store, 1 workers")]
    assert len(numbers(store.split("):")[1])) == 4
    [refs] = [line for line in lines if line.startswith("by reference, 1 workers")]
    assert len(numbers(refs.split("results left there):")[1])) == 6, refs  # Blocks, tensors, decode: GB/s and ratio each
    [small] = [line for line in lines if line.startswith("small blocks, 1 workers: 360 blocks of 16 KiB instead of 1 (")]
    assert len(numbers(small.split("each): ")[1])) == 4, small


@pytest.mark.slow  # loads the shipped model
@pytest.mark.usefixtures("ray_session")
def test_bench_lossless_captures_its_source_when_missing(capsys, tmp_path, monkeypatch):
    """Where the demo keeps a capture of as many tokens: bench lossless --tokens 32 wrote
    out/demo/kv_smollm2.safetensors, which a later `fp8ray demo` reused as the full text's."""
    monkeypatch.chdir(tmp_path)
    argv = ["--tokens", str(KV_TOKENS), "--stages", "none,zstd:1", "--workers", "1", "--repeat", "1"]
    lines = bench(capsys, "lossless", *argv)
    assert sorted(p.name for p in (tmp_path / "out" / "demo").iterdir()) == [f"kv_smollm2_{KV_TOKENS}.safetensors"]
    assert lines[0].startswith(f"fp8ray bench lossless: kv_smollm2_{KV_TOKENS}.safetensors (")
    rows = table(lines, "| lossless |", labels=1)
    assert [stage for (stage,), _ in rows] == ["none", "zstd:1"]
    assert all(len(figures) == 5 for _, figures in rows)
    none = rows[0][1]
    assert none[2] == 1.0 and none[4] == 1.0  # "vs none" of none itself


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--stages", ","], "--stages ',': name each lossless stage once"),  # an empty table, exit 0
        (["--stages", "zstd:3,zstd:03"], "name each lossless stage once"),  # one row of twice the runs
        (["--source", "."], "--source . is not a file"),  # failed after all the work
        (["--source", "made.safetensors", "--tokens", "8"], "--tokens captures a missing --source"),  # ignored
        (["--source", "x/kv.parquet"], "--source x/kv.parquet does not exist"),  # x/ made first
    ],
)
def test_bench_lossless_mistakes_are_refused_before_any_work(capsys, tmp_path, monkeypatch, argv, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "made.safetensors").write_bytes(b"")
    assert main(["bench", "lossless", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ray: error: ") and said in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made.safetensors"]


@pytest.mark.slow  # loads the shipped model (once per process: the lossless test may have)
def test_bench_lmcache(capsys):
    pytest.importorskip("lmcache")
    lines = bench(capsys, "lmcache", "--tokens", str(KV_TOKENS), "--chunk-tokens", str(KV_TOKENS), "--repeat", "1")
    assert lines[0].startswith(f"fp8ray bench lmcache: SmolLM2-135M KV cache of {KV_TOKENS} tokens as 1 LMCache chunks")
    rows = table(lines, "| serde |", labels=1)
    assert [serde for (serde,), _ in rows][0] == "LMCache fp8" and len(rows) == 3  # the default mode and its fast twin
    assert all(len(figures) == 10 for _, figures in rows)  # "err / fp8 (K, V)" holds two


@pytest.fixture
def serve_after(ray_session):
    """Serve, as the bench leaves it on a Ray it did not start (its app deleted, Serve
    running), shut down: a later test's Serve must bind its own port."""
    yield
    from ray import serve

    serve.shutdown()


@pytest.mark.slow  # starts Serve
@pytest.mark.usefixtures("serve_after")
def test_bench_serve(capsys):
    lines = bench(capsys, "serve", "--sizes", "4K", "--concurrency", "2", "--mib-per-size", "0.01", "--workers", "1")
    assert lines[0].startswith("fp8ray bench serve: POST /v1/encode of bf16 blocks")
    [row] = [line for line in lines if line.lstrip().startswith("4 KiB")]
    # The size, the requests; then rate, p50 and p99 for direct calls and for HTTP; their ratio.
    assert len(numbers(row)) == 9


def test_bench_serve_refuses_a_block_over_the_body_limit_before_starting_anything(capsys):
    """The service would have answered 413 after Ray and Serve had started: an
    AssertionError's traceback some 30 s in."""
    code = main(["bench", "serve", "--sizes", "64K,2M", "--max-body-mb", "1", "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("fp8ray: error: block size 2097152 bytes is over --max-body-mb 1"), err
    assert main(["bench", "serve", "--sizes", "infM"]) == 1
    assert "bad block size 'infM'" in capsys.readouterr().err  # OverflowError's traceback before


@pytest.mark.slow  # starts an embedded Ray
def test_bench_serve_runs_on_a_ray_of_its_own_and_refuses_workers_it_cannot_place():
    """On a cluster's Ray (RAY_ADDRESS) it tore down every Serve application there
    (serve.shutdown), and workers that do not fit waited forever: it starts its own now,
    whatever RAY_ADDRESS says (none answers at this one), and checks they fit."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_ADDRESS="127.0.0.1:1")
    argv = ["bench", "serve", "--sizes", "4K", "--mib-per-size", "0.01", "--workers", "1", "--gpus-per-worker", "1"]
    result = subprocess.run([sys.executable, "-m", "fp8ray.cli", *argv], capture_output=True, text=True, timeout=300, env=env)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("fp8ray: error: 1 QuantWorkers need 1 GPU(s)"), lines


@pytest.mark.parametrize("kib", ["112", "5760", "7"])
def test_bench_pipeline_refuses_a_small_block_that_does_not_cut_a_chunk_before_any_work(capsys, kib):
    """A traceback (RuntimeError of a reshape, or ZeroDivisionError) after the whole table
    had been measured."""
    argv = ["pipeline", "--small-block-kib", kib, "--mib", "1", "--files", "1", "--max-workers", "1", "--address", "inline"]
    assert main(["bench", *argv]) == 1
    out, err = capsys.readouterr()
    assert not out and err.startswith(f"fp8ray: error: --small-block-kib {kib}: a small block's KiB divide"), err


def test_bench_pipeline_refuses_more_workers_than_the_machine_takes_before_any_work(capsys):
    """Refused only once the runs of 1 to 8 workers had been measured, naming --workers."""
    limit = LOCAL_THREADS_PER_CPU * (os.cpu_count() or 1)
    argv = ["pipeline", "--mib", "1", "--files", "1", "--max-workers", limit + 1, "--address", "inline"]
    assert main(["bench", *map(str, argv)]) == 1
    out, err = capsys.readouterr()
    assert not out and err.startswith(f"fp8ray: error: {limit + 1} codec threads"), err
    assert err.rstrip().endswith("lower --max-workers, or join a cluster with --address"), err


def test_bench_startup_times_a_file_of_the_size_it_names(tmp_path):
    """12 MiB wrote 8 (whole blocks of 8 MiB only), and a size under one element divided by zero."""
    from fp8ray.bench.startup import write_source
    from fp8ray.errors import InvalidOptionError

    for mib in (12, 0.5):
        header = 8 + int.from_bytes(write_source(tmp_path, mib).read_bytes()[:8], "little")
        assert (tmp_path / f"kv{mib:g}.safetensors").stat().st_size - header == int(mib * 2**20)
    with pytest.raises(InvalidOptionError, match="less than one bf16 element"):
        write_source(tmp_path, 1e-7)


def test_bench_startup_says_why_a_timed_compress_failed_in_one_line(capsys):
    """A CalledProcessError's traceback, the child's own line swallowed."""
    assert main(["bench", "startup", "--repeat", "1", "--compress-mib", "0.01", "--addresses", "bogus"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8ray: error: the timed compress (--address bogus) failed: fp8ray: error: address 'bogus'")
    assert err.count("\n") == 1, err
