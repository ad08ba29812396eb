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


SLICE = "tests/workloads/data/azure_conv_slice.csv"


def test_validate_trace_replays_the_trace_on_the_engine_and_the_sim_calibrated_on_the_next_window(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "v.json"
    # Six seconds of the slice (~30 streams of ~60-token prompts) at 4x: a few seconds a real run.
    assert main(["simulate", "validate", "--trace", SLICE, "--window", "0:0.1", "--length-scale", "0.05",
                 "--speed", "4", "--repeats", "1", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert out["trace"]["window"] == [0.0, 0.1] and out["calibration_trace"]["window"] == [0.1, 0.1]
    assert out["policies"] == ["fcfs", "tokenflow"] and out["trace"]["speed"] == 4.0
    for policy in out["policies"]:
        real, sim = out["real"][policy], out["sim"][policy]
        assert real["num_finished"] == sim["num_finished"] == out["trace"]["num_requests"]
        assert real["total_tokens"] == sim["total_tokens"]  # the same requests, token for token
        assert set(out["errors"][policy]) == {f"{m}_err" for m in ("ttft_p50", "ttft_p99", "raw_tput",
                                                                   "effective_tput", "ttft_mean", "qoe")}
        # One run of a few seconds on a shared CPU: a loose bar (the note reports the 2-minute windows).
        assert 0.5 < sim["raw_tput"] / real["raw_tput"] < 2.0, (policy, real["raw_tput"], sim["raw_tput"])
    law = out["calibration"]["fcfs"]
    assert law["prefill_s"] > 0 and law["pair_s"] >= 0 and law["context_s"] >= 0
    assert out["max_err"] == max(out[f"{m}_err"] for m in ("ttft_p50", "ttft_p99", "raw_tput", "effective_tput",
                                                           "ttft_mean", "qoe"))
    assert set(out["guards"]) == {"real", "sim"}


@pytest.mark.parametrize("argv, message", [
    (["--trace", SLICE], "needs --window"),
    (["--trace", SLICE, "--window", "0:0.5", "--policy", "tokenflow"], "include it in --policy"),
    (["--length-scale", "0.5"], "--length-scale: only with"),
])
def test_validate_trace_bad_input_is_one_line(argv, message, capsys):
    assert main(["simulate", "validate", *argv, "--repeats", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tokenflow: error:") and message in err and "\n" not in err
