"""`tokenflow bench policies --trace`: a few seconds of the Azure slice through the real engine (embedded model)
under fcfs and tokenflow, with the reader-felt figures and the guards in the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from tokenflow_ray.cli import main
from tokenflow_ray.workloads.traces import TraceOptions, load_trace

SLICE = Path(__file__).parents[1] / "workloads" / "data" / "azure_conv_slice.csv"


def test_policy_bench_replays_a_trace_on_the_real_engine(tmp_path, capsys):
    out_path = tmp_path / "bench.json"
    argv = ["bench", "policies", "--trace", str(SLICE), "--window", "0:0.1", "--speed", "4", "--length-scale",
            "0.05", "--policies", "fcfs,tokenflow", "--repeats", "1", "--json", str(out_path)]
    assert main(argv) == 0
    out = json.loads(out_path.read_text())
    expected = load_trace(SLICE, TraceOptions(window=(0, 0.1), speed=4, length_scale=0.05, max_context=2048))
    assert out["workload"]["num_requests"] == len(expected.requests) >= 5
    assert out["workload"]["trace"] == str(SLICE) and out["workload"]["speed"] == 4
    for name in ("fcfs", "tokenflow"):
        s = out["policies"][name]
        assert s["num_finished"] == len(expected.requests)  # every stream of the trace ran to its length
        assert s["total_tokens"] == sum(r.output_len for r in expected.requests)
        assert s["qoe_mean"] is not None and s["stall_per_stream_p99_s"] is not None
        assert (s["device_blocks"], s["host_blocks"]) == (512, 2048)
    assert set(out["guards"]["tokenflow_vs_fcfs"]["checks"]) >= {"qoe", "ttft_mean", "raw_tput"}
    assert "guards tokenflow vs fcfs" in capsys.readouterr().out


def test_trace_options_need_a_trace(capsys):
    assert main(["bench", "policies", "--window", "0:1"]) == 2
    assert "only with --trace" in capsys.readouterr().err


def test_prefix_cache_modes_reach_the_bench_engine():
    import pytest

    from tokenflow_ray.lab.policy_bench import PolicyBenchConfig, bench_engine_config
    from tokenflow_ray.workloads.generators import RequestSpec

    requests = [RequestSpec(index=0, arrival_s=0.0, prompt_len=32, output_len=64, rate=20.0)]
    tiers = {mode: bench_engine_config(PolicyBenchConfig(prefix_cache=mode), "fcfs", requests).cache
             for mode in ("off", "device", "device+host")}
    assert [(c.enable_prefix_caching, c.host_prefix_caching) for c in tiers.values()] == \
        [(False, False), (True, False), (True, True)]
    assert bench_engine_config(PolicyBenchConfig(), "fcfs", requests).cache == tiers["device+host"]  # the default
    with pytest.raises(ValueError, match="--prefix-cache"):
        PolicyBenchConfig(prefix_cache="host")
