"""deploy/rayservice.yaml: a KubeRay RayService with the Serve config embedded (validated by Serve's own deploy
schema and by ServeConfig), in-tree autoscaling on, a head that runs no replica and a GPU worker group the
autoscaler can grow to max_replicas."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from tokenflow_ray.serve.config import ServeConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def manifest() -> dict:
    (doc,) = list(yaml.safe_load_all((ROOT / "deploy/rayservice.yaml").read_text()))
    return doc


@pytest.fixture(scope="module")
def serve_config(manifest) -> dict:
    assert isinstance(manifest["spec"]["serveConfigV2"], str)  # KubeRay takes it as a YAML string
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def test_kind_version_and_autoscaling(manifest):
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["rayVersion"] == ray.__version__  # the image's Ray is the one this package pins


def test_embedded_serve_config_is_one_serve_deploy_accepts(serve_config):
    schema = ServeDeploySchema.model_validate(serve_config)
    (app,) = schema.applications
    assert app.import_path == "tokenflow_ray.serve.app:app_builder"
    cfg = ServeConfig.from_dict({**app.args, "images": False})
    assert cfg.autoscaling is not None and cfg.num_gpus == 1
    assert serve_config["http_options"]["host"] == "0.0.0.0"  # reachable through the serve Service


def test_same_application_as_serve_yaml(serve_config):
    """One app, two launchers: only the placement (GPUs, CPUs) differs from tokenflow_ray/serve/serve.yaml."""
    local = yaml.safe_load((ROOT / "tokenflow_ray/serve/serve.yaml").read_text())["applications"][0]
    k8s = serve_config["applications"][0]
    placement = {"num_gpus", "num_cpus"}
    assert {k: v for k, v in k8s["args"].items() if k not in placement} == \
        {k: v for k, v in local["args"].items() if k not in placement}
    assert {k: v for k, v in k8s.items() if k != "args"} == {k: v for k, v in local.items() if k != "args"}


def _container(group: dict) -> dict:
    (c,) = group["template"]["spec"]["containers"]
    return c


def test_head_and_gpu_worker_groups(manifest, serve_config):
    cluster = manifest["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert {p["containerPort"] for p in _container(head)["ports"]} >= {6379, 8265, 8000}
    (gpu,) = [g for g in cluster["workerGroupSpecs"] if "nvidia.com/gpu" in _container(g)["resources"]["limits"]]
    limits = _container(gpu)["resources"]["limits"]
    gpus, cpus = int(limits["nvidia.com/gpu"]), float(limits["cpu"])
    assert 0 <= gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    cfg = ServeConfig.from_dict({**serve_config["applications"][0]["args"], "images": False})
    # A replica fits a worker, and the group's maximum holds the Serve maximum.
    assert cfg.num_gpus <= gpus and cfg.num_cpus <= cpus
    assert cfg.autoscaling.max_replicas <= gpu["maxReplicas"] * int(gpus // cfg.num_gpus)
    images = {_container(head)["image"], _container(gpu)["image"]}
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    assert len(images) == 1 and f"-t {images.pop()} " in dockerfile  # the image deploy/Dockerfile builds
    assert f"rayproject/ray:{ray.__version__}-" in dockerfile
