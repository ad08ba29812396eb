"""`tokenflow simulate --tokenflow SPEC` and `tokenflow simulate cpu-sweep` (the policy sweep on the CPU law)."""

from __future__ import annotations

import json

import pytest


def test_tokenflow_spec_sets_fields_over_the_defaults_or_the_policy_as_it_ran():
    from tokenflow_ray.engine.policies import TokenFlowConfig
    from tokenflow_ray.engine.policies.tokenflow_config import AS_BEFORE
    from tokenflow_ray.lab.sim_cli import tokenflow_config

    assert tokenflow_config(None) is None
    assert tokenflow_config("mu=3,pace=true") == TokenFlowConfig(mu=3.0, pace=True)
    old = tokenflow_config("as_before,ranking=tiers,switch_link_share=None")
    assert old.ranking == "tiers" and old.switch_link_share is None
    assert old.capacity_from == AS_BEFORE["capacity_from"]
    with pytest.raises(ValueError, match="KEY=VALUE"):
        tokenflow_config("mu")


def test_cpu_sweep_runs_the_sweeps_regimes_on_a_calibrated_law(tmp_path):
    from tokenflow_ray.lab.policy_bench import PolicyBenchConfig
    from tokenflow_ray.lab.sim_cpu_sweep import capacity, load_calibration, run_point

    cal = tmp_path / "validate.json"
    law = {"fixed_s": 0.0015, "decode_s": 8e-5, "prefill_s": 1e-4, "context_s": 8e-7}
    cal.write_text(json.dumps({"calibration": {"fcfs": law, "tokenflow": law}, "copy_bytes_s": 4e9}))
    laws, bw = load_calibration(cal)
    base = PolicyBenchConfig(num_requests=12)
    gamma = capacity(base, laws["fcfs"])
    assert gamma > 0 and bw == 4e9
    from tokenflow_ray.engine.policies import TokenFlowConfig

    point = run_point(base, "burst", 1.0, gamma, laws, bw, TokenFlowConfig(delta_t=0.2))
    assert point["num_requests"] == 12 and point["sum_rates"] == pytest.approx(gamma)
    assert {p: s["num_finished"] for p, s in point["policies"].items()} == {"fcfs": 12, "tokenflow": 12}
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a `simulate validate` JSON"):
        load_calibration(tmp_path / "bad.json")
