"""`bench policies --sweep`: the JSON contract from a tiny real run (embedded model), the PNG, the CLI's guards."""

from __future__ import annotations

import json

import pytest

from tokenflow_ray.cli import main
from tokenflow_ray.lab.policy_bench import PolicyBenchConfig
from tokenflow_ray.lab.sweep import SweepConfig, run_sweep
from tokenflow_ray.lab.sweep_plots import write_sweep_plot

CONTRACT = ("ttft_p50_s", "ttft_p99_s", "effective_tput", "raw_tput", "stall_s", "preemptions")


@pytest.mark.timeout(180)  # ~12 s on a quiet 2-core box; other work on it stretches that
def test_tiny_sweep_has_the_contract_shape(tmp_path):
    # 4 short requests, 2 burst loads and one timed preset, one repeat, one policy pair: ~20-30 s on 2 cores.
    base = PolicyBenchConfig(num_requests=4, length_scale=1 / 32, repeats=1, policies=("fcfs", "tokenflow"))
    lines: list[str] = []
    out = run_sweep(SweepConfig(base=base, loads=(1.0, 0.5), presets=("poisson",), calibration_steps=16),
                    progress=lines.append)
    json.dumps(out)  # JSON-safe as it stands
    cap = out["capacity"]
    assert cap["tok_s"] > 0 and cap["batch"] >= 1 and cap["method"]
    assert cap["config"]["num_threads"] == base.num_threads and cap["config"]["model"] == base.model
    assert [(p["workload"], p["load"]) for p in out["sweep"]] == [("burst", 0.5), ("burst", 1.0), ("poisson", 1.0)]
    for point in out["sweep"]:
        n = 12 if point["workload"] == "poisson" else 4  # timed presets: 3 stream lifetimes of arrivals
        assert point["gamma_tok_s"] == cap["tok_s"] and point["num_requests"] == n
        assert set(point["policies"]) == {"fcfs", "tokenflow"}
        assert point["demand"]["peak"] > 0
        for summary in point["policies"].values():
            assert all(isinstance(summary[k], (int, float)) for k in CONTRACT)
            assert summary["num_finished"] == n
        assert len(point["runs"]["fcfs"]) == 1  # every run kept
        assert set(point["tokenflow_vs_fcfs"]) >= {"effective_tput", "ttft_p99", "raw_tput", "qoe", "ttft_mean"}
    burst = out["sweep"][:2]
    for point in burst:
        assert point["sum_rates"] == pytest.approx(point["load"] * cap["tok_s"])
        assert point["arrival_rate"] is None
    assert out["sweep"][2]["arrival_rate"] > 0
    # The memory regime is the same at every point.
    assert len({p["policies"]["fcfs"]["device_blocks"] for p in out["sweep"]}) == 1
    assert any("Γ" in line for line in lines) and any("point 3/3" in line for line in lines)

    png = write_sweep_plot(out["sweep"], tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.endswith("sweep.png")


def _point(workload, load, eff, p99):
    return {"workload": workload, "load": load, "sum_rates": 1000.0 * load, "gamma_tok_s": 1000.0,
            "policies": {"fcfs": {"effective_tput": eff, "ttft_p99_s": p99},
                         "tokenflow": {"effective_tput": 1.5 * eff, "ttft_p99_s": None}}}


def test_sweep_plot_from_synthetic_points(tmp_path):
    sweep = [_point("burst", x, 400.0 * x, 2.0 * x) for x in (0.5, 0.75, 1.0, 1.25, 1.5)]
    sweep += [_point(name, 1.0, 420.0, 1.8) for name in ("poisson", "gamma", "mixed")]
    path = write_sweep_plot(sweep, tmp_path / "plots" / "sweep.png", title="synthetic")
    assert (tmp_path / "plots" / "sweep.png").stat().st_size > 10_000 and path.endswith("sweep.png")


@pytest.mark.parametrize("argv", [
    ["bench", "policies", "--loads", "1"],  # --loads without --sweep
    ["bench", "policies", "--sweep", "--ablation"],
    ["bench", "policies", "--sweep", "--presets", "trace"],
    ["bench", "policies", "--sweep", "--loads", "1,1"],
    ["bench", "peer", "--loads", "1", "--systems", "fcfs"],
])
def test_cli_guards_exit_2_before_running(argv, capsys):
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_cli_peer_size_flags_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "peer", "--streams", "8", "--load", "1.0"])
    with pytest.raises(SystemExit):
        main(["bench", "policies", "--sweep", "--loads", "0,1"])  # argparse: not positive
