"""`tokenflow simulate` end to end in-process, and a small validation against the real CPU engine."""

from __future__ import annotations

import json

import pytest

from tokenflow_ray.cli import main


def test_simulate_writes_the_design_json_and_is_deterministic(tmp_path, capsys):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p in paths:
        assert main(["simulate", "--gpu", "4090", "--setup", "c", "--requests", "10", "--policy", "fcfs,tokenflow",
                     "--json", str(p), "--plots", str(tmp_path / "plots"), "--no-progress"]) == 0
    a, b = (p.read_text() for p in paths)
    assert a == b
    out = json.loads(a)
    assert out["setup"]["name"] == "c" and out["setup"]["gpu"] == "4090" and out["setup"]["num_requests"] == 10
    for name in ("fcfs", "tokenflow"):
        assert {"ttft_p50_s", "ttft_p99_s", "effective_tput", "raw_tput", "stall_s",
                "preemptions"} <= set(out["policies"][name])
    assert "vs_fcfs" in out["paper"] and "vs_fcfs" in out["ours"]
    assert (tmp_path / "plots" / "sim_4090_c.png").stat().st_size > 0


@pytest.mark.parametrize("argv", [["simulate", "--replicas", "0"], ["simulate", "--policy", "lifo"],
                                  ["simulate", "validate", "--streams", "1"]])
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert main([*argv, "--no-progress", "--requests", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tokenflow: error:") and "\n" not in err


def test_validation_runs_the_real_engine_and_the_calibrated_sim_on_the_same_workload():
    pytest.importorskip("torch")
    from tokenflow_ray.lab.sim_validate import ValidateConfig, run_validation

    cfg = ValidateConfig(num_streams=6, loads=(("low", 0.4),), policies=("fcfs", "tokenflow"), repeats=1)
    out = run_validation(cfg, progress=print)  # the figures, in the log of a failing run
    low = out["regimes"]["low"]
    assert set(low["errors"]) == {"fcfs", "tokenflow"} and low["streams"] == 6
    for policy in ("fcfs", "tokenflow"):
        real, sim = low["real"][policy], low["sim"][policy]
        assert real["num_finished"] == sim["num_finished"] == 6
        assert real["total_tokens"] == sim["total_tokens"]  # the same requests, token for token
        assert low["errors"][policy]["raw_tput_err"] is not None
        # A loose bar for 6 streams and one run of each on a shared CPU (a clean-clone CI run once had 0.62 in
        # relative error, against 0.02-0.15 here): within 2x either way; the note reports the 40-stream figures.
        ratio = sim["raw_tput"] / real["raw_tput"]
        assert 0.5 < ratio < 2.0, (policy, real["raw_tput"], sim["raw_tput"])
    assert out["capacity_tok_s"] > 0 and out["calibration"]["fcfs"]["prefill_s"] > 0
    assert isinstance(low["same_ranking"], bool)
