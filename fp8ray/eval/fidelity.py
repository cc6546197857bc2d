"""Fidelity of an archive against its original: error per key, per layer and K/V, in aggregate.

``fp8ray fidelity ORIGINAL ARCHIVE [--json] [--plot out.png]`` decodes every frame of
ARCHIVE (an fp8ray archive directory) and compares it with the same key of ORIGINAL (a
safetensors file or directory, or raw-block Parquet: whatever :mod:`fp8ray.io.blocks` reads).

Two layouts of KV caches are split into K/V and layers:

- **per-key tensors** whose key matches a pattern with named groups ``layer`` (digits)
  and ``kv`` (``k``/``key`` or ``v``/``value``, any case); the default matches
  ``layer07.k``, ``model.layer_7-v``, ``layer7/value``...: :data:`DEFAULT_KEY_PATTERN`;
- **LMCache chunk blocks**: any other tensor of shape ``[2, L, T, H]``; index 0 of the
  first dimension is K, 1 is V, the second dimension the layer.

Every other key counts in the per-key table and the overall aggregate only.

The metrics (relative Frobenius error, max abs error, SNR, cosine) are those of
:mod:`fp8ray.codec.metrics`, each group's from the sums over all of its elements.
``--json`` writes +-inf as the strings ``"inf"``/``"-inf"`` so that strict JSON parsers
accept it.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field

from ..codec import decode
from ..codec.blocks import tensor_to_bytes
from ..codec.bound import check_identical
from ..codec.formats import is_stored
from ..codec.metrics import ErrorSums, json_safe, row_sums
from ..errors import CorruptArchiveError, InvalidOptionError, MismatchError
from ..io import archive
from ..io.blocks import bytes_to_tensor, read_blocks, scan_source
from ..io.paths import as_uri, name_list, resolve
from .plots import save_figure

DEFAULT_KEY_PATTERN = r"(?:^|[^a-z0-9])layers?[._-]?(?P<layer>\d+)[._/-](?P<kv>k|v|key|value)$"
KINDS = ("k", "v")


def classify(key: str, shape: tuple[int, ...], pattern: re.Pattern) -> tuple[str, str | None, int | None]:
    """``("kv", "k"|"v", layer)`` for a per-key tensor, ``("block", None, None)`` for a
    ``[2, L, T, H]`` chunk block, ``("other", None, None)`` for anything else."""
    match = pattern.search(key)
    if match:
        kind = (match.group("kv") or "").lower()[:1]  # None: an optional group that took no part
        if kind not in KINDS:
            raise MismatchError(f"key {key!r}: the pattern's kv group matched {match.group('kv')!r}; it must start with k or v")
        layer = match.group("layer")
        if not layer or not layer.isdecimal():  # an optional or empty group, (?P<layer>\d*): no layer number
            found = "no digits" if not layer else f"{layer!r}, not digits"
            raise InvalidOptionError(
                f"key {key!r}: the layer group of key pattern {pattern.pattern!r} matched {found}; "
                "it must match the layer number, as (?P<layer>\\d+) does"
            )
        return "kv", kind, int(layer)
    if len(shape) == 4 and shape[0] == 2:
        return "block", None, None
    return "other", None, None


@dataclass
class FidelityReport:
    original: str
    archive: str
    codec: dict
    key_pattern: str
    keys: dict[str, dict] = field(default_factory=dict)  # key -> metrics, kind, layer, shape, dtype
    layers: dict[str, dict[int, dict]] = field(default_factory=lambda: {"k": {}, "v": {}})
    kv: dict[str, dict] = field(default_factory=dict)  # "k"/"v" -> metrics over all layers
    total: dict = field(default_factory=dict)
    unsplit: list[str] = field(default_factory=list)  # keys in the total only
    stored: list[str] = field(default_factory=list)  # keys of stored frames: checked identical, not measured

    def as_dict(self) -> dict:
        return json_safe(
            {
                "original": self.original,
                "archive": self.archive,
                "codec": self.codec,
                "key_pattern": self.key_pattern,
                "total": self.total,
                "kv": self.kv,
                "layers": {kind: {str(layer): m for layer, m in sorted(by.items())} for kind, by in self.layers.items()},
                "unsplit": self.unsplit,
                "stored": self.stored,
                "keys": self.keys,
            }
        )


def _missing_message(only_archive: list[str], only_original: list[str], archive: str, original: str) -> str:
    def names(keys: list[str]) -> str:
        shown = ", ".join(repr(k) for k in keys[:5])
        return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

    problems = []
    if only_archive:
        problems.append(f"{len(only_archive)} key(s) of archive {archive} are missing from {original}: {names(only_archive)}")
    if only_original:
        problems.append(f"{len(only_original)} key(s) of {original} are missing from archive {archive}: {names(only_original)}")
    return "; ".join(problems)


def fidelity_report(
    original: str | os.PathLike, archive_uri: str | os.PathLike, key_pattern: str = DEFAULT_KEY_PATTERN
) -> FidelityReport:
    """Decode every frame of ``archive_uri`` and measure it against ``original``.

    Runs in this process, one archive part at a time (its frames and the matching
    original blocks in memory). Raises :class:`MismatchError` naming the keys when the
    two do not hold the same keys, or a key's shape or dtype differs.
    """
    original, archive_uri = as_uri(original, "original"), as_uri(archive_uri, "archive")
    if not isinstance(key_pattern, str):  # re's "first argument must be string or compiled pattern" named nothing
        raise InvalidOptionError(f"key pattern must be a string, got {type(key_pattern).__name__} {key_pattern!r}")
    try:
        pattern = re.compile(key_pattern, re.IGNORECASE)
    except re.error as exc:
        raise InvalidOptionError(f"key pattern {key_pattern!r} is not a valid regular expression: {exc}") from exc
    if not {"layer", "kv"} <= set(pattern.groupindex):
        raise InvalidOptionError(f"key pattern {key_pattern!r} needs the named groups (?P<layer>...) and (?P<kv>...)")

    fs, path = resolve(archive_uri)
    manifest = archive.read_manifest(fs, path, archive_uri)  # messages name it as given
    layout = manifest.layout
    refs = archive.blocks_by_ident(layout, *scan_source(original), original)
    columns = archive.read_metadata_columns(fs, path, manifest, ["file", "key"], archive_uri)
    index = [(part, list(zip(c["file"], c["key"]))) for part, c in zip(manifest.parts, columns)]
    name_files = layout is not None and len(layout.files) > 1

    def label(ident: tuple[str, str]) -> str:  # a block's name in the report
        return f"{ident[0]}:{ident[1]}" if name_files else ident[1]

    archived_ids = [i for _, ids in index for i in ids]
    only_archive = [label(i) for i in archived_ids if i not in refs]
    archived = set(archived_ids)
    only_original = [label(i) for i in refs if i not in archived]
    if only_archive or only_original:
        raise MismatchError(_missing_message(only_archive, only_original, archive_uri, original))

    report = FidelityReport(original, archive_uri, manifest.codec, key_pattern)
    total = ErrorSums()
    per_kind = {kind: ErrorSums() for kind in KINDS}
    per_layer: dict[str, dict[int, ErrorSums]] = {kind: {} for kind in KINDS}
    for part, ids in index:
        table = archive.read_part(fs, path, part, columns=["frame"], uri=archive_uri)
        part_refs = [refs[i] for i in ids]
        for ident, ref, data, frame in zip(ids, part_refs, read_blocks(part_refs), archive.iter_frames(table)):
            x = bytes_to_tensor(data, ref.dtype, ref.shape)
            try:
                y = decode(frame)
            except InvalidOptionError:
                raise  # FP8RAY_NUM_THREADS, not the archive
            except (ValueError, TypeError) as exc:
                raise CorruptArchiveError(f"key {ref.key!r} in {part.name}: {exc}") from exc
            if tuple(y.shape) != tuple(x.shape) or y.dtype != x.dtype:
                raise MismatchError(
                    f"key {ref.key!r}: the archive holds {list(y.shape)} {str(y.dtype).removeprefix('torch.')}, "
                    f"{original} {list(x.shape)} {ref.dtype}"
                )
            if is_stored(ref.dtype):  # not fp8: its bytes as they are, so no error to measure, only equality
                differs = check_identical(data, tensor_to_bytes(y), ref.dtype, ref.shape)
                if differs is not None:
                    raise MismatchError(f"key {ref.key!r}: {differs}: {original} is not what the archive was made from")
                report.stored.append(label(ident))
                continue
            what, kind, layer = classify(ref.key, tuple(x.shape), pattern)
            x64, y64 = x.double(), y.double()
            if what == "block":
                # Rows: (K, layer 0), ..., (K, layer L-1), (V, layer 0), ...
                n_layers = x.shape[1]
                rows = row_sums(x64.reshape(2 * n_layers, -1), y64.reshape(2 * n_layers, -1))
                key_sums = ErrorSums()
                for i, sums in enumerate(rows):
                    kind_i, layer_i = KINDS[i // n_layers], i % n_layers
                    per_layer[kind_i].setdefault(layer_i, ErrorSums()).add(sums)
                    per_kind[kind_i].add(sums)
                    key_sums.add(sums)
            else:
                (key_sums,) = row_sums(x64.reshape(1, -1), y64.reshape(1, -1))
                if what == "kv":
                    per_layer[kind].setdefault(layer, ErrorSums()).add(key_sums)
                    per_kind[kind].add(key_sums)
                else:
                    report.unsplit.append(label(ident))
            total.add(key_sums)
            report.keys[label(ident)] = {
                **key_sums.metrics(),
                "layout": what,
                "kv": kind,
                "layer": layer,
                "shape": list(ref.shape),
                "dtype": ref.dtype,
            }
    report.total = total.metrics()
    report.kv = {kind: per_kind[kind].metrics() for kind in KINDS if per_layer[kind]}
    report.layers = {kind: {layer: s.metrics() for layer, s in sorted(per_layer[kind].items())} for kind in KINDS}
    return report


def plot_layers(report: FidelityReport, output: str) -> None:
    """A plot of rel_fro per layer for K and V, log y (matplotlib's Agg backend), in the format of
    ``output``'s suffix (:mod:`.plots`)."""
    if not report.layers["k"] and not report.layers["v"]:
        raise MismatchError(
            "nothing to plot: no key matches the layer pattern and no tensor is a [2, layers, tokens, hidden] block"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        # An error of 0 everywhere cannot be drawn on a log axis: matplotlib masks it, and
        # warns "Data has no positive values" to the terminal.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for kind, label, marker in (("k", "K", "o"), ("v", "V", "s")):
                layers = report.layers[kind]
                if layers:
                    xs = sorted(layers)
                    ax.plot(xs, [layers[i]["rel_fro"] for i in xs], marker=marker, label=label)
            ax.set_yscale("log")
            ax.set_xlabel("layer")
            ax.set_ylabel("relative Frobenius error")
            codec = report.codec
            ax.set_title(f"fp8ray fidelity: {codec.get('fp8')} / {codec.get('scaling')}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            fig.tight_layout()
            save_figure(fig, output)
    finally:
        plt.close(fig)


def format_report(report: FidelityReport) -> str:
    def row(name: str, m: dict) -> str:
        return f"{name:<10} {m['rel_fro']:>10.3e} {m['max_abs']:>10.3e} {m['snr_db']:>8.2f} {m['cosine']:>12.9f}"

    lines = [f"{report.archive} against {report.original} ({len(report.keys)} keys)"]
    lines.append(f"{'group':<10} {'rel_fro':>10} {'max_abs':>10} {'snr_db':>8} {'cosine':>12}")
    for kind in KINDS:
        for layer, m in report.layers[kind].items():
            lines.append(row(f"{kind.upper()} {layer}", m))
    for kind, m in report.kv.items():
        lines.append(row(f"{kind.upper()} all", m))
    lines.append(row("total", report.total))
    if report.unsplit:
        lines.append(f"{len(report.unsplit)} key(s) in the total only (no layer/K/V split): {name_list(report.unsplit, 3)}")
    if report.stored:
        lines.append(
            f"{len(report.stored)} key(s) stored as they are (not fp8), identical to the original: {name_list(report.stored, 3)}"
        )
    if report.keys:
        worst = max(report.keys.items(), key=lambda kv: kv[1]["rel_fro"])
        lines.append(f"worst key: {worst[0]!r} rel_fro {worst[1]['rel_fro']:.3e}")
    return "\n".join(lines)
