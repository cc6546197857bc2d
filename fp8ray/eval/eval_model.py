"""Fidelity down to a model's outputs: how much does an fp8 KV cache change what it predicts?

For each mode, the model's cache of a text's prefix is replaced by its round trip
(every layer's K and V, ``[kv_heads, prefix, head_dim]``, encoded by
:class:`fp8ray.codec.Fp8Codec` and decoded), and the model then reads the true
continuation (teacher forcing). With ``x_0 .. x_{N+M}`` the text's tokens, ``N`` the
prefix and ``M`` the continuation, the fed tokens are ``x_N .. x_{N+M-1}`` and position
``j`` predicts ``x_{N+j+1}``; every one of the ``M`` positions attends to the whole
(round-tripped) prefix. With ``p_j`` the reference next-token distribution (unchanged
cache) and ``q_j`` the mode's, both from ``log_softmax`` of the logits in float64:

- ``kl_nats``: ``(1/M) sum_j KL(p_j || q_j)``, ``KL(p || q) = sum_v p(v) (log p(v) - log q(v))``,
  nats per token. Identical logits give exactly 0 (every term is ``p * 0``).
- ``top1_agreement``: the fraction of positions where ``argmax q_j == argmax p_j``.
- ``ppl``: ``exp(-(1/M) sum_j log q_j(x_{N+j+1}))``, the continuation's perplexity, and
  ``ppl_reference`` the same under ``p``.
- ``bytes_per_element``: the cache's stored bytes (the frames' total length, scales and
  headers included) over its element count.
- ``k_rel_fro``/``v_rel_fro``: ``sqrt(sum_l ||K'_l - K_l||^2 / sum_l ||K_l||^2)`` over the
  layers ``l`` (per layer in ``k_rel_fro_layers``/``v_rel_fro_layers``).

Modes (``parse_mode``): ``FP8:SCALING[:key=value...]``, e.g. ``e4m3fn:token`` or
``e4m3fn:block:block_size=32``; the key=value pairs go to ``Fp8Codec`` as keyword
arguments (int if all digits, else string). Two baselines: ``reference`` (the cache
untouched, rebuilt and rerun like any mode: its KL is exactly 0 when the model is
deterministic) and ``bfloat16``/``float16`` (a plain cast and back, what storing the
cache in 16 bits costs).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..codec import CodecOptions, Fp8Codec, decode
from ..codec.formats import FORMATS, SCALINGS
from ..codec.metrics import json_safe, relative_error
from ..errors import BadInputError, MismatchError
from .models import LoadedModel, cache_tensors, forward, load_model, make_cache, read_text, tokenize
from .plots import save_figure

REFERENCE = "reference"
CASTS = {"bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MODES = ("bfloat16", *(f"{fmt}:{scaling}" for fmt in FORMATS for scaling in SCALINGS))
DEFAULT_TEXT = Path(__file__).resolve().parent / "texts" / "lighthouse.txt"  # shipped in the package


def parse_mode(text: str) -> dict:
    """Parse a mode. Returns ``{"label", "kind", "codec"}``: ``kind`` is ``"fp8"``
    (``codec`` holds the options the mode string gives, as ``Fp8Codec`` keyword
    arguments; the others keep the default mode), ``"cast"`` (``codec`` is
    ``{"dtype": name}``) or ``"reference"`` (``codec`` is empty). Bad modes raise
    :class:`~fp8ray.errors.InvalidOptionError` naming them.

    >>> parse_mode("e4m3fn:block:block_size=32")
    {'label': 'e4m3fn:block:block_size=32', 'kind': 'fp8', 'codec': {'fp8': 'e4m3fn', 'scaling': 'block', 'block_size': 32}}
    """
    label = text.strip() if isinstance(text, str) else text
    if label == REFERENCE:
        return {"label": label, "kind": "reference", "codec": {}}
    if label in CASTS:
        return {"label": label, "kind": "cast", "codec": {"dtype": label}}
    CodecOptions.from_mode(label)  # validates names and values now, not mid-run
    return {"label": label, "kind": "fp8", "codec": CodecOptions.mode_values(label)}


@dataclass
class ModeResult:
    """One row of the report; the fields are defined in the module docstring."""

    mode: str
    kl_nats: float
    kl_max_nats: float  # the largest KL(p_j || q_j) over the positions
    top1_agreement: float
    ppl: float
    ppl_reference: float
    bytes_per_element: float
    k_rel_fro: float
    v_rel_fro: float
    k_rel_fro_layers: list[float] = field(default_factory=list)
    v_rel_fro_layers: list[float] = field(default_factory=list)

    @property
    def ppl_delta(self) -> float:
        return self.ppl - self.ppl_reference

    def as_dict(self) -> dict:
        """The row as JSON takes it: a non-finite figure (a float16 cast of values past its
        range) as ``"inf"``, ``"-inf"`` or ``"nan"``."""
        return json_safe({**asdict(self), "ppl_delta": self.ppl_delta})


def round_trip(tensor: torch.Tensor, mode: dict) -> tuple[torch.Tensor, int]:
    """``tensor`` after the mode's storage round trip, and the bytes it was stored in."""
    if mode["kind"] == "reference":
        return tensor, tensor.numel() * tensor.element_size()
    if mode["kind"] == "cast":
        stored = tensor.to(CASTS[mode["codec"]["dtype"]])
        return stored.to(tensor.dtype), stored.numel() * stored.element_size()
    frame = Fp8Codec(**mode["codec"]).encode(tensor)
    return decode(frame), len(frame)


def compare_logits(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """KL, top-1 agreement and perplexities of ``logits`` against ``reference``
    (both ``[M, vocab]``) for next tokens ``targets`` (``[M]``), in float64."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    rows = torch.arange(targets.numel())
    return {
        "kl_nats": float(kl.mean()),
        "kl_max_nats": float(kl.max()),
        "top1_agreement": float((logits.argmax(-1) == reference.argmax(-1)).double().mean()),
        "ppl": math.exp(float(-log_q[rows, targets].mean())),
        "ppl_reference": math.exp(float(-log_p[rows, targets].mean())),
    }


def _parsed_mode(mode) -> dict:
    """A mode string parsed, or a dict :func:`parse_mode` returned as it is."""
    if isinstance(mode, dict):
        if not {"kind", "label", "codec"} <= mode.keys():
            raise BadInputError(f"a mode given as a dict must be one parse_mode returned, got {mode!r}")
        return mode
    return parse_mode(mode)


def evaluate_modes(model, input_ids: torch.Tensor, prefix: int, continuation: int, modes=DEFAULT_MODES) -> list[ModeResult]:
    """Evaluate each mode (strings or :func:`parse_mode` dicts) on one text; the first row
    is always ``reference``. ``input_ids`` (``[1, n]`` or ``[n]``) needs
    ``prefix + continuation + 1`` tokens (the last fed token's target is the one after it)."""
    if input_ids.dim() > 2 or (input_ids.dim() == 2 and input_ids.shape[0] != 1):  # reshaped, it ran texts as one
        raise BadInputError(f"input_ids must be one text's ids, [1, n] or [n], got shape {list(input_ids.shape)}")
    ids = input_ids.reshape(1, -1)
    counts = (prefix, continuation)
    if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0 for n in counts):
        raise BadInputError(f"prefix and continuation must be positive integers, got {prefix!r} and {continuation!r}")
    needed = prefix + continuation + 1
    if isinstance(modes, (str, dict)):  # a string's characters were taken as modes
        raise BadInputError(f"modes must be a list of modes, got one: {modes!r}; pass [{modes!r}]")
    if ids.shape[1] < needed:
        raise BadInputError(
            f"the text has {ids.shape[1]} tokens; prefix {prefix} + continuation {continuation} + 1 target needs {needed}"
        )
    parsed = [_parsed_mode(m) for m in modes]
    unique = {m["label"]: m for m in parsed if m["kind"] != "reference"}  # a mode given twice runs once
    parsed = [parse_mode(REFERENCE), *unique.values()]
    fed, targets = ids[:, prefix : prefix + continuation], ids[0, prefix + 1 : needed]

    _, cache = forward(model, ids[:, :prefix])
    original = [(k.clone(), v.clone()) for k, v in cache_tensors(cache)]
    del cache
    reference_logits, _ = forward(model, fed, make_cache(model, original))
    results = []
    for mode in parsed:
        tensors, stored, stats = [], 0, {"k": [], "v": []}
        for keys, values in original:
            layer = []
            for name, tensor in (("k", keys), ("v", values)):
                # Encoded as the captured block, [kv_heads, tokens, head_dim], so "token" and
                # "channel" mean what they mean for `fp8ray capture` files.
                restored, nbytes = round_trip(tensor[0], mode)
                stored += nbytes
                diff = restored.double() - tensor[0].double()
                stats[name].append((float((diff * diff).sum()), float(tensor[0].double().square().sum())))
                layer.append(restored.unsqueeze(0))
            tensors.append(tuple(layer))
        logits, _ = forward(model, fed, make_cache(model, tensors))
        elements = sum(k.numel() + v.numel() for k, v in original)
        k_layers = [relative_error(n, s) for n, s in stats["k"]]
        v_layers = [relative_error(n, s) for n, s in stats["v"]]
        results.append(
            ModeResult(
                mode=mode["label"],
                **compare_logits(reference_logits[0], logits[0], targets),
                bytes_per_element=stored / elements,
                k_rel_fro=relative_error(sum(n for n, _ in stats["k"]), sum(s for _, s in stats["k"])),
                v_rel_fro=relative_error(sum(n for n, _ in stats["v"]), sum(s for _, s in stats["v"])),
                k_rel_fro_layers=k_layers,
                v_rel_fro_layers=v_layers,
            )
        )
    return results


_COLUMNS = ("mode", "bytes/elem", "K rel err", "V rel err", "KL nats/token", "max KL", "top-1 agree", "ppl", "ppl change")


def report_dict(model: str, text: str, prefix: int, continuation: int, results: list[ModeResult]) -> dict:
    """What ``fp8ray eval-model --json`` prints (docs/REPORTS.md)."""
    return {
        "model": model,
        "text": text,
        "prefix": prefix,
        "continuation": continuation,
        "results": [r.as_dict() for r in results],
    }


def _cells(r: ModeResult) -> list[str]:
    change = r.ppl_delta / r.ppl_reference if r.ppl_reference else math.nan
    return [
        r.mode,
        f"{r.bytes_per_element:.4f}",
        f"{r.k_rel_fro:.3%}",
        f"{r.v_rel_fro:.3%}",
        f"{r.kl_nats:.3g}",
        f"{r.kl_max_nats:.3g}",
        f"{r.top1_agreement:.3f}",
        f"{r.ppl:.4f}",
        f"{r.ppl_delta:+.4f} ({change:+.3%})",
    ]


def format_markdown(results: list[ModeResult]) -> str:
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|---|" + "---:|" * (len(_COLUMNS) - 1)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in results]
    return "\n".join(lines)


def format_text(results: list[ModeResult]) -> str:
    rows = [list(_COLUMNS)] + [_cells(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))) for row in rows
    )


def plot(results: list[ModeResult], path: str | os.PathLike, title: str) -> None:
    """A bar chart of KL per mode, log scale (modes with KL 0, the reference, are left out:
    a log axis has no 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r.kl_nats > 0]
    if not shown:
        raise MismatchError("nothing to plot: every mode's KL is 0 (exact), and a log axis has no 0")
    # Horizontal bars: mode names such as e4m3fn:block:block_size=32:scale_choice=mse fit.
    fig, ax = plt.subplots(figsize=(9.0, 1.2 + 0.35 * len(shown)))
    ax.barh([r.mode for r in shown], [r.kl_nats for r in shown], color="tab:blue")
    ax.invert_yaxis()  # the first mode on top, as in the table
    ax.set_xscale("log")
    ax.set_xlabel("KL(reference || mode), nats per token")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=120)
    finally:
        plt.close(fig)


def evaluate_text(
    text_path: str | os.PathLike, prefix: int, continuation: int, modes=DEFAULT_MODES, model: str | os.PathLike | None = None
) -> tuple[LoadedModel, list[ModeResult]]:
    """Load the model and evaluate ``modes`` on a text file (the CLI's work)."""
    parsed = [parse_mode(m) for m in modes]  # bad modes fail before the model loads
    text = read_text(text_path)
    loaded = load_model(model)
    ids = tokenize(loaded, text, what=f"text file {text_path}")
    needed = prefix + continuation + 1
    if ids.shape[1] < needed:
        raise BadInputError(
            f"text file {text_path} has {ids.shape[1]} tokens; "
            f"--prefix {prefix} + --continuation {continuation} + 1 needs {needed}"
        )
    return loaded, evaluate_modes(loaded.model, ids[:, :needed], prefix, continuation, parsed)
