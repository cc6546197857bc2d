"""Capture a real model's KV cache over a text into a safetensors file of blocks.

The file holds one block per layer and K/V, keyed ``layer{i:03d}.k`` and
``layer{i:03d}.v`` (zero-padded, so the keys sort in layer order), each
``[kv_heads, tokens, head_dim]`` (the cache's batch dimension of one dropped) in the
chosen dtype (bfloat16 by default, as serving stacks store KV caches). The file's
``__metadata__`` says what it is: model, tokens, dtype, layers, kv_heads, head_dim,
layout, the text's SHA-256 and the fp8ray version. ``fp8ray compress`` takes it as a
source like any other safetensors file.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import __version__
from ..codec.formats import DTYPE_CODES, DTYPE_NAMES, DTYPES_BY_NAME
from ..errors import ArchiveExistsError, BadInputError, DestinationError, InvalidOptionError
from ..io.blocks import tensor_to_bytes
from ..io.paths import check_not_special, output_error, resolve
from ..io.safetensors import SafetensorsWriter
from .models import LoadedModel, cache_tensors, forward, load_model, read_text, tokenize

LAYOUT = "[kv_heads, tokens, head_dim]"


def block_key(layer: int, kind: str) -> str:
    """``layer007.k``: the key of layer ``layer``'s keys (``kind="k"``) or values (``"v"``)."""
    if kind not in ("k", "v"):
        raise BadInputError(f"kind must be 'k' or 'v', got {kind!r}", field="kind")
    return f"layer{layer:03d}.{kind}"


def capture_kv(loaded: LoadedModel, input_ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Run the model over ``input_ids`` (``[1, n]``) and return its KV cache as blocks
    ``{block_key(i, "k"|"v"): [kv_heads, n, head_dim]}``, in layer order, cast to ``dtype``."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise BadInputError(f"input_ids must be [1, tokens], got {list(input_ids.shape)}", field="input_ids")
    _, cache = forward(loaded.model, input_ids)
    blocks = {}
    for i, (keys, values) in enumerate(cache_tensors(cache)):
        blocks[block_key(i, "k")] = keys[0].to(dtype).contiguous()
        blocks[block_key(i, "v")] = values[0].to(dtype).contiguous()
    return blocks


def write_blocks(
    path: str | os.PathLike, blocks: dict[str, torch.Tensor], metadata: dict[str, str], replace: bool = True
) -> None:
    """Write blocks as a safetensors file (to a temporary name, renamed when complete;
    without ``replace``, never in the place of a file that appeared meanwhile)."""
    entries = [(key, DTYPE_NAMES[t.dtype], tuple(t.shape)) for key, t in blocks.items()]
    with SafetensorsWriter(str(path), entries, metadata, replace=replace) as writer:
        for t in blocks.values():
            writer.write(tensor_to_bytes(t))


@dataclass(frozen=True)
class CaptureReport:
    path: str
    model: str
    tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def capture(
    out: str | os.PathLike,
    text_path: str | os.PathLike,
    tokens: int | None = None,
    model: str | os.PathLike | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
) -> CaptureReport:
    """Capture ``model``'s KV cache over the first ``tokens`` tokens of a text file
    (all of them if None) into the safetensors file ``out``."""
    if dtype not in DTYPE_CODES:  # a KV cache's dtype: one fp8 encodes
        raise InvalidOptionError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPE_CODES)}", field="dtype")
    out = Path(out)
    if out.suffix != ".safetensors":
        raise DestinationError(f"output {out} must end in .safetensors")
    check_not_special(*resolve(str(out)), str(out))  # even with overwrite: its rename would put a file in its place
    if out.is_dir():  # refused now, not after the model has run
        raise DestinationError(f"output {out} is a directory; name the .safetensors file to write")
    if os.path.lexists(out) and not overwrite:  # a link to nothing too: the output's rename would replace it
        raise ArchiveExistsError(f"output {out} already exists (pass --overwrite to replace it)")
    if not out.parent.is_dir():
        raise DestinationError(f"output directory {out.parent} does not exist")
    text = read_text(text_path)
    loaded = load_model(model)
    input_ids = tokenize(loaded, text, tokens, what=f"text file {text_path}")
    blocks = capture_kv(loaded, input_ids, DTYPES_BY_NAME[dtype])
    geometry = loaded.geometry
    metadata = {
        "model": loaded.name,
        "tokens": str(input_ids.shape[1]),
        "dtype": dtype,
        "model_dtype": DTYPE_NAMES[loaded.dtype],
        "layers": str(geometry.layers),
        "kv_heads": str(geometry.kv_heads),
        "head_dim": str(geometry.head_dim),
        "layout": LAYOUT,
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "fp8ray_version": __version__,
    }
    try:
        write_blocks(out, blocks, metadata, replace=overwrite)
    except OSError as exc:  # a full disk
        raise output_error(str(out), exc) from None
    return CaptureReport(
        str(out),
        loaded.name,
        int(input_ids.shape[1]),
        geometry.layers,
        geometry.kv_heads,
        geometry.head_dim,
        dtype,
        out.stat().st_size,
    )
