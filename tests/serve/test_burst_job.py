"""jobs/serve_bench.py's run (lab/cluster_bench.py): an app the job deploys itself is reported under its policy."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def test_a_job_that_deploys_its_own_app_reports_the_policy_it_deployed(serve_url, tmp_path):
    from tokenflow_ray.lab.cluster_bench import BurstJobConfig, run_burst_job
    from tokenflow_ray.serve.app import undeploy
    from tokenflow_ray.serve.config import ServeConfig

    path = tmp_path / "fcfs.yaml"  # not the default policy (tokenflow): a report that fell back to it would show
    path.write_text("app_name: tfburst\nroute_prefix: /tfburst\nimages: false\nnum_cpus: 1\n"
                    "engine: {model: embedded, policy: fcfs, num_device_blocks: 256}\n")
    cfg = BurstJobConfig(app="tfburst", config=str(path), streams=4, max_tokens=8, rate=16.0, burst_s=0.1,
                         timeout_s=120)
    try:
        report = run_burst_job(cfg)
    finally:
        undeploy(ServeConfig.from_yaml(path, app_name="tfburst"))
    assert report["deployed"] is True and list(report["policies"]) == ["fcfs"]
    assert report["url"] == f"{serve_url}/tfburst"
    row = report["policies"]["fcfs"]
    assert row["streams"] == row["complete"] == 4 and row["rejected"] == 0


def test_the_trace_configs_differ_in_the_policy_only():
    from dataclasses import replace

    from tokenflow_ray.serve.config import ServeConfig

    fcfs, tokenflow = (ServeConfig.from_yaml(f"configs/serve/trace_cpu_{p}.yaml") for p in ("fcfs", "tokenflow"))
    assert (fcfs.engine.scheduler.policy, tokenflow.engine.scheduler.policy) == ("fcfs", "tokenflow")
    assert fcfs.engine.cache.num_device_blocks == 512 and fcfs.autoscaling is None
    same = replace(tokenflow, engine=replace(tokenflow.engine, scheduler=replace(tokenflow.engine.scheduler,
                                                                                   policy="fcfs")))
    assert same == fcfs
