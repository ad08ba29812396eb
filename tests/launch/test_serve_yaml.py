"""tokenflow_ray/serve/serve.yaml is a config `serve deploy` accepts (Serve's ServeDeploySchema, the check `serve
deploy` makes before it sends it), and its app builds with the serving-signals autoscaling policy on LLMServer.
tests/launch/test_job_submit.py deploys it for real with `serve deploy`."""

from __future__ import annotations

from pathlib import Path

import yaml
from ray.serve._private.build_app import build_app
from ray.serve.schema import ServeDeploySchema

from tokenflow_ray.serve.app import app_builder
from tokenflow_ray.serve.control.autoscaling_policy import POLICY_PATH

ROOT = Path(__file__).resolve().parents[2]


def test_serve_deploy_schema_accepts_it():
    doc = yaml.safe_load((ROOT / "tokenflow_ray/serve/serve.yaml").read_text())
    (app,) = ServeDeploySchema.model_validate(doc).applications
    assert app.name == "tokenflow" and app.args["autoscaling"]["max_replicas"] > app.args["autoscaling"]["min_replicas"]


def test_the_app_autoscales_llmserver_with_the_serving_signals_policy():
    doc = yaml.safe_load((ROOT / "tokenflow_ray/serve/serve.yaml").read_text())
    app = doc["applications"][0]
    built = build_app(app_builder({**app["args"], "images": False}), name=app["name"])
    deps = {d.name: d for d in built.deployments}
    llm = deps["LLMServer"]._deployment_config
    auto = llm.autoscaling_config
    want = app["args"]["autoscaling"]
    assert (auto.min_replicas, auto.max_replicas) == (want["min_replicas"], want["max_replicas"])
    assert (auto.upscale_delay_s, auto.downscale_delay_s) == (want["upscale_delay_s"], want["downscale_delay_s"])
    assert auto.metrics_interval_s == want["metrics_interval_s"]
    assert auto.policy.policy_function == POLICY_PATH
    assert auto.policy.policy_kwargs["target_utilization"] == want["target_utilization"]
    assert llm.graceful_shutdown_timeout_s == want["drain_timeout_s"]  # scale-down drains streams this long
    # Only the engine replicas scale (an OpenAIIngress in front, where there is one, stays fixed).
    assert all(d._deployment_config.autoscaling_config is None for name, d in deps.items() if name != "LLMServer")
