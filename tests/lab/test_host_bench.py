"""`tokenflow bench host` end to end at a tiny size (no timing asserted), and the NullRunner it measures with."""

from __future__ import annotations

import json

import pytest

from tokenflow_ray.cli import main
from tokenflow_ray.engine.null_runner import NullRunner
from tokenflow_ray.engine.plan import BlockCopy, ScheduledChunk, StepPlan
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.lab.host_bench import HostBenchConfig, build_engine, host_requests

_INFO = ModelInfo(name="x", vocab_size=100, max_model_len=512, eos_token_ids=frozenset({2}),
                  kv_bytes_per_token=10)


def test_bench_host_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--streams", "20", "--steps", "5", "--warmup", "3", "--repeats", "2",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["streams"] == [20] and report["config"]["device_blocks"] == 1734
    rows = report["host"]
    assert [(r["policy"], r["streams"]) for r in rows] == [("fcfs", 20), ("tokenflow", 20), ("andes", 20)]
    for r in rows:
        assert {"policy", "streams", "ms_median", "ms_mean", "ms_p90", "steps"} <= set(r)
        assert r["steps"] == 5 and len(r["runs_ms_median"]) == 2
        assert r["ms_median"] > 0 and r["ms_p90"] >= r["ms_median"]
    assert "fcfs" in capsys.readouterr().out


def test_bench_host_refuses_bad_input():
    assert main(["bench", "host", "--policies", "fcfs,nope"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "host", "--streams", "0"])
    with pytest.raises(ValueError, match="step_s"):
        HostBenchConfig(step_s=0.0)


def test_bench_regime_is_setup_a_at_an_eighth():
    lengths = host_requests(HostBenchConfig(), 400)
    mean_prompt = sum(p for p, _ in lengths) / 400
    mean_output = sum(o for _, o in lengths) / 400
    assert 56 <= mean_prompt <= 72 and 470 <= mean_output <= 550
    engine = build_engine(HostBenchConfig(), "tokenflow", 30)
    assert engine.scheduler.num_unfinished == 30 and engine.pool.num_blocks == 1734
    assert engine.scheduler.kv.host.num_blocks == 6936


def test_null_runner_samples_every_sampling_chunk_and_acknowledges_copies():
    runner = NullRunner(_INFO, block_size=4, compute_s=0.01, copy_bytes_per_s=400.0, token_id=7)
    plan = StepPlan(step_id=3, decodes=(ScheduledChunk("a", (5,), 9, (), 0, True),),
                    prefills=(ScheduledChunk("b", (1, 1, 1), 0, (4,), 0, True),
                              ScheduledChunk("c", (1, 1), 0, (5,), 0, False)),
                    swap_out=(BlockCopy("d", 1, 2), BlockCopy("e", 3, 4)),
                    write_through=(BlockCopy("a", 6, 7),))
    result = runner.execute(plan)
    assert result.step_id == 3 and result.sampled == {"a": 7, "b": 7}
    assert result.compute_s == 0.01 and result.copy_bytes == 3 * 40 and result.copy_s == pytest.approx(0.3)
    assert result.swap_out_s == pytest.approx({"d": 0.1, "e": 0.2})
    assert runner.execute(StepPlan(step_id=4)).compute_s == 0.0  # nothing to run: no compute reported
    with pytest.raises(ValueError, match="token_id"):
        NullRunner(_INFO, 4, token_id=2)  # eos would end every stream at once
    with pytest.raises(ValueError, match="compute_s"):
        NullRunner(_INFO, 4, compute_s=float("nan"))
