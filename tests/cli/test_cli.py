"""The fp8ray command: exit codes, one-line errors, JSON reports (in-process, on the session Ray)."""

from __future__ import annotations

import json

import pytest
import torch
from _util import run_cli
from safetensors.torch import save_file

from fp8ray.cli import main


def test_a_slow_rate_reads_in_mb_per_second_not_as_zero(tmp_path, capsys):
    """A job of small blocks said "0.00 GB/s of input"."""
    from fp8ray.cli.common import rate

    assert (rate(1.234), rate(0.1), rate(0.0042), rate(0.0)) == ("1.23 GB/s", "0.10 GB/s", "4.20 MB/s", "0.00 MB/s")
    torch.manual_seed(0)
    save_file({"a": torch.randn(4, 64, dtype=torch.bfloat16)}, tmp_path / "small.safetensors")
    code, out, _ = run_cli(capsys, "compress", tmp_path / "small.safetensors", tmp_path / "small.fp8", "--address", "inline")
    assert code == 0 and " MB/s of input on " in out and "0.00 GB/s" not in out, out


def test_a_long_list_of_problems_is_cut_on_stderr_and_whole_in_json(tmp_path, capsys):
    """verify against the wrong tree printed a line per problem: 98,931 lines."""
    from fp8ray.cli.common import LISTED_LINES

    src, other = tmp_path / "src", tmp_path / "other"
    src.mkdir()
    other.mkdir()
    for i in range(LISTED_LINES + 5):
        save_file({"a": torch.ones(4, 64, dtype=torch.bfloat16)}, src / f"f{i:02d}.safetensors")
    save_file({"a": torch.ones(4, 64, dtype=torch.bfloat16)}, other / "g.safetensors")
    assert run_cli(capsys, "compress", src, tmp_path / "arch", "--address", "inline")[0] == 0
    code, out, err = run_cli(capsys, "verify", tmp_path / "arch", "--against", other, "--address", "inline", "--json")
    problems = json.loads(out)["errors"]
    assert code == 1 and len(problems) > LISTED_LINES + 5
    code, _, err = run_cli(capsys, "verify", tmp_path / "arch", "--against", other, "--address", "inline")
    lines = err.splitlines()
    assert code == 1 and lines[:LISTED_LINES] == [f"fp8ray: {p}" for p in problems[:LISTED_LINES]]
    assert lines[LISTED_LINES:] == [
        f"fp8ray: ... and {len(problems) - LISTED_LINES} more problems (--json lists them all)",
        f"fp8ray: error: archive {tmp_path / 'arch'} failed verification ({len(problems)} problems)",
    ]


def test_compress_on_a_terminal_scans_its_source_once(tmp_path, capsys, monkeypatch):
    """The bar's total came from a scan of its own before the work's: seconds more on a
    large tree. Now the engine gives it (on_scan) from the one scan."""
    import sys

    import fp8ray.io.blocks

    def scanned_again(*_):
        raise AssertionError("the source was scanned for the progress bar")

    monkeypatch.setattr(fp8ray.io.blocks, "list_blocks", scanned_again)
    (tmp_path / "src").mkdir()
    for i in range(3):
        save_file({"a": torch.ones(4, 64, dtype=torch.bfloat16)}, tmp_path / "src" / f"f{i}.safetensors")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run_cli(capsys, "compress", tmp_path / "src", tmp_path / "arch", "--address", "inline")
    assert code == 0 and "compressed 3 blocks" in out and "3/3" in err, err


@pytest.mark.usefixtures("ray_session")
def test_compress_inspect_verify_decompress(kv_source, tmp_path, capsys):
    src, tensors = kv_source
    arch = tmp_path / "arch"
    code, out, err = run_cli(capsys, "compress", str(src), str(arch), "--scaling", "block", "--block-size", "64", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["blocks"] == len(tensors) and report["ratio"] > 1.7
    code, out, _ = run_cli(capsys, "inspect", str(arch))
    assert code == 0 and f"{len(tensors)} blocks" in out and "e4m3fn, block 64" in out
    code, out, _ = run_cli(capsys, "verify", str(arch), "--against", str(src))
    assert code == 0 and "ok; worst relative error" in out
    code, out, err = run_cli(capsys, "compress", str(src), str(arch))
    assert code == 1 and err.count("\n") == 1 and "already holds an archive" in err
    code, out, _ = run_cli(capsys, "decompress", str(arch), str(tmp_path / "out.safetensors"))
    assert code == 0 and (tmp_path / "out.safetensors").exists()


@pytest.mark.usefixtures("ray_session")
def test_verify_of_a_damaged_archive_exits_non_zero_naming_the_block(kv_source, tmp_path, capsys):
    import pyarrow.parquet as pq

    src, _ = kv_source
    arch = tmp_path / "arch"
    assert run_cli(capsys, "compress", str(src), str(arch), "--lossless", "none")[0] == 0  # frames as they are
    part = sorted(arch.glob("part-*.parquet"))[0]
    table = pq.read_table(part)
    key, victim = table.column("key")[0].as_py(), table.column("frame")[0].as_py()
    data = bytearray(part.read_bytes())
    data[data.index(victim) + 40] ^= 0xFF
    part.write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "verify", str(arch))
    assert code == 1 and f"block {key!r}" in err and "failed verification" in err.splitlines()[-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compress", "/nonexistent/kv.safetensors", "/tmp/x"], "does not exist"),
        (["inspect", "/nonexistent/archive"], "does not exist"),
        (["verify", "/tmp"], "no _manifest.json"),
    ],
)
def test_user_mistakes_are_one_line_errors(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 1
    assert err.startswith("fp8ray: error: ") and message in err and err.count("\n") == 1


def test_bad_option_is_rejected_by_the_parser_in_one_line(capsys):
    """argparse printed the whole usage (about 12 lines) before its one line."""
    for argv, message in (
        (["compress", "a", "b", "--scaling", "row"], "fp8ray compress: error: argument --scaling: invalid choice: 'row'"),
        (["compress", "a"], "fp8ray compress: error: the following arguments are required: destination"),
        (["nope"], "fp8ray: error: argument command: invalid choice: 'nope'"),
        # named by the command given it: "fp8ray: error: ... (see fp8ray --help)" before
        (["verify", "a", "--no-such-flag"], "fp8ray verify: error: unrecognized arguments: --no-such-flag"),
        (["bench", "lossless", "--no-such-flag"], "fp8ray bench lossless: error: unrecognized arguments: --no-such-flag"),
        (["inspect", "a", "b"], "fp8ray inspect: error: unrecognized arguments: b (see fp8ray inspect --help)"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err
        assert err.endswith(" --help)\n")


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "a", "--against", ""],  # `--against "$SRC"`, SRC unset: it passed, comparing nothing
        ["compress", "a", "b", "--address", ""],
        ["eval-model", "--text", ""],
        ["eval-model", "--model", ""],
        ["serve", "--archives", ""],
    ],
)
def test_an_empty_option_value_is_refused_not_taken_as_left_out(argv, capsys):
    # A bad value after it: where the empty one is let through, the command stops there
    # (rather than serving, or running the model).
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--workers" if argv[0] in ("compress", "serve") else "--prefix", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {argv[-2]}: is empty" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv", [["decompress", "a", "out", "--force"], ["compress", "a", "b", "--over"], ["compress", "a", "b", "--work", "1"]]
)
def test_no_option_is_taken_by_a_prefix_of_its_name(argv, capsys):
    """argparse's default: --force was --force-replace, and deleted the user's files."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unrecognized arguments: --" in err, err


@pytest.mark.parametrize(
    "argv, said",
    [
        (["compress", "SRC", "-"], "compress writes an archive directory, not standard output ('-')"),
        (["lmcache-compress", "SRC", "-", "--layout", "bfloat16:1,2,16,8"], "lmcache-compress writes a store directory"),
        (["lmcache-decompress", "SRC", "-", "--layout", "bfloat16:1,2,16,8"], "lmcache-decompress writes a store directory"),
        (["compress", "SRC", "OUT", "--plain-form", "raw"], "--plain-form says what an LMCache store's files are"),
    ],
)
def test_outputs_and_options_that_would_be_misread_are_refused(argv, said, tmp_path, capsys, monkeypatch):
    """'-' made a file or directory named '-'; --plain-form without --lmcache-layout was
    ignored."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SRC").mkdir()
    code, _, err = run_cli(capsys, *argv, "--address", "inline")
    assert code == 1 and err.startswith("fp8ray: error: ") and said in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SRC"]


@pytest.mark.parametrize(
    "argv, said",
    [
        (["fidelity", "SRC", "SRC", "--plot", "-"], "--plot writes a file, not standard output ('-')"),
        (["capture", "--out", "-", "--text", "SRC"], "--out writes a file, not standard output ('-')"),
        (["compress", "-", "OUT", "--address", "inline"], "source '-': fp8ray reads files, not standard input"),
        (["verify", "-", "--address", "inline"], "archive '-': fp8ray reads files, not standard input"),
        (["verify", "SRC", "--against", "-"], "--against '-': fp8ray reads files, not standard input"),
        (["fidelity", "-", "SRC"], "original '-': fp8ray reads files, not standard input"),
        (["eval-model", "--text", "-"], "--text '-': fp8ray reads files, not standard input"),
    ],
)
def test_a_dash_for_a_file_is_refused_not_taken_as_a_name(argv, said, tmp_path, capsys, monkeypatch):
    """--plot - wrote a PNG file named '-'; an input '-' was "source - does not exist"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SRC").mkdir()
    code, _, err = run_cli(capsys, *argv)
    assert code == 1 and err.startswith("fp8ray: error: ") and said in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SRC"]


def test_sizes_are_said_in_a_unit_that_shows_them(tmp_path, capsys):
    """A small archive read "0.0 MiB -> 0.0 MiB (1.06x)"."""
    from safetensors.torch import save_file

    from fp8ray.io.paths import size_text

    assert [size_text(n) for n in (0, 1023, 1024, 1536, 2**20 - 1, 5 * 2**30)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "1.0 MiB",
        "5.0 GiB",
    ]
    save_file({"k": torch.ones(4, 64)}, str(tmp_path / "kv.safetensors"))
    code, out, _ = run_cli(capsys, "compress", tmp_path / "kv.safetensors", tmp_path / "arch", "--address", "inline")
    assert code == 0 and ": 1.0 KiB -> " in out, out


def test_an_archive_given_as_a_source_is_named_as_one(tmp_path, capsys):
    """Its parts were read as a raw-block Parquet source: "part-00000.parquet: a raw-block
    Parquet source needs columns [...]", naming no archive (compress, verify --against)."""
    from safetensors.torch import save_file

    save_file({"k": torch.ones(4, 64)}, str(tmp_path / "kv.safetensors"))
    arch = tmp_path / "arch"
    assert run_cli(capsys, "compress", tmp_path / "kv.safetensors", arch, "--address", "inline")[0] == 0
    said = f"fp8ray: error: source {arch} is an fp8ray archive, not blocks to compress or compare"
    for argv in (["compress", arch, tmp_path / "again"], ["verify", arch, "--against", arch]):
        code, _, err = run_cli(capsys, *argv, "--address", "inline")
        assert code == 1 and err.startswith(said) and err.count("\n") == 1, err
    assert not (tmp_path / "again").exists()


def test_a_missing_optional_extra_is_a_one_line_error(tmp_path):
    """Without the models extra (transformers made unimportable here), `fp8ray capture`
    says what to install, in one line, instead of a traceback."""
    import subprocess
    import sys

    text = tmp_path / "t.txt"
    text.write_text("a few words of text")
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from fp8ray.cli import main\n"
        f"sys.exit(main(['capture', '--out', {str(tmp_path / 'kv.safetensors')!r}, '--text', {str(text)!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp8ray: error: ") and "fp8ray[models]" in lines[0], (
        result.stderr
    )  # the extra that brings it


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_sizes_must_be_finite_and_positive(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compress", "a.safetensors", "b", "--part-mb", value])
    assert exc.value.code == 2 and "must be a positive number" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "65536", "99999"])
def test_a_port_is_1_to_65535(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", value])
    assert exc.value.code == 2 and "argument --port: must be" in capsys.readouterr().err
