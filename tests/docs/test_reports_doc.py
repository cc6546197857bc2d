"""docs/REPORTS.md lists every field of every ``--json`` report, and no other."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import fp8ray
from fp8ray.engine.archives import CompressReport, DecompressReport, VerifyReport
from fp8ray.engine.stores import StoreReport
from fp8ray.eval.capture import CaptureReport
from fp8ray.eval.eval_model import ModeResult, report_dict
from fp8ray.eval.fidelity import FidelityReport

REPORTS = Path(__file__).resolve().parents[2] / "docs" / "REPORTS.md"


def documented_tables() -> dict[str, list[set[str]]]:
    """Each ``## section``'s tables, in order, as the sets of field names they list
    (a row may name several: ``| `a`, `b` | ... |``)."""
    tables: dict[str, list[set[str]]] = {}
    section, in_table = None, False
    for line in REPORTS.read_text().splitlines():
        if line.startswith("## "):
            section, in_table = line[3:].strip(), False
            tables[section] = []
        elif section and line.startswith("| `"):
            if not in_table:
                tables[section].append(set())
                in_table = True
            tables[section][-1] |= set(re.findall(r"`([^`]+)`", line.split("|")[1]))
        elif not line.startswith("|"):
            in_table = False
    return tables


def placeholder(report_class):
    """An instance of a report dataclass with an empty value of each field's type."""
    empty = {"int": 0, "float": 0.0, "str": "", "list": [], "dict": {}}
    values = {}
    for f in dataclasses.fields(report_class):
        annotation = str(f.type)
        values[f.name] = None if annotation.endswith("None") else empty[re.match(r"\w+", annotation).group()]
    return report_class(**values)


@pytest.mark.parametrize(
    "section, report_class",
    [
        ("compress", CompressReport),
        ("decompress", DecompressReport),
        ("verify", VerifyReport),
        ("fidelity", FidelityReport),
        ("capture", CaptureReport),
        ("lmcache-compress and lmcache-decompress", StoreReport),
    ],
)
def test_each_reports_fields_are_the_documented_ones(section, report_class):
    [table] = documented_tables()[section]
    assert set(placeholder(report_class).as_dict()) == table


def test_eval_models_report_and_its_rows_are_documented():
    report, row = documented_tables()["eval-model"]
    result = placeholder(ModeResult)
    assert set(report_dict("m", "t", 1, 2, [result])) == report
    assert set(result.as_dict()) == row


def test_inspects_report_is_the_manifest_and_the_documented_fields(tmp_path):
    save_file({"a": torch.ones(4, 64, dtype=torch.bfloat16)}, tmp_path / "kv.safetensors")
    fp8ray.compress_archive(tmp_path / "kv.safetensors", tmp_path / "kv.fp8", pool=fp8ray.PoolSettings(address="inline"))
    inspected = fp8ray.inspect_archive(tmp_path / "kv.fp8")
    [table] = documented_tables()["inspect"]
    assert set(inspected.as_dict()) - set(inspected.manifest.to_json()) == table


def test_the_parser_sees_a_field_the_docs_lack():
    """The check can fail: a report with one field more than its table."""

    @dataclasses.dataclass(frozen=True)
    class Grown(CaptureReport):
        extra: int = 0

    [table] = documented_tables()["capture"]
    assert set(placeholder(Grown).as_dict()) - table == {"extra"}
