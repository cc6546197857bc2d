"""cluster.yaml and the KubeRay example, validated offline against Ray's own schema."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[2]


def ray_schema() -> dict:
    with open(os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")) as f:
        return json.load(f)


def test_cluster_yaml_is_valid_for_the_installed_ray():
    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    jsonschema.validate(config, ray_schema())  # as written
    prepared = prepare_config(copy.deepcopy(config))  # merged with Ray's defaults
    validate_config(prepared)
    assert prepared["available_node_types"]["head"]["resources"] == {"CPU": 0}  # no work on the head
    assert prepared["docker"]["image"] == f"rayproject/ray:{ray.__version__}-py311-gpu"
    assert "ray-ml" not in (REPO / "cluster.yaml").read_text()
    assert any("pip install" in c and "fp8ray" in c for c in prepared["setup_commands"])
    # The checkout is copied to every node without what git ignores (a .venv: gigabytes).
    assert prepared["rsync_filter"] == [".gitignore"] and ".venv/" in (REPO / ".gitignore").read_text().split()


def test_schema_check_can_fail():
    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    config["available_node_types"]["gpu_worker"]["min_wokers"] = 1  # a typo
    with pytest.raises(jsonschema.ValidationError, match="min_wokers"):
        jsonschema.validate(config, ray_schema())


def test_rayjob_example_submits_the_job_entrypoint():
    job = yaml.safe_load((REPO / "deploy/rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    script = job["spec"]["entrypoint"].split()[1]
    assert (REPO / script).is_file()
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    # The project from its checkout's zip, not a package named fp8ray from PyPI (another's, or none).
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert env["pip"] == [f"fp8ray @ {env['working_dir']}"]


def test_serve_config_is_valid_and_builds_the_app():
    """serve_config.yaml passes Serve's own schema, and its import path and args build
    the application with the deployment the config tunes."""
    import importlib

    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "serve_config.yaml").read_text()))
    [app_config] = config.applications
    module, name = app_config.import_path.split(":")
    app = getattr(importlib.import_module(module), name)(app_config.args)
    deployment = app._bound_deployment
    assert [d.name for d in app_config.deployments] == [deployment.name] == ["Fp8Service"]
    workers = [a for a in deployment._deployment_config.deployment_actors if a.name.startswith("quant-worker-")]
    assert len(workers) == app_config.args["workers"]
    assert config.http_options.host == "127.0.0.1"
