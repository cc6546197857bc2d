"""fp8ray fidelity: closed-form errors of known perturbations, aggregation, the CLI.

The archive is compressed (scaling none) from small integers, which e4m3fn holds
exactly, so its decoded tensors D equal the compressed ones bit for bit. The ORIGINAL
measured against is then c * D with a known factor c per key (per layer and K/V in the
[2, L, T, H] block): y - x = (1 - c) D, so for c > 0

    rel_fro = |1 - c| / c,   max_abs = |1 - c| max|D|,   snr_db = 20 log10(c / |1 - c|),   cosine = 1.

The factors are powers of two or 1.5, and c * D stays a small integer or half-integer,
so ORIGINAL is exact in bfloat16 too.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat

import pytest
import torch
from _util import no_space
from safetensors.torch import save_file

import fp8ray.io.paths
from fp8ray.cli import main
from fp8ray.engine.archives import compress_archive
from fp8ray.errors import InvalidOptionError, MismatchError
from fp8ray.eval.fidelity import DEFAULT_KEY_PATTERN, classify, fidelity_report

LAYERS = 3
PER_KEY = {"layer00.k": 2.0, "layer00.v": 0.5, "layer01.k": 1.5, "layer01.v": 4.0}
# Block factors, [K/V, layer]: every (kind, layer) slice its own factor.
BLOCK_FACTORS = torch.tensor([[2.0, 0.5, 1.5], [4.0, 0.25, 2.0]])
OTHER_FACTOR = 0.5


def decoded_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ints = lambda *shape: torch.randint(-8, 9, shape, generator=g).to(torch.bfloat16)  # noqa: E731
    tensors = {key: ints(2, 8, 16) for key in PER_KEY}  # [kv_heads, tokens, head_dim]
    tensors["chunk-0001"] = ints(2, LAYERS, 4, 16)  # an LMCache block [2, L, T, H]
    tensors["misc"] = ints(5, 7)  # neither: the total only
    return tensors


def perturbed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {key: (t.double() * PER_KEY[key]).to(torch.bfloat16) for key, t in tensors.items() if key in PER_KEY}
    out["chunk-0001"] = (tensors["chunk-0001"].double() * BLOCK_FACTORS.double()[:, :, None, None]).to(torch.bfloat16)
    out["misc"] = (tensors["misc"].double() * OTHER_FACTOR).to(torch.bfloat16)
    for key in out:  # exact: the factors only shift or add one bit
        assert torch.equal(out[key].double(), tensors[key].double() * _factor_tensor(key, tensors[key]))
    return out


def _factor_tensor(key: str, t: torch.Tensor) -> torch.Tensor:
    if key == "chunk-0001":
        return BLOCK_FACTORS.double()[:, :, None, None].expand(t.shape)
    return torch.full(t.shape, PER_KEY.get(key, OTHER_FACTOR), dtype=torch.float64)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, ray_session):
    root = tmp_path_factory.mktemp("fidelity")
    tensors = decoded_tensors()
    save_file(tensors, str(root / "exact.safetensors"))
    save_file(perturbed(tensors), str(root / "perturbed.safetensors"))
    compress_archive(str(root / "exact.safetensors"), str(root / "arch"), scaling="none")
    return root, tensors


def direct(x_parts: list[torch.Tensor], y_parts: list[torch.Tensor]) -> dict:
    """The metrics over the concatenation of all elements, straight from their definitions."""
    x = torch.cat([p.double().reshape(-1) for p in x_parts])
    y = torch.cat([p.double().reshape(-1) for p in y_parts])
    err = torch.linalg.vector_norm(y - x)
    ref = torch.linalg.vector_norm(x)
    return {
        "rel_fro": float(err / ref),
        "max_abs": float((y - x).abs().max()),
        "snr_db": float(20 * torch.log10(ref / err)),
        "cosine": float(torch.nn.functional.cosine_similarity(x, y, dim=0, eps=0.0)),
        "elements": x.numel(),
    }


def assert_metrics(actual: dict, expected: dict) -> None:
    assert actual["elements"] == expected["elements"]
    assert actual["max_abs"] == expected["max_abs"]  # differences of exact values are exact
    for name in ("rel_fro", "snr_db", "cosine"):
        assert actual[name] == pytest.approx(expected[name], rel=1e-12, abs=1e-12), name


def test_exact_round_trip_has_no_error(stores):
    root, tensors = stores
    report = fidelity_report(str(root / "exact.safetensors"), str(root / "arch"))
    assert set(report.keys) == set(tensors)
    groups = [report.total, *report.kv.values(), *report.keys.values()]
    groups += [m for by_layer in report.layers.values() for m in by_layer.values()]
    for m in groups:
        assert m["rel_fro"] == 0.0 and m["max_abs"] == 0.0 and m["snr_db"] == math.inf and m["cosine"] == 1.0
    # Paths as every archive function takes them (a Path was "not iterable"), and inspect alike
    assert fidelity_report(root / "exact.safetensors", root / "arch") == report
    assert fp8ray.inspect_archive(root / "arch").manifest == fp8ray.inspect_archive(str(root / "arch")).manifest


def test_known_perturbation_matches_closed_form(stores):
    root, tensors = stores
    report = fidelity_report(str(root / "perturbed.safetensors"), str(root / "arch"))
    for key, c in [*PER_KEY.items(), ("misc", OTHER_FACTOR)]:
        m = report.keys[key]
        assert m["rel_fro"] == pytest.approx(abs(1 - c) / c, rel=1e-12)
        assert m["max_abs"] == abs(1 - c) * float(tensors[key].double().abs().max())
        assert m["snr_db"] == pytest.approx(20 * math.log10(c / abs(1 - c)), rel=1e-12)
        assert m["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert report.keys["layer01.k"]["kv"] == "k" and report.keys["layer01.k"]["layer"] == 1
    assert report.keys["chunk-0001"]["layout"] == "block" and report.unsplit == ["misc"]


def test_aggregates_by_kv_and_layer_equal_a_direct_computation(stores):
    root, tensors = stores
    original = perturbed(tensors)
    report = fidelity_report(str(root / "perturbed.safetensors"), str(root / "arch"))
    kind_index = {"k": 0, "v": 1}
    for kind in ("k", "v"):
        all_x, all_y = [], []
        assert sorted(report.layers[kind]) == list(range(LAYERS))
        for layer in range(LAYERS):
            key = f"layer{layer:02d}.{kind}"
            x = [original["chunk-0001"][kind_index[kind], layer]] + ([original[key]] if key in original else [])
            y = [tensors["chunk-0001"][kind_index[kind], layer]] + ([tensors[key]] if key in tensors else [])
            assert_metrics(report.layers[kind][layer], direct(x, y))
            all_x += x
            all_y += y
        assert_metrics(report.kv[kind], direct(all_x, all_y))
    # The total is over every element, "misc" included; not a mean of the per-key ratios.
    keys = sorted(tensors)
    expected_total = direct([original[k] for k in keys], [tensors[k] for k in keys])
    assert_metrics(report.total, expected_total)
    mean_of_ratios = sum(report.keys[k]["rel_fro"] for k in keys) / len(keys)
    assert abs(mean_of_ratios - expected_total["rel_fro"]) > 1e-3  # the two differ here, so the test can tell


def test_block_split_uses_first_dim_as_kv_and_second_as_layer(stores):
    root, tensors = stores
    report = fidelity_report(str(root / "perturbed.safetensors"), str(root / "arch"))
    # Layer 2 exists only in the block: its K error is the block's K factor for layer 2.
    for kind, row in (("k", 0), ("v", 1)):
        c = float(BLOCK_FACTORS[row, 2])
        assert report.layers[kind][2]["rel_fro"] == pytest.approx(abs(1 - c) / c, rel=1e-12)


def test_classify_and_key_patterns():
    pattern = re.compile(DEFAULT_KEY_PATTERN, re.IGNORECASE)
    assert classify("layer07.k", (8, 256, 64), pattern) == ("kv", "k", 7)
    assert classify("model.layer_12-V", (8, 256, 64), pattern) == ("kv", "v", 12)
    assert classify("cache/layers.3.value", (8, 256, 64), pattern) == ("kv", "v", 3)
    assert classify("player07.k", (8, 256, 64), pattern) == ("other", None, None)
    assert classify("chunk", (2, 30, 256, 192), pattern) == ("block", None, None)
    assert classify("chunk", (3, 30, 256, 192), pattern) == ("other", None, None)
    custom = re.compile(r"past\.(?P<layer>\d+)\.(?P<kv>key|value)$", re.IGNORECASE)
    assert classify("past.4.key", (1, 2, 3), custom) == ("kv", "k", 4)


def test_a_layer_group_that_matches_no_digits_names_the_key_and_the_pattern(stores, capsys):
    pattern = r"(?P<kv>k|v)(?P<layer>\d*)"
    with pytest.raises(InvalidOptionError, match=r"key 'layer07\.k': the layer group of key pattern .* matched no digits"):
        classify("layer07.k", (8, 256, 64), re.compile(pattern, re.IGNORECASE))
    with pytest.raises(InvalidOptionError, match=r"matched 'x', not digits"):
        classify("layerx.k", (8, 256, 64), re.compile(r"layer(?P<layer>\w+)\.(?P<kv>k)"))
    root, _ = stores
    code = main(["fidelity", str(root / "exact.safetensors"), str(root / "arch"), "--key-pattern", pattern])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "matched no digits" in err and repr(pattern) in err


def test_bad_key_pattern_is_refused(stores):
    root, _ = stores
    with pytest.raises(ValueError, match="named groups"):
        fidelity_report(str(root / "exact.safetensors"), str(root / "arch"), key_pattern=r"layer(\d+)")
    with pytest.raises(InvalidOptionError, match=r"^key pattern must be a string, got int 5$"):  # re's TypeError before
        fidelity_report(str(root / "exact.safetensors"), str(root / "arch"), key_pattern=5)


def test_cli_json_and_plot(stores, tmp_path, capsys):
    root, _ = stores
    png = tmp_path / "layers.png"
    code = main(["fidelity", str(root / "perturbed.safetensors"), str(root / "arch"), "--json", "--plot", str(png)])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    expected = fidelity_report(str(root / "perturbed.safetensors"), str(root / "arch"))
    assert data["total"] == expected.total
    assert set(data["layers"]["k"]) == {"0", "1", "2"} and data["keys"]["misc"]["layout"] == "other"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


@pytest.mark.parametrize(
    "plot, message",
    [
        ("exact.safetensors", "is the source"),  # the original it reads
        ("arch/_manifest.json", "must not lie inside each other"),  # a file of the archive
        ("arch", "is the source"),
        ("missing/layers.png", "--plot: directory"),
    ],
)
def test_cli_plot_never_writes_over_what_it_reads(stores, capsys, plot, message):
    root, _ = stores
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    code = main(["fidelity", str(root / "exact.safetensors"), str(root / "arch"), "--plot", str(root / plot)])
    out, err = capsys.readouterr()
    assert code == 1 and not out and err.count("\n") == 1 and err.startswith("fp8ray: error: --plot: ") and message in err
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before and not (root / "missing").exists()


def test_cli_plot_is_refused_before_any_work_where_it_cannot_be_written(stores, tmp_path, capsys):
    """A FIFO became a plain PNG file (and /dev/null, for everyone); a .txt or .svg name
    got PNG bytes; an empty name drew nothing, silently."""
    root, _ = stores
    fifo = tmp_path / "layers.png"
    os.mkfifo(fifo)
    for plot, message in (
        (fifo, f"--plot: output {fifo} is a FIFO, not a file"),
        (tmp_path / "layers.txt", "matplotlib writes no .txt files"),
        ("", "a path is empty"),
    ):
        code = main(["fidelity", str(root / "exact.safetensors"), str(root / "arch"), "--plot", str(plot)])
        out, err = capsys.readouterr()
        assert code == 1 and not out and err.count("\n") == 1 and message in err, err
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(tmp_path.iterdir()) == [fifo]
    svg = tmp_path / "layers.svg"
    assert main(["fidelity", str(root / "exact.safetensors"), str(root / "arch"), "--plot", str(svg)]) == 0
    assert svg.read_bytes().lstrip().startswith(b"<?xml")  # the format its name says


def test_cli_plot_replaces_a_file_only_with_overwrite_and_names_a_links_missing_folder(stores, tmp_path, capsys):
    """An existing file was replaced by the plot, silently; a link to a missing folder was
    said to be in "directory . does not exist"; a directory was found only after the work."""
    root, _ = stores
    argv = ["fidelity", str(root / "exact.safetensors"), str(root / "arch"), "--plot"]
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"mine")
    code = main([*argv, str(mine)])
    out, err = capsys.readouterr()
    assert (code, out) == (1, "") and err == f"fp8ray: error: --plot: {mine} already exists (pass --overwrite to replace it)\n"
    assert mine.read_bytes() == b"mine"
    assert main([*argv, str(mine), "--overwrite"]) == 0 and mine.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    link = tmp_path / "link.png"
    link.symlink_to(tmp_path / "gone" / "layers.png")
    assert main([*argv, str(link)]) == 1
    assert capsys.readouterr().err == f"fp8ray: error: --plot: directory {tmp_path / 'gone'} does not exist\n"
    (tmp_path / "plots").mkdir()  # refused only as it was written, after the work
    assert main([*argv, str(tmp_path / "plots"), "--overwrite"]) == 1
    assert capsys.readouterr().err == f"fp8ray: error: --plot: {tmp_path / 'plots'} is a directory; name a file\n"
    # --overwrite without --plot replaces nothing: it was ignored, unsaid (eval-model's too, checked before its model loads)
    for command in (argv[:-1], ["eval-model", "--model", str(tmp_path / "no-model")]):
        assert main([*command, "--overwrite"]) == 1
        assert capsys.readouterr().err == (
            "fp8ray: error: --overwrite replaces a --plot file: give --plot FILE, or leave --overwrite out\n"
        )


def test_cli_plot_on_a_full_disk_names_it_and_leaves_nothing(stores, tmp_path, capsys, monkeypatch):
    """The plot was written in place by matplotlib: a failed write could leave a partial
    PNG, and said matplotlib's words for it. Now written as every output is
    (``write_atomic``: a temporary, then a rename, the temporary removed on failure)."""
    root, _ = stores
    monkeypatch.setattr(fp8ray.io.paths, "write_atomic", no_space)
    png = tmp_path / "layers.png"
    code = main(["fidelity", str(root / "exact.safetensors"), str(root / "arch"), "--plot", str(png)])
    _, err = capsys.readouterr()
    assert (code, err) == (1, f"fp8ray: error: cannot write output {png}: No space left on device\n")
    assert list(tmp_path.iterdir()) == []


def test_cli_text_and_infinite_snr_in_json(stores, capsys):
    root, _ = stores
    assert main(["fidelity", str(root / "exact.safetensors"), str(root / "arch"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"non-standard JSON {name}"))
    assert data["total"]["snr_db"] == "inf" and data["total"]["rel_fro"] == 0.0
    assert main(["fidelity", str(root / "perturbed.safetensors"), str(root / "arch")]) == 0
    out = capsys.readouterr().out
    assert "K all" in out and "V all" in out and "total" in out


def test_missing_keys_are_named(stores, tmp_path, capsys):
    root, tensors = stores
    other = dict(tensors)
    del other["misc"]
    other["extra"] = torch.zeros(3, dtype=torch.bfloat16)
    save_file(other, str(tmp_path / "other.safetensors"))
    with pytest.raises(MismatchError, match=r"missing from .*other\.safetensors: 'misc'; .* missing from archive .*: 'extra'"):
        fidelity_report(str(tmp_path / "other.safetensors"), str(root / "arch"))
    code = main(["fidelity", str(tmp_path / "other.safetensors"), str(root / "arch")])
    _, err = capsys.readouterr()
    assert code == 1 and err.count("\n") == 1 and err.startswith("fp8ray: error:") and "'extra'" in err


def test_shape_mismatch_is_named(stores, tmp_path):
    root, tensors = stores
    other = dict(tensors)
    other["misc"] = torch.zeros(7, 5, dtype=torch.bfloat16)
    save_file(other, str(tmp_path / "reshaped.safetensors"))
    with pytest.raises(MismatchError, match=r"key 'misc': the archive holds \[5, 7\] bfloat16"):
        fidelity_report(str(tmp_path / "reshaped.safetensors"), str(root / "arch"))


def test_a_damaged_archive_is_named_as_the_user_gave_it(stores, tmp_path, capsys, monkeypatch):
    """fidelity named the archive by its absolute path in its errors, where every other
    command echoes the path as typed."""
    import shutil

    root, _ = stores
    shutil.copytree(root / "arch", tmp_path / "arch")
    part = sorted((tmp_path / "arch").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:-20])  # truncated: its size is not its entry's
    monkeypatch.chdir(tmp_path)
    code = main(["fidelity", str(root / "exact.safetensors"), "arch"])
    err = capsys.readouterr().err
    assert code == 1 and " of arch " in err and str(tmp_path) not in err, err
