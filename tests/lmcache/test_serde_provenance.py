"""The fp8ray serde and provenance: a frame records none (docs/LMCACHE.md, "Provenance"),
so the serde's kwargs refuse a model, revision or KV layout, saying why; what a frame
does record, its dtype and shape, refuses a chunk read into a tensor of another layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fp8ray.errors import InvalidOptionError, MismatchError
from fp8ray.io.provenance import Provenance
from fp8ray.lmcache import Fp8FrameDeserializer, Fp8FrameSerializer, serde_options


@pytest.mark.parametrize("name", Provenance.names())
def test_the_serde_takes_no_provenance_and_says_why(name):
    with pytest.raises(InvalidOptionError, match="a frame records no provenance") as err:
        serde_options({name: "meta-llama/Llama-3.1-8B"})
    assert err.value.field == name and "docs/LMCACHE.md" in str(err.value)


def test_a_chunk_of_another_kv_layout_is_refused():
    split = torch.randn(2, 2, 16, 64).to(torch.bfloat16)  # [2, L, T, H]
    ser = Fp8FrameSerializer()
    buf = torch.empty(ser.serialized_size([(split.shape, split.dtype)]), dtype=torch.uint8)
    ser.serialize(SimpleNamespace(tensor=split), SimpleNamespace(tensor=buf))
    fused = torch.zeros(1, 2, 16, 128, dtype=torch.bfloat16)  # [1, L, T, 2H]: the same elements, another layout
    with pytest.raises(MismatchError, match=r"the frame holds \(2, 2, 16, 64\)"):
        Fp8FrameDeserializer().deserialize(SimpleNamespace(tensor=buf), SimpleNamespace(tensor=fused))
    assert not fused.any()  # nothing decoded into it
