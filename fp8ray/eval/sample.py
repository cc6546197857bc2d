"""A synthetic KV cache with the structure of a real one, for demos and benchmarks.

Real keys have a few outlier channels (RoPE pairs with large magnitude) and values are
closer to Gaussian; both vary in scale from layer to layer. Chunks have LMCache's
layout ``[2 (K, V), layers, tokens, kv_heads * head_dim]``.
"""

from __future__ import annotations

import torch


def sample_kv_chunk(
    layers: int = 30, tokens: int = 256, kv_heads: int = 3, head_dim: int = 64, seed: int = 0, dtype=torch.bfloat16
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    width = kv_heads * head_dim
    layer_scale = torch.exp(torch.randn(layers, 1, 1, generator=g) * 0.5)
    keys = torch.randn(layers, tokens, width, generator=g) * layer_scale
    outliers = torch.randperm(width, generator=g)[: max(1, width // 32)]
    keys[..., outliers] *= 12.0  # outlier channels
    values = torch.randn(layers, tokens, width, generator=g) * layer_scale * 0.5
    return torch.stack([keys, values]).to(dtype)
