"""`tokenflow simulate --trace` end to end on the shipped Azure slice: the reader-felt figures, the guards, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenflow_ray.cli import main
from tokenflow_ray.workloads.traces import TraceOptions, load_trace

SLICE = Path(__file__).parents[1] / "workloads" / "data" / "azure_conv_slice.csv"


def test_simulate_replays_a_trace_with_what_readers_feel(tmp_path, capsys):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p in paths:
        assert main(["simulate", "--trace", str(SLICE), "--window", "0:1", "--speed", "4", "--gpu", "4090",
                     "--policy", "fcfs,tokenflow", "--json", str(p), "--no-progress"]) == 0
    a, b = (p.read_text() for p in paths)
    assert a == b  # a seed's replay is the same run to run
    out = json.loads(a)
    expected = load_trace(SLICE, TraceOptions(window=(0, 1), speed=4))
    setup = out["setup"]
    assert setup["num_requests"] == len(expected.requests) and setup["speed"] == 4 and setup["gpu"] == "4090"
    assert setup["rates"] == [[15.0, 0.4], [20.0, 0.6]] and setup["format"] == "azure"
    for name in ("fcfs", "tokenflow"):
        s = out["policies"][name]
        assert s["num_streams"] == s["num_finished"] == len(expected.requests)
        assert {"qoe_mean", "stall_per_stream_mean_s", "stall_per_stream_p99_s", "ttft_mean_s", "ttft_p99_s",
                "raw_tput", "effective_tput"} <= set(s)
    report = out["guards"]["tokenflow_vs_fcfs"]
    assert report["regime"] in ("fcfs keeps up", "overload") and set(report["checks"]) >= {"qoe", "raw_tput"}
    assert {"qoe", "ttft_mean", "stall_mean_minus_s"} <= set(out["ours"]["vs_fcfs"])
    printed = capsys.readouterr().out
    assert "QoE" in printed and "stall mean" in printed and "guards tokenflow_vs_fcfs" in printed


@pytest.mark.parametrize("argv, message", [
    (["--trace", "/no/such/trace.csv"], "/no/such/trace.csv: no such trace file"),
    (["--trace", str(SLICE), "--window", "10"], "--window: expected START_MIN:MINUTES"),
    (["--trace", str(SLICE), "--rates", "15:0.5"], "--rates"),
    (["--trace", str(SLICE), "--setup", "b"], "--trace: replaces --setup"),
    (["--speed", "2"], "--speed: only with --trace"),
])
def test_bad_trace_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["simulate", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tokenflow: error:") and "\n" not in err and message in err


def test_a_bad_row_names_the_file_and_line_on_the_cli(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47,9,x\n")
    assert main(["simulate", "--trace", str(bad), "--no-progress"]) == 2
    assert f"{bad}:3: GeneratedTokens" in capsys.readouterr().err
