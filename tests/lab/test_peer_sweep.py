"""`bench peer --sweep` assembly without servers: each load point's config, the sweep entries, the plots."""

from __future__ import annotations

import json

import pytest

from tests.client_results import fake_load_result
from tokenflow_ray.lab.capacity import Capacity, CapacityConfig
from tokenflow_ray.lab.peer import peer_sweep
from tokenflow_ray.lab.peer.peer_bench import PeerBenchConfig, system_summary
from tokenflow_ray.lab.sweep_plots import write_sweep_plot


def _capacity(tok_s: float) -> Capacity:
    cfg = CapacityConfig(num_device_blocks=480, mean_prompt_len=64, mean_output_len=256)
    return Capacity(tok_s=tok_s, overall_tok_s=tok_s, median_step_tok_s=tok_s, batch=cfg.batch, timed_steps=96,
                    context_mean=192.0, step_s_p50=0.005, window_tok_s=(tok_s,), wall_s=3.0, config=cfg)


def test_peer_sweep_points(monkeypatch, tmp_path):
    seen: list[PeerBenchConfig] = []

    def fake_bench(cfg: PeerBenchConfig):
        seen.append(cfg)
        runs = {name: fake_load_result(0.1 + 0.1 * i, streams=4, finished=True)
                for i, name in enumerate(cfg.systems)}
        report = {"systems": {name: system_summary(res) for name, res in runs.items()},
                  "workload": {"name": cfg.workload, "streams": cfg.streams, "max_tokens": cfg.max_tokens,
                               "rates": {str(cfg.rate): cfg.streams}},
                  "kv": {"ours_bytes": 1 << 20, "vllm_bytes": 1 << 20}, "wall_s": 1.0}
        return report, runs

    monkeypatch.setattr(peer_sweep, "run_peer_bench", fake_bench)
    cfg = PeerBenchConfig(systems=("fcfs", "tokenflow"), log_dir=str(tmp_path / "logs"))
    out = peer_sweep.run_peer_sweep(cfg, (1.0, 0.5), _capacity(1000.0), plots_dir=str(tmp_path / "plots"))
    json.dumps(out)
    assert [c.streams for c in seen] == [25, 50]  # round(load x 1000 / 20), loads ascending
    assert seen[0].log_dir.endswith("load-0.5")  # vLLM logs per point, not overwritten
    assert [p["load"] for p in out["sweep"]] == [0.5, 1.0] and out["capacity"]["tok_s"] == 1000.0
    for point in out["sweep"]:
        assert point["workload"] == "burst" and point["gamma_tok_s"] == 1000.0
        assert point["sum_rates"] == pytest.approx(point["load"] * 1000.0)
        assert set(point["policies"]) == {"fcfs", "tokenflow"}
        assert set(point["tokenflow_vs_fcfs"]) >= {"effective_tput", "ttft_p99", "raw_tput", "qoe", "ttft_mean"}
        assert all(p.endswith(".png") for p in point["plots"])
    png = write_sweep_plot(out["sweep"], tmp_path / "plots" / "sweep.png", line_workload="burst")
    assert (tmp_path / "plots" / "sweep.png").stat().st_size > 0 and png.endswith("sweep.png")
