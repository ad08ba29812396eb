"""cluster.yaml is a config `ray up` accepts: Ray's own schema (the bundled ray-schema.json, through the same
prepare/validate calls `ray up` makes), plus what the schema cannot know: a GPU worker type that holds a replica, a
head that runs none, and setup commands that install this package on every node."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_rays_schema_accepts_it(raw):
    validate_config(prepare_config(copy.deepcopy(raw)))


def test_rays_schema_is_really_checking(raw):
    bad = copy.deepcopy(raw)
    bad["available_node_types"]["gpu_worker"]["max_wokers"] = 4  # a typo Ray must catch
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        validate_config(prepare_config(bad))
    bad = copy.deepcopy(raw)
    bad["head_node_type"] = "nope"
    with pytest.raises(ValueError):
        validate_config(prepare_config(bad))


def test_node_types_head_gpu_worker_and_limits(raw):
    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]
    assert head["resources"]["CPU"] == 0  # no replica or training worker on the head
    gpu = types["gpu_worker"]
    assert gpu["resources"]["GPU"] >= 1 and gpu["resources"]["CPU"] >= 1
    assert 0 <= gpu["min_workers"] <= gpu["max_workers"]
    workers = [t for name, t in types.items() if name != raw["head_node_type"]]
    assert raw["max_workers"] >= max(t["max_workers"] for t in workers)
    assert "--autoscaling-config" in " ".join(raw["head_start_ray_commands"])


def test_every_node_installs_this_package(raw):
    (mount,) = [remote for remote, local in raw["file_mounts"].items() if local == "."]
    assert any("pip install" in c and mount in c for c in raw["setup_commands"])
    gpu_setup = raw["available_node_types"]["gpu_worker"]["worker_setup_commands"]
    assert any(f"{mount}[gpu]" in c for c in gpu_setup)


def test_every_nodes_proxy_answers_for_a_lost_replica(raw):
    """Ray starts each node's Serve proxy with the environment of its `ray start`: the callback must be there."""
    from tokenflow_ray.serve.http.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV, proxy_middlewares

    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in raw[key] if "ray start" in c]
        assert f"{PROXY_CALLBACK_ENV}={PROXY_CALLBACK} ray start" in start, start
    assert f"ENV {PROXY_CALLBACK_ENV}={PROXY_CALLBACK}" in (ROOT / "deploy/Dockerfile").read_text()
    assert len(proxy_middlewares()) == 1  # the import path resolves to Serve's callback shape


def test_the_serve_app_fits_the_gpu_worker(raw):
    """The RayService's GPU replica (num_gpus, num_cpus) fits one gpu_worker, and the workers hold max_replicas."""
    from tokenflow_ray.serve.config import ServeConfig

    doc = yaml.safe_load((ROOT / "deploy/rayservice.yaml").read_text())
    args = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]
    cfg = ServeConfig.from_dict({**args, "images": False})
    res = raw["available_node_types"]["gpu_worker"]["resources"]
    assert cfg.num_gpus <= res["GPU"] and cfg.num_cpus <= res["CPU"]
    per_node = int(res["GPU"] // cfg.num_gpus)
    assert cfg.autoscaling.max_replicas <= per_node * raw["available_node_types"]["gpu_worker"]["max_workers"]
