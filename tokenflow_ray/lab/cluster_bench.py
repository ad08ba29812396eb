"""The burst benchmark against a Serve app on the cluster this process has joined (jobs/serve_bench.py).

Finds the app by name (`serve deploy`ed, or left by an earlier run) or deploys it from a Serve config YAML, then
sends the demo's burst of paced streaming clients (lab/demo.py's workload) to the HTTP proxy on this node and
reports the demo's JSON: `policies: {<the app's policy>: {ttft_mean_s, ttft_p99_s, qoe_mean, stall_per_stream_mean_s,
stall_per_stream_p99_s, raw_tput, effective_tput, ...}}`. With a trace (workloads/traces.py) its requests are the
streams: prompt and output lengths, reader rates and arrival times.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenflow_ray.serve.config import ServeConfig

DEFAULT_CONFIG = Path(__file__).with_name("serve.yaml")


@dataclass(frozen=True)
class BurstJobConfig:
    app: str = "tokenflow"
    config: str = str(DEFAULT_CONFIG)  # deployed only when no app of that name runs
    streams: int = 16
    max_tokens: int = 48
    rate: float = 16.0
    burst_s: float = 0.5
    timeout_s: float = 120.0
    trace: object | None = None  # a workloads/traces.Trace replayed instead of the burst (streams, lengths, rates)

    def __post_init__(self) -> None:
        if self.streams <= 0 or self.max_tokens <= 0 or self.rate < 0 or self.burst_s < 0 or self.timeout_s <= 0:
            raise ValueError("streams, max_tokens, timeout_s must be positive; rate, burst_s >= 0")


def _serve_details() -> dict[str, Any]:
    """Serve's instance details (HTTP options, applications with their deployed config): what `serve status` and
    the dashboard's /api/serve/applications show, read from the controller (no dashboard address needed)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()


def find_or_deploy(cfg: BurstJobConfig) -> tuple[str, ServeConfig, bool]:
    """(base URL of this node's proxy, the app's config, whether this call deployed it)."""
    from ray import serve

    from tokenflow_ray.serve.app import deploy

    deployed = False
    try:
        details = _serve_details()
    except Exception:  # Serve not started on this cluster
        details = {"applications": {}}
    app = details.get("applications", {}).get(cfg.app)
    config = None
    if app is None:
        config = ServeConfig.from_yaml(cfg.config, app_name=cfg.app)
        serve.start(http_options={"host": config.host, "port": config.port})  # a no-op where Serve runs
        deploy(config)  # returns once the app is RUNNING
        deployed = True
    deadline = time.monotonic() + cfg.timeout_s
    while True:  # an app `serve deploy` just submitted may still be deploying
        details = _serve_details()
        app = details["applications"][cfg.app]
        if app.get("status") == "RUNNING":
            break
        if app.get("status") == "DEPLOY_FAILED" or time.monotonic() > deadline:
            raise RuntimeError(f"app {cfg.app!r} is {app.get('status')}: {app.get('message', '')}")
        time.sleep(0.5)
    if config is None:  # deployed by someone else: its config as Serve holds it (`serve deploy` keeps the args)
        args = dict((app.get("deployed_app_config") or {}).get("args") or {})
        config = ServeConfig.from_dict({**args, "app_name": cfg.app}) if args else ServeConfig(app_name=cfg.app)
    http = details.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # the proxy on this node (proxy_location)
    prefix = (app.get("route_prefix") or "/").rstrip("/")
    return f"http://{host}:{http.get('port', 8000)}{prefix}", config, deployed


def run_burst_job(cfg: BurstJobConfig) -> dict[str, Any]:
    from tokenflow_ray.client import StreamSpec, run_load
    from tokenflow_ray.lab.demo import DemoConfig, load_row

    start = time.monotonic()
    # The config this call deployed, not Serve's record of it: an app deployed from Python keeps no args there,
    # and the report once named the default policy for an fcfs app.
    base_url, served, deployed = find_or_deploy(cfg)
    policy = served.engine.scheduler.policy
    demo = DemoConfig(policies=(policy,), streams=cfg.streams, max_tokens=cfg.max_tokens, rate=cfg.rate,
                      burst_s=cfg.burst_s, timeout_s=cfg.timeout_s, trace=cfg.trace)
    asyncio.run(run_load(base_url, [StreamSpec("warm up", max_tokens=2)], api_key=served.api_key, timeout_s=60))
    res = asyncio.run(run_load(base_url, demo.specs(), model=served.engine.model.model, api_key=served.api_key,
                               timeout_s=cfg.timeout_s, report_interval_s=1.0))
    row = load_row(res)
    workload = ({"trace": cfg.trace.describe()} if cfg.trace is not None else
                {"streams": cfg.streams, "max_tokens": cfg.max_tokens, "rate": cfg.rate, "burst_s": cfg.burst_s})
    return {"app": cfg.app, "url": base_url, "deployed": deployed, "policies": {policy: row}, "workload": workload,
            "autoscaling": served.autoscaling is not None, "wall_s": time.monotonic() - start}
