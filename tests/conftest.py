"""Shared fixtures: one embedded local Ray for the whole session, and sample archives."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# Pin Ray's auth mode for every Ray the tests start, before anything imports Ray.
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)
# Ray's temporary directory, the suite's own: a command given no address joins the
# cluster recorded there (ray_current_cluster), so none that another user, or another
# suite, runs on this machine. Short: Ray's socket paths are limited.
RAY_TMPDIR = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="frt", dir="/tmp")


def pytest_unconfigure(config):
    shutil.rmtree(RAY_TMPDIR, ignore_errors=True)  # after every run, a collection alone included


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the suite (ray.init takes ~5 s here); QuantPool joins it."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=256 * 2**20,
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def kv_source(tmp_path_factory):
    """A safetensors file of 12 small KV chunks in bf16, fp16 and fp32, written by the
    safetensors package itself."""
    from safetensors.torch import save_file

    from fp8ray.eval.sample import sample_kv_chunk

    dtypes = {0: "bfloat16", 1: "float16", 2: "float32"}
    import torch

    tensors = {
        f"layer{i:02d}": sample_kv_chunk(layers=2, tokens=64, seed=i, dtype=getattr(torch, dtypes[i % 3])) for i in range(12)
    }
    path = tmp_path_factory.mktemp("src") / "kv.safetensors"
    save_file(tensors, str(path))
    return path, tensors
