"""The demo end to end on real data: capture from the shipped model, compress on Ray,
verify, fidelity, decompress. It must run as `scripts/demo` runs it."""

from __future__ import annotations

import re

import pytest
from safetensors.torch import load_file

from fp8ray.cli.demo import run_demo


@pytest.mark.slow
def test_demo_on_a_real_capture(ray_session, tmp_path):
    text = run_demo(tmp_path, tokens=64)
    source = tmp_path / "kv_smollm2_64.safetensors"
    blocks = load_file(str(source))
    assert len(blocks) == 60 and all(t.shape[1] == 64 for t in blocks.values())  # 30 layers x K/V
    assert "captured SmolLM2-135M-Instruct" in text and "every checksum ok" in text
    restored = load_file(str(tmp_path / "restored.safetensors"))
    assert sorted(restored) == sorted(blocks)
    # Per element (docs/ACCURACY.md), with the stored scale s: |err| <= |x|/17 + s * 2**-10.
    # The default mode's blocks of 32 get s <= amax/240 <= ||block||/240 (the mse search
    # tries amax/448 .. amax/240), so the aggregate relative error is at most
    # 1/17 + sqrt(32) * 2**-10 / 240.
    bound = 1 / 17 + 32**0.5 * 2**-10 / 240
    for kind in ("keys", "values"):
        rel = float(re.search(rf"{kind}\s+relative error ([0-9.]+)%", text).group(1)) / 100
        assert 0 < rel <= bound, (kind, rel)
    again = run_demo(tmp_path, tokens=64)  # a second run reuses the capture
    assert "reusing the captured KV cache" in again
