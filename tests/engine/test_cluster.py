"""Two Ray nodes simulated with ray.cluster_utils.Cluster, one with a (fake) GPU: work
spreads over both, in compress and in decompress, with the bytes of a local run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TWO_NODES = r"""
import hashlib, json, os, shutil, sys
from pathlib import Path
import ray
from ray.cluster_utils import Cluster
from fp8ray import PoolSettings, QuantPool, compress_archive, decompress_archive

src, out, files = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1, num_gpus=1)  # no real GPU: torch sees no CUDA
ray.init(address=cluster.address, log_to_driver=False)
try:
    with QuantPool(num_workers=2) as pool:
        nodes = {i.node_id for i in pool.worker_info()}
    with QuantPool(num_workers=1, gpus_per_worker=0.5) as pool:
        gpu_worker = pool.worker_info()[0]
    report = compress_archive(src, str(out), part_bytes=200_000, pool=PoolSettings(num_workers=2))
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("part-*.parquet"))}
    compress_archive(str(files), str(out) + "-files", part_bytes=2_000_000, pool=PoolSettings(num_workers=2))  # a part per file
    restored = decompress_archive(str(out) + "-files", str(out) + "-back", pool=PoolSettings(num_workers=2))
    back = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(str(out) + "-back").iterdir())}
    print(json.dumps({"nodes": len(nodes), "report_nodes": report.nodes, "gpu_worker_device": gpu_worker.device,
                      "digests": digests, "restore_nodes": restored.nodes, "restored": back}))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.slow
def test_two_nodes_spread_and_give_identical_parts(kv_source, tmp_path, ray_session):
    import hashlib
    import json
    import shutil

    from fp8ray.engine.archives import compress_archive, decompress_archive

    src, _ = kv_source
    compress_archive(str(src), str(tmp_path / "local"), part_bytes=200_000)
    local = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((tmp_path / "local").glob("part-*.parquet"))}
    files = tmp_path / "files"  # a directory source: decompress has a file per task to give out
    files.mkdir()
    for i in range(6):
        shutil.copy(src, files / f"request{i}.safetensors")
    compress_archive(str(files), str(tmp_path / "local-files"), part_bytes=2_000_000)
    decompress_archive(str(tmp_path / "local-files"), str(tmp_path / "local-back"))
    local_back = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((tmp_path / "local-back").iterdir())}
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-c", TWO_NODES, str(src), str(tmp_path / "cluster"), str(files)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["nodes"] == 2  # SPREAD put one worker on each node
    assert outcome["report_nodes"] == 2  # and both wrote parts
    assert outcome["gpu_worker_device"] == "cpu"  # a GPU from Ray but no CUDA in torch: the CPU kernels
    assert outcome["digests"] == local
    assert outcome["restore_nodes"] == 2  # decompress: both nodes wrote files
    assert outcome["restored"] == local_back and len(local_back) == 6
