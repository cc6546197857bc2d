"""Real KV caches from the shipped model (SmolLM2-135M-Instruct, GGUF, offline):
``fp8ray capture`` files, and ``fp8ray eval-model``'s output-level fidelity figures."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _util import assert_same_bits, no_space, run_cli

import fp8ray.io.safetensors
from fp8ray.codec import Fp8Codec, decode
from fp8ray.codec.formats import E4M3FN
from fp8ray.codec.metrics import ErrorSums, error_sums, relative_error
from fp8ray.eval.capture import block_key, capture, capture_kv
from fp8ray.eval.eval_model import compare_logits, evaluate_modes, format_markdown, parse_mode
from fp8ray.eval.models import cache_tensors, forward, load_model, read_text, resolve_model, shipped_model_path, tokenize

TEXT = Path(__file__).resolve().parents[2] / "fp8ray" / "eval" / "texts" / "lighthouse.txt"
PREFIX, CONTINUATION = 32, 16  # small: a forward pass of the 135M model costs ~10 ms per token here


@pytest.fixture(scope="module")
def loaded():
    """The shipped model, loaded once for the module (the CLI commands reuse it: loads are
    cached per process)."""
    return load_model()


@pytest.fixture(scope="module")
def text_ids(loaded):
    return tokenize(loaded, read_text(TEXT))


# --- capture ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def captured(loaded, tmp_path_factory):
    path = tmp_path_factory.mktemp("capture") / "kv.safetensors"
    report = capture(path, TEXT, tokens=40)
    return path, report


def test_capture_holds_one_block_per_layer_and_kind_shaped_by_the_config(loaded, captured):
    from safetensors import safe_open

    path, report = captured
    config = loaded.model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = config.head_dim
    expected = [block_key(i, kind) for i in range(layers) for kind in "kv"]
    assert expected == sorted(expected)  # the keys sort in layer order
    with safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == expected
        metadata = f.metadata()
        tensors = {key: f.get_tensor(key) for key in expected}
    for key, t in tensors.items():
        assert t.shape == (kv_heads, 40, head_dim) and t.dtype == torch.bfloat16, key
        assert bool(torch.isfinite(t).all()) and bool(t.ne(0).any()), key
    assert metadata["model"] == loaded.name == "SmolLM2-135M-Instruct.Q4_1"
    assert metadata["tokens"] == "40" and metadata["dtype"] == "bfloat16"
    assert (metadata["layers"], metadata["kv_heads"], metadata["head_dim"]) == (str(layers), str(kv_heads), str(head_dim))
    assert metadata["fp8ray_version"] and report.tokens == 40 and report.bytes == path.stat().st_size

    # The blocks are the model's own cache of those 40 tokens, layer by layer, K and V
    # (the forward pass is deterministic on one machine, so this is bit-exact).
    _, cache = forward(loaded.model, tokenize(loaded, read_text(TEXT), 40))
    for i, (keys, values) in enumerate(cache_tensors(cache)):
        assert_same_bits(tensors[block_key(i, "k")], keys[0].to(torch.bfloat16))
        assert_same_bits(tensors[block_key(i, "v")], values[0].to(torch.bfloat16))


def test_capture_is_a_source_fp8ray_reads(captured):
    from safetensors.torch import load_file

    from fp8ray.io.blocks import bytes_to_tensor, list_blocks, read_blocks

    path, report = captured
    expected = load_file(str(path))
    refs = list_blocks(str(path))
    assert [r.key for r in refs] == list(expected)
    assert all(r.dtype == "bfloat16" and r.shape == tuple(expected[r.key].shape) for r in refs)
    for ref, data in zip(refs, read_blocks(refs)):
        assert_same_bits(bytes_to_tensor(data, ref.dtype, ref.shape), expected[ref.key])


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_capture_compresses_and_verifies(captured, tmp_path, capsys):
    path, report = captured
    code, out, err = run_cli(capsys, "compress", path, tmp_path / "arch", "--scaling", "token", "--json")
    assert code == 0, err
    assert json.loads(out)["blocks"] == 2 * report.layers
    code, out, err = run_cli(capsys, "verify", tmp_path / "arch", "--against", path)
    assert code == 0 and " ok;" in out, err


def test_capture_command(loaded, tmp_path, capsys):
    out = tmp_path / "kv.safetensors"
    code, stdout, err = run_cli(capsys, "capture", "--out", out, "--text", TEXT, "--tokens", 24, "--dtype", "float32", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["tokens"] == 24 and report["dtype"] == "float32" and out.is_file()
    assert report["bytes"] > 2 * report["layers"] * report["kv_heads"] * 24 * report["head_dim"] * 4

    code, _, err = run_cli(capsys, "capture", "--out", out, "--text", TEXT)
    assert code == 1 and "already exists" in err and err.count("\n") == 1


def test_capture_writes_no_progress_bar_into_a_log(tmp_path):
    """transformers' own bars as it loads the model (the GGUF conversion's, through tqdm)
    went to a log as carriage-returned lines, --json or not: stderr is empty now."""
    out = tmp_path / "kv.safetensors"
    argv = [sys.executable, "-m", "fp8ray", "capture", "--out", str(out), "--text", str(TEXT), "--tokens", "8", "--json"]
    result = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr[-2000:]
    assert json.loads(result.stdout)["tokens"] == 8 and out.is_file()


def test_capture_on_a_full_disk_names_the_output(loaded, tmp_path, capsys, monkeypatch):
    """It said pyarrow's "[Errno 28] Error writing bytes to file. Detail: ...", naming no file."""
    monkeypatch.setattr(fp8ray.io.safetensors.SafetensorsWriter, "write", no_space)
    out = tmp_path / "kv.safetensors"
    code, _, err = run_cli(capsys, "capture", "--out", out, "--text", TEXT, "--tokens", 8)
    assert (code, err) == (1, f"fp8ray: error: cannot write output {out}: No space left on device\n")
    assert list(tmp_path.iterdir()) == []  # the writer's temporary removed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--text", "/nonexistent/text.txt"], "text file /nonexistent/text.txt does not exist"),
        (["--text", TEXT, "--model", "/nonexistent/model.gguf"], "model /nonexistent/model.gguf does not exist"),
        (["--text", TEXT, "--tokens", 100000], "100000 were asked for"),
    ],
)
def test_capture_mistakes_are_one_line_errors(loaded, tmp_path, capsys, args, message):
    out = tmp_path / "kv.safetensors"
    code, _, err = run_cli(capsys, "capture", "--out", out, *args)
    assert code == 1 and err.startswith("fp8ray: error: ") and message in err and err.count("\n") == 1
    assert not out.exists() and not list(tmp_path.iterdir())  # no file, not even a temporary one


@pytest.mark.parametrize("where", ["text", "model"])
def test_capture_never_writes_over_what_it_reads(tmp_path, capsys, where):
    """--out is refused before any work (no model loads) when it is the --text file or lies
    in the --model directory, even with --overwrite."""
    text = tmp_path / "story.safetensors"
    text.write_text("The lighthouse stood on the rock.\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    out = text if where == "text" else model / "model.safetensors"
    code, _, err = run_cli(capsys, "capture", "--out", out, "--text", text, "--model", model, "--overwrite")
    assert code == 1 and err.startswith("fp8ray: error: --out: ") and err.count("\n") == 1
    assert text.read_text() == "The lighthouse stood on the rock.\n" and (model / "model.safetensors").read_bytes() == b"weights"


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs a folder nobody may write in, root included")
def test_capture_refuses_an_out_it_cannot_write_before_the_model_runs(tmp_path, capsys):
    """A read-only --out folder was found only as the output was written, after the
    model had run (34 s); here the missing model would be said next, had it not been."""
    text = tmp_path / "story.txt"
    text.write_text("The lighthouse stood on the rock.\n")
    code, _, err = run_cli(capsys, "capture", "--out", "/sys/kernel/kv.safetensors", "--text", text, "--model", tmp_path / "none")
    assert code == 1 and err.startswith("fp8ray: error: --out: cannot write in directory /sys/kernel: "), err
    assert err.count("\n") == 1


def test_capture_never_puts_a_file_in_place_of_a_fifo(tmp_path, capsys):
    """With --overwrite, the rename made the FIFO a plain file (a device node too)."""
    text, out = tmp_path / "story.txt", tmp_path / "kv.safetensors"
    text.write_text("The lighthouse stood on the rock.\n")
    os.mkfifo(out)
    code, _, err = run_cli(capsys, "capture", "--out", out, "--text", text, "--model", tmp_path / "none", "--overwrite")
    assert (code, err) == (
        1,
        f"fp8ray: error: --out: output {out} is a FIFO, not a file: fp8ray writes files only, and never replaces one\n",
    )
    assert stat.S_ISFIFO(out.stat().st_mode)
    link = tmp_path / "link.safetensors"
    link.symlink_to(tmp_path / "nowhere")  # there, though it leads nowhere: replaced only with --overwrite
    code, _, err = run_cli(capsys, "capture", "--out", link, "--text", text, "--model", tmp_path / "none")
    assert code == 1 and "already exists (pass --overwrite" in err and link.is_symlink()
    folder = tmp_path / "d.safetensors"
    folder.mkdir()  # refused after the model had run ("Is a directory"); a missing model would be said first
    code, _, err = run_cli(capsys, "capture", "--out", folder, "--text", text, "--model", tmp_path / "none", "--overwrite")
    assert (code, err) == (1, f"fp8ray: error: output {folder} is a directory; name the .safetensors file to write\n")


def test_a_model_directory_without_its_tokenizer_is_a_one_line_error(loaded, tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny", safe_serialization=True)  # weights, no tokenizer files
    capsys.readouterr()  # transformers' progress bar
    out = tmp_path / "kv.safetensors"
    code, _, err = run_cli(capsys, "capture", "--out", out, "--text", TEXT, "--model", tmp_path / "tiny")
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"fp8ray: error: model {tmp_path / 'tiny'}: its tokenizer cannot be loaded")
    assert not out.exists()


def test_model_argument_resolution(tmp_path):
    shipped = shipped_model_path()
    assert shipped.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and resolve_model(None) == (shipped.parent, shipped.name)
    assert resolve_model(shipped) == (shipped.parent, shipped.name)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model(tmp_path / "hf") == (tmp_path / "hf", None)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.gguf").write_bytes(b"")
    assert resolve_model(tmp_path / "one") == (tmp_path / "one", "m.gguf")
    (tmp_path / "one" / "n.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"exactly one .gguf file; found 2 .gguf files \(m.gguf, n.gguf\)"):
        resolve_model(tmp_path / "one")
    with pytest.raises(ValueError, match="must be a .gguf file"):
        resolve_model(tmp_path / "hf" / "config.json")


# --- modes -----------------------------------------------------------------------------


def test_parse_mode():
    assert parse_mode("e4m3fn:token") == {"label": "e4m3fn:token", "kind": "fp8", "codec": {"fp8": "e4m3fn", "scaling": "token"}}
    assert parse_mode("e5m2:block:block_size=32")["codec"] == {"fp8": "e5m2", "scaling": "block", "block_size": 32}
    # Values that are not all digits stay strings; the codec checks them.
    assert parse_mode("e5m2:none:nonfinite=keep")["codec"] == {"fp8": "e5m2", "scaling": "none", "nonfinite": "keep"}
    assert parse_mode("reference")["kind"] == "reference" and parse_mode("bfloat16")["kind"] == "cast"


@pytest.mark.parametrize(
    "mode, message",
    [
        ("e4m3:token", "unknown fp8 format 'e4m3'"),
        ("e4m3fn:row", "unknown scaling 'row'"),
        ("garbage", "expected FP8:SCALING"),
        ("", "expected FP8:SCALING"),
        ("e4m3fn:block:block_size", "'block_size' is not key=value"),
        ("e4m3fn:block:block_size=", "'block_size=' is not key=value"),
        ("e4m3fn:block:block_size=0", "block_size must be a positive integer"),
        ("e4m3fn:block:block_size=-4", "block_size must be a positive integer"),
        ("e4m3fn:block:blocksize=32", "blocksize"),
        ("e4m3fn:block:block_size=32:block_size=64", "'block_size' is given twice"),
        ("e4m3fn:block:fp8=e5m2", "'fp8' is given twice"),
    ],
)
def test_parse_mode_rejects(mode, message):
    with pytest.raises(ValueError, match="mode ") as exc:
        parse_mode(mode)
    assert message in str(exc.value)


# --- output-level metrics --------------------------------------------------------------


def test_compare_logits_against_hand_computed_values():
    # Row 0: p = (1/2, 1/2), q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3); the
    # argmax ties under p (index 0 both ways). Row 1: p = q, KL 0, argmax 1 both.
    reference = torch.tensor([[0.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    logits = torch.tensor([[math.log(3.0), 0.0], [5.0, 7.0]], dtype=torch.float64)  # row 1: reference + 5
    targets = torch.tensor([1, 0])
    got = compare_logits(reference, logits, targets)
    assert got["kl_nats"] == pytest.approx(0.25 * math.log(4 / 3), rel=1e-12)
    assert got["kl_max_nats"] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    assert got["top1_agreement"] == 1.0
    p1 = 1 / (1 + math.exp(2.0))  # reference probability of token 0 in row 1
    assert got["ppl"] == pytest.approx(math.exp(-(math.log(0.25) + math.log(p1)) / 2), rel=1e-12)
    assert got["ppl_reference"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(p1)) / 2), rel=1e-12)
    assert (
        compare_logits(reference, torch.tensor([[0.0, 1.0], [0.0, 2.0]], dtype=torch.float64), targets)["top1_agreement"] == 0.5
    )


@pytest.fixture(scope="module")
def results(loaded, text_ids):
    modes = ["e5m2:none", "e4m3fn:token", "e4m3fn:block:block_size=32", "bfloat16"]
    return {r.mode: r for r in evaluate_modes(loaded.model, text_ids, PREFIX, CONTINUATION, modes)}


def test_reference_row_is_exact(results, loaded):
    first = next(iter(results.values()))
    assert first.mode == "reference"
    # The untouched cache, rebuilt and rerun: identical logits, so every KL term is p * 0.
    assert first.kl_nats == 0.0 and first.kl_max_nats == 0.0 and first.top1_agreement == 1.0
    assert first.ppl == first.ppl_reference and math.isfinite(first.ppl) and first.ppl > 1
    assert first.k_rel_fro == first.v_rel_fro == 0.0
    assert first.bytes_per_element == loaded.dtype.itemsize


def test_fp8_rows_are_bounded(results, loaded):
    config = loaded.model.config
    shape = (config.num_key_value_heads, PREFIX, config.head_dim)
    reference = results["reference"]
    for mode, r in results.items():
        assert r.kl_nats >= 0 and r.kl_max_nats >= r.kl_nats and 0 <= r.top1_agreement <= 1, mode
        assert math.isfinite(r.ppl) and r.ppl > 1 and r.ppl_reference == reference.ppl_reference, mode
        assert len(r.k_rel_fro_layers) == len(r.v_rel_fro_layers) == config.num_hidden_layers
    for mode in ("e5m2:none", "e4m3fn:token", "e4m3fn:block:block_size=32"):
        codec = Fp8Codec(**parse_mode(mode)["codec"])
        # Every block has the same shape, so bytes per element is one frame's size over its elements.
        assert results[mode].bytes_per_element == codec.encoded_size(shape, loaded.dtype) / math.prod(shape)
    assert results["bfloat16"].bytes_per_element == 2.0
    # e4m3fn, token scaling, on float32: per element |err| <= u/(1+u) |x| + s 2^(emin_sub - 1)
    # + 2^-22 (|x| + |deq|) (docs/ACCURACY.md), s = amax_row / 448. Over a row of head_dim
    # elements, ||err|| <= (1/17) ||x|| + sqrt(head_dim) (amax_row / 448) 2^-10 + ..., and
    # amax_row <= ||row||, so the relative Frobenius error of any set of rows is at most
    # 1/17 + sqrt(head_dim) 2^-10 / 448 + 2^-20 (the fp32 terms, 2^-22 (2 + 1/17) < 2^-20).
    bound = E4M3FN.unit_roundoff / (1 + E4M3FN.unit_roundoff) + math.sqrt(config.head_dim) * 2**-10 / E4M3FN.max + 2**-20
    token = results["e4m3fn:token"]
    assert max(token.k_rel_fro_layers + token.v_rel_fro_layers + [token.k_rel_fro, token.v_rel_fro]) <= bound


# The default mode's relative error on the shipped model's cache over the first 256 tokens,
# measured with the scale search as it was when issue 17 asked for a faster one (K
# 1.5367%, V 1.8717%, rounded up here): no later definition of the search may exceed it.
DEFAULT_MODE_CEILING = {"k": 0.01537, "v": 0.01872}


def test_default_mode_error_on_the_real_cache_stays_under_its_ceiling(loaded):
    blocks = capture_kv(loaded, tokenize(loaded, read_text(TEXT), 256))

    def relative_errors(codec: Fp8Codec) -> dict[str, float]:
        sums = {"k": ErrorSums(), "v": ErrorSums()}
        for key, tensor in blocks.items():
            sums[key.rsplit(".", 1)[1]].add(error_sums(tensor, decode(codec.encode(tensor))))
        return {kind: relative_error(s.err2, s.ref2) for kind, s in sums.items()}

    default, amax = relative_errors(Fp8Codec()), relative_errors(Fp8Codec(scale_choice="amax"))
    for kind in "kv":
        assert default[kind] <= DEFAULT_MODE_CEILING[kind], (kind, default[kind])
        assert default[kind] < 0.85 * amax[kind], (kind, default[kind], amax[kind])  # the search still earns its cost


def test_evaluate_needs_enough_tokens(loaded, text_ids):
    with pytest.raises(ValueError, match=r"has 48 tokens; prefix 32 \+ continuation 16 \+ 1 target needs 49"):
        evaluate_modes(loaded.model, text_ids[:, :48], PREFIX, CONTINUATION, ["e4m3fn:token"])


@pytest.mark.parametrize(
    "change, refusal",
    [
        # two texts were reshaped into one sequence, unsaid
        ({"input_ids": "batch"}, r"input_ids must be one text's ids, \[1, n\] or \[n\], got shape \[2, \d+\]"),
        ({"prefix": 10.5}, r"prefix and continuation must be positive integers, got 10\.5 and 16"),  # torch's slice error
        ({"modes": "e4m3fn:token"}, r"modes must be a list of modes, got one: 'e4m3fn:token'; pass \['e4m3fn:token'\]"),
        ({"modes": [{"fp8": "e4m3fn"}]}, r"a mode given as a dict must be one parse_mode returned"),  # KeyError 'kind'
    ],
)
def test_evaluate_refuses_arguments_naming_them(loaded, text_ids, change, refusal):
    args = {"input_ids": text_ids, "prefix": PREFIX, "continuation": CONTINUATION, "modes": ["e4m3fn:token"], **change}
    if change.get("input_ids") == "batch":
        args["input_ids"] = torch.cat([text_ids, text_ids])
    with pytest.raises(ValueError, match=refusal):
        evaluate_modes(loaded.model, **args)


def test_markdown_table(results):
    lines = format_markdown(list(results.values())).splitlines()
    assert lines[0].startswith("| mode | bytes/elem |") and lines[1].startswith("|---|---:|")
    assert [line.split(" | ")[0] for line in lines[2:]] == [f"| {mode}" for mode in results]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_eval_model_command(results, tmp_path, capsys):
    """The command's rows; and a mode's row does not depend on which modes ran before it
    (each gets a fresh cache from the untouched prefix): e4m3fn:token alone equals its row
    in the fixture's run, where e5m2:none ran first."""
    png = tmp_path / "kl.png"
    code, out, err = run_cli(
        capsys,
        "eval-model",
        "--text",
        TEXT,
        "--prefix",
        PREFIX,
        "--continuation",
        CONTINUATION,
        "--modes",
        "e4m3fn:token",
        "--json",
        "--plot",
        png,
    )
    assert code == 0, err
    rows = json.loads(out)["results"]
    assert [r["mode"] for r in rows] == ["reference", "e4m3fn:token"]
    assert rows[0]["kl_nats"] == 0.0 and rows[1] == results["e4m3fn:token"].as_dict()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--modes", "e4m3fn:row"], "unknown scaling 'row'"),
        (["--text", "/nonexistent/text.txt"], "text file /nonexistent/text.txt does not exist"),
        (["--prefix", 4000, "--modes", "e4m3fn:token"], "+ --continuation 128 + 1 needs 4129"),
    ],
)
def test_eval_model_mistakes_are_one_line_errors(loaded, capsys, args, message):
    code, _, err = run_cli(capsys, "eval-model", "--text", TEXT, *args)
    assert code == 1 and err.startswith("fp8ray: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("modes", [",", "", "e4m3fn:token,", "e4m3fn:token,,e5m2:none"])
def test_eval_model_refuses_an_empty_mode_before_the_model_loads(capsys, modes):
    """A missing model would be reported if it were loaded: the empty mode is refused first."""
    code, _, err = run_cli(capsys, "eval-model", "--text", TEXT, "--model", "/nonexistent/model.gguf", "--modes", modes)
    assert code == 1 and err.count("\n") == 1 and f"--modes {modes!r} has an empty mode" in err


def test_a_row_of_non_finite_figures_is_valid_json():
    """A float16 cast of K/V values past its range gives NaN and inf figures: the --json
    report printed them as NaN and Infinity, which JSON parsers refuse."""
    from fp8ray.eval.eval_model import ModeResult

    nan, inf = float("nan"), float("inf")
    row = ModeResult("float16", nan, nan, 0.5, nan, 9.0, 2.0, inf, 0.1, [inf, 0.1], [0.1, -inf]).as_dict()
    assert json.loads(json.dumps(row, allow_nan=False)) == {
        **row,
        "kl_nats": "nan",
        "ppl_delta": "nan",
        "k_rel_fro": "inf",
        "k_rel_fro_layers": ["inf", 0.1],
        "v_rel_fro_layers": [0.1, "-inf"],
    }
    assert row["kl_max_nats"] == "nan" and row["top1_agreement"] == 0.5


def test_a_plot_of_modes_that_are_all_exact_is_refused_by_name(tmp_path):
    """Only modes of KL 0 (the reference; an exact cast) left nothing on the log axis, and
    matplotlib's "Data cannot be log-scaled" came after the whole run, its results lost
    (run_eval_model now prints them before it draws)."""
    from fp8ray.errors import MismatchError
    from fp8ray.eval.eval_model import ModeResult, plot

    exact = ModeResult("reference", 0.0, 0.0, 1.0, 9.0, 9.0, 2.0, 0.0, 0.0)
    with pytest.raises(MismatchError, match="nothing to plot: every mode's KL is 0"):
        plot([exact], tmp_path / "kl.png", "title")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "where, message",
    [
        ("text", "is the source"),
        ("model", "inside each other"),
        ("nowhere", "directory"),
        ("fifo", "is a FIFO, not a file"),  # replaced by the plot before, as /dev/null would have been
        ("txt", "matplotlib writes no .txt files"),  # refused after the whole run before, its results lost
        ("folder", "is a directory; name a file"),  # refused only as it was written, after the run
        ("file", "already exists (pass --overwrite to replace it)"),  # replaced, silently
    ],
)
def test_eval_model_plot_never_writes_over_what_it_reads(tmp_path, capsys, where, message):
    """--plot is refused before the model loads (the missing model would be reported else)
    when it is the --text file or lies in the --model directory, or its directory is missing."""
    text = tmp_path / "story.txt"
    text.write_text("The lighthouse stood on the rock.\n")
    model = tmp_path / "model"
    model.mkdir()
    fifo = tmp_path / "kl.png"
    plot = {"text": text, "model": model / "kl.png", "nowhere": tmp_path / "missing" / "kl.png"}.get(where, fifo)
    if where == "fifo":
        os.mkfifo(fifo)
    elif where == "folder":
        fifo.mkdir()
    elif where == "file":
        fifo.write_bytes(b"mine")
    plot = tmp_path / "kl.txt" if where == "txt" else plot
    code, _, err = run_cli(capsys, "eval-model", "--text", text, "--model", model, "--plot", plot)
    assert code == 1 and err.startswith("fp8ray: error: ") and message in err and err.count("\n") == 1
    assert text.read_text() == "The lighthouse stood on the rock.\n"
    made = [fifo] if where in ("fifo", "folder", "file") else []
    assert sorted(tmp_path.iterdir()) == sorted([model, text, *made])
    assert where != "fifo" or stat.S_ISFIFO(fifo.stat().st_mode)
    assert where != "file" or fifo.read_bytes() == b"mine"
    assert not list(model.iterdir())
