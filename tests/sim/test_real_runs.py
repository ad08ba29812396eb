"""Real GPU runs as simulator inputs: the run format, the measured profile's fit and `simulate validate --real`.

The runs here are made by the simulator with known costs (synthetic_runs.py), so a fit must recover those costs and a
replay must reproduce the run; the H200 files themselves are not in CI.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.sim.synthetic_runs import COLD, LAW, LINK, make_run
from tokenflow_ray.cli import main
from tokenflow_ray.engine.policies import TokenFlowConfig
from tokenflow_ray.engine.policies.tokenflow_config import AS_BEFORE
from tokenflow_ray.sim.calibrate_gpu import fit_measured, grid_check, speed_trace
from tokenflow_ray.sim.real_runs import RunFormatError, parse_real_run, read_real_run


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {p: make_run(p) for p in ("fcfs", "tokenflow")}


def test_the_reader_takes_the_format_and_leaves_other_keys(runs):
    data = runs["tokenflow"]
    run = parse_real_run(data, "t")
    assert run.policy == "tokenflow" and len(run.requests) == len(data["request_list"]) == 40
    assert run.requests[3].prompt_len == data["request_list"][3][2] and run.requests[3].rate == 20.0
    assert run.engine.cache.num_device_blocks == 80 and run.engine.cache.num_host_blocks == 320
    assert run.engine.scheduler.policy == "tokenflow" and run.engine.scheduler.max_num_batched_tokens == 512
    assert run.engine.scheduler.tokenflow == TokenFlowConfig()  # the config the run recorded
    unrecorded = parse_real_run({**data, "engine": {k: v for k, v in data["engine"].items() if k != "tokenflow"}})
    assert unrecorded.engine.scheduler.tokenflow == TokenFlowConfig(**AS_BEFORE)  # the first GPU runs' policy
    assert len(run.samples) == len(data["samples"]) and run.samples[0][1] == data["samples"][0][5]
    assert run.copy_bytes_s == LINK.bytes_s and run.warmup is None
    assert run.info.kv_bytes_per_token == 131_072


@pytest.mark.parametrize(("drop", "message"), [("request_list", "request_list"), ("engine", "engine"),
                                               ("samples_columns", "samples"), ("summary", "summary")])
def test_a_missing_key_is_named(runs, drop, message):
    data = dict(runs["fcfs"])
    del data[drop]
    with pytest.raises(RunFormatError, match=message):
        parse_real_run(data)


def test_bad_values_are_named(runs, tmp_path):
    data = json.loads(json.dumps(runs["fcfs"]))
    data["engine"]["policy"] = "lifo"
    with pytest.raises(RunFormatError, match="engine.policy"):
        parse_real_run(data)
    data = json.loads(json.dumps(runs["fcfs"]))
    data["samples_columns"] = ["decodes", "prefill_tokens", "step_s"]
    with pytest.raises(RunFormatError, match="decode_context"):
        parse_real_run(data)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(RunFormatError, match="JSON object"):
        read_real_run(tmp_path / "bad.json")


def test_a_recorded_tokenflow_config_replays_the_code_that_made_it():
    assert TokenFlowConfig.as_run({}) == TokenFlowConfig(**AS_BEFORE)
    assert TokenFlowConfig.as_run({"mu": 3.0}).mu == 3.0
    with pytest.raises(ValueError, match="unknown fields"):
        TokenFlowConfig.as_run({"no_such_knob": 1})


def test_the_fit_recovers_the_law_and_the_new_shape_costs(runs):
    fit = fit_measured([parse_real_run(runs["fcfs"], "f"), parse_real_run(runs["tokenflow"], "t")])
    assert fit.method == "aligned replay" and fit.rms_s < 1e-6  # fcfs's plans replay step for step
    law = fit.profile.laws["fcfs"]
    assert law.fit.fixed_s == pytest.approx(LAW.fit.fixed_s, rel=1e-3)
    assert law.fit.decode_s == pytest.approx(LAW.fit.decode_s, rel=1e-3)
    assert fit.profile.cold.decode_shape_s == pytest.approx(COLD.decode_shape_s, rel=1e-3)
    assert fit.profile.cold.prefill_shape_s == pytest.approx(COLD.prefill_shape_s, rel=1e-3)
    # The same law made tokenflow's run: its own per-step terms, refitted on its warm steps, come back the same.
    assert fit.profile.laws["tokenflow"].fit.fixed_s == pytest.approx(LAW.fit.fixed_s, rel=0.02)
    assert fit.profile.link.bytes_s == LINK.bytes_s and not fit.profile.link.duplex


def test_a_run_at_the_laws_pace_has_a_flat_speed_trace(runs):
    run = parse_real_run(runs["fcfs"], "f")
    trace = speed_trace(run, LAW, COLD, window_s=0.5)
    assert trace and all(f == pytest.approx(1.0, abs=1e-9) for _, f in trace)


def test_validate_real_replays_synthetic_runs_without_error(runs, tmp_path, capsys):
    paths = []
    for policy, data in runs.items():
        path = tmp_path / f"{policy}.json"
        path.write_text(json.dumps(data))
        paths.append(str(path))
    grid = {"runs": {"b4": {"batch": 4, "prompt": 16, "steps": [
        {"decodes": 4, "prefill_tokens": 0, "decode_context": 100, "s": LAW.fit.predict(4, 0) + LAW.context_s * 100}]}}}
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    out_path = tmp_path / "out.json"
    assert main(["simulate", "validate", "--real", *paths, "--grid", str(tmp_path / "grid.json"),
                 "--json", str(out_path)]) == 0
    out = json.loads(out_path.read_text())
    for policy in ("fcfs", "tokenflow"):
        errors = out["errors"][policy]  # medians over replays with the law x0.98, x1, x1.02
        assert set(errors) == {"ttft_p50_err", "ttft_p99_err", "raw_tput_err", "effective_tput_err", "stall_err"}
        assert all(e is not None and e < 0.05 for e in errors.values()), errors
        exact = out["errors_single"][policy]  # the law as fitted: the run replayed exactly
        assert all(e is not None and e < 0.01 for e in exact.values()), exact
        assert out["runs"][policy]["sensitivity"]["raw_tput"]["members"] == 3
        assert set(out["errors_single"][policy]) == set(errors)
    assert out["raw_tput_err"] < 0.05 and out["fit"]["method"] == "aligned replay"
    assert math.isclose(out["step_grid"]["b4"]["err"], 0.0, abs_tol=1e-9)
    assert "stall err" in capsys.readouterr().out


def test_grid_check_compares_the_full_batch_steps():
    grid = {"runs": {"b2": {"steps": [
        {"decodes": 0, "prefill_tokens": 32, "decode_context": 0, "s": 1.0},  # a prefill: not a grid point
        {"decodes": 1, "prefill_tokens": 0, "decode_context": 40, "s": 9.0},  # one stream left: not the batch
        {"decodes": 2, "prefill_tokens": 0, "decode_context": 40, "s": 0.030},
        {"decodes": 2, "prefill_tokens": 0, "decode_context": 42, "s": 0.030}]}}}
    from tokenflow_ray.sim.calibrate_gpu import MeasuredProfile

    row = grid_check(grid, MeasuredProfile({"fcfs": LAW}, COLD, LINK))["b2"]
    assert row["batch"] == 2 and row["real_s"] == 0.030
    assert row["err"] == pytest.approx((LAW.fit.fixed_s + 2 * LAW.fit.decode_s - 0.030) / 0.030)


def test_an_unrecorded_warm_up_is_pinned_by_the_runs_first_admission():
    """tokenflow's first admission is its working-set cap 2Γ/r, Γ learnt from the warm-up's steps: a run made after
    a dearer warm-up (its first step 0.6 s) admits fewer at t = 0, and the replay finds a first-step cost that
    admits as many; fcfs's first admission does not depend on it."""
    from dataclasses import replace as dc_replace

    from tokenflow_ray.sim.calibrate_gpu import first_prefill_tokens, warmup_matching_first_step
    from tokenflow_ray.sim.simulator import ReplicaSetup

    cold = dc_replace(COLD, first_step_s=0.6)
    data = make_run("tokenflow", cold=cold)
    run = parse_real_run(data, "t")
    setup = ReplicaSetup(run.engine, run.info, LAW, LINK, cold=COLD)  # a profile whose first step is free
    assert first_prefill_tokens(run, setup) != run.samples[0][0].prefill_tokens
    matched = warmup_matching_first_step(run, setup)
    assert matched is not None and matched.first_step_s > 0
    assert first_prefill_tokens(run, dc_replace(setup, cold=matched)) == run.samples[0][0].prefill_tokens
    fcfs = parse_real_run(make_run("fcfs", cold=cold), "f")
    assert warmup_matching_first_step(fcfs, ReplicaSetup(fcfs.engine, fcfs.info, LAW, LINK, cold=COLD)) is None
