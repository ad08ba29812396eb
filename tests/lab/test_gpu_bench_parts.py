"""The bench's parts on their own: the slow-step measure, the serving setup against the H200 baseline, the graphs
part end to end on the CPU."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tokenflow_ray.lab.gpu.serving import FILE_KEYS, SAMPLES_COLUMNS, scaled_requests
from tokenflow_ray.lab.gpu.slow_steps import bucket, slow_step_share

# The lead's H200 data (../shared/data/h200 beside the checkout), where it is at hand.
SHARED = next((p / "shared" / "data" / "h200" for p in Path(__file__).resolve().parents
               if (p / "shared" / "data" / "h200").is_dir()), Path("/nonexistent"))


def test_slow_step_share_counts_steps_over_twice_their_buckets_median():
    # bucket 32: three 20 ms steps and one 50 ms (> 2 x 20); bucket 8192: one prefill step, its own median
    rows = [[32, 0, 0, 0, 32, 0.020]] * 3 + [[33, 0, 0, 0, 33, 0.050], [0, 8192, 0, 0, 1, 0.3]]
    r = slow_step_share(rows, wall_s=1.0)
    assert r["slow_steps"] == 1 and r["share"] == pytest.approx(0.05)
    assert r["buckets"]["32"]["median_ms"] == pytest.approx(20.0) and r["buckets"]["8192"]["slow_steps"] == 0
    assert r["over_60ms_steps"] == 1 and r["over_60ms_share"] == pytest.approx(0.3)
    assert [bucket(n) for n in (1, 2, 3, 255, 256, 8192)] == [1, 2, 2, 128, 256, 8192]
    with pytest.raises(ValueError, match="wall_s"):
        slow_step_share(rows, wall_s=0.0)


def test_serving_requests_are_the_baselines():
    """setup (a) x 1/8 as the H200 runs made them: 400 streams at t=0, 20 tok/s, 208,290 output tokens."""
    reqs = scaled_requests(1 / 8)
    assert len(reqs) == 400 and all(r.arrival_s == 0.0 and r.rate == 20.0 for r in reqs)
    assert sum(r.output_len for r in reqs) == 208_290
    assert [[r.index, r.prompt_len, r.output_len] for r in reqs[:3]] == [[0, 76, 441], [1, 67, 356], [2, 65, 423]]


@pytest.mark.skipif(not (SHARED / "setup_a_eighth_fcfs.json").is_file(), reason="the shared H200 data is not here")
def test_serving_file_keys_and_requests_equal_the_shared_baselines():
    shared = json.loads((SHARED / "setup_a_eighth_fcfs.json").read_text())
    assert tuple(shared) == FILE_KEYS and shared["samples_columns"] == list(SAMPLES_COLUMNS)
    assert shared["request_list"] == [[r.index, r.arrival_s, r.prompt_len, r.output_len, r.rate]
                                      for r in scaled_requests(1 / 8)]


def test_graphs_part_compares_eager_and_graph_runs_end_to_end(tmp_path, monkeypatch):
    """The part with `ModelConfig.enforce_eager` present (a subclass stands in until the CUDA graphs change is
    merged): both engines run every batch, and on the CPU (eager either way) the tokens are identical."""
    from tokenflow_ray.engine.config import ModelConfig
    from tokenflow_ray.lab.gpu import graphs, steps
    from tokenflow_ray.lab.gpu.context import PartContext

    @dataclasses.dataclass(frozen=True)
    class WithEnforceEager(ModelConfig):
        enforce_eager: bool = False

    monkeypatch.setattr(graphs, "ModelConfig", WithEnforceEager)
    monkeypatch.setattr(steps, "ModelConfig", WithEnforceEager)
    ctx = PartContext("graphs", "dry", None, tmp_path, tmp_path / "graphs.json", limit_s=300)
    graphs.run(ctx)
    saved = json.loads((tmp_path / "graphs.json").read_text())
    assert saved["graphs"]["graphs_active"] is False  # no CUDA graphs on the CPU
    assert saved["graphs_vs_eager"] == {"1": {"identical": 1, "of": 1, "first_diff": [None]},
                                        "2": {"identical": 2, "of": 2, "first_diff": [None, None]}}
    for label in ("graphs", "eager"):
        assert all(b["decode_step_ms_median"] > 0 and not b["stopped_early"] for b in saved[label]["batches"].values())


@pytest.mark.parametrize("mode", ["full", "quick", "dry"])
def test_every_parts_engine_config_is_valid_in_every_mode(mode, tmp_path):
    """What each part builds on the GPU (full, quick) is checked here without a GPU: the configs validate and are
    the baseline's (8B dummy bf16 on CUDA; the step grid's and setup (a)'s pools, batch caps and step budgets)."""
    from tokenflow_ray.lab.gpu import graphs, parity, serving, step_grid
    from tokenflow_ray.lab.gpu.budget import tasks
    from tokenflow_ray.lab.gpu.context import PartContext
    from tokenflow_ray.lab.gpu.paged_cases import case_specs

    def ctx(part, task=None):
        return PartContext(part, mode, task, tmp_path, tmp_path / "r.json", limit_s=60)

    grid = step_grid.engine_config(ctx("step_grid"))
    policies = {p: serving.engine_config(ctx("serving", p), 400) for p in tasks("serving", mode)}
    dims, specs = case_specs(mode)
    assert [s.name for s in specs] == ["decode", "prefill", "chunked_prefill", "mixed"]
    assert parity.engine_config(ctx("parity"), "bfloat16", "auto").model.dtype == "bfloat16"
    assert graphs._sizes(ctx("graphs"))[0] == ((1, 2) if mode == "dry" else (1, 8, 32))
    if mode == "dry":
        assert grid.model.device == "cpu" and grid.model.attention_backend == "sdpa"
        return
    assert (grid.model.model, grid.model.load_format, grid.model.dtype, grid.model.device) == \
        ("llama3-8b", "dummy", "bfloat16", "cuda")
    assert (grid.cache.num_device_blocks, grid.scheduler.max_num_seqs, grid.scheduler.max_num_batched_tokens) == \
        (20_000, 256, 8192)
    assert tuple(policies) == (("fcfs", "tokenflow", "andes") if mode == "full" else ("fcfs", "tokenflow"))
    for policy, cfg in policies.items():
        assert (cfg.scheduler.policy, cfg.cache.num_device_blocks, cfg.cache.num_host_blocks, cfg.cache.block_size,
                cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (policy, 1734, 6936, 16, 256, 8192)
    assert (dims.block_size, dims.heads, dims.kv_heads, dims.head_dim) == (16, 32, 8, 128)
    assert specs[0].decode_lens[:4] == (1, 16, 17, 2048) and max(specs[0].decode_lens) == 2048


def test_the_step_grid_points_are_the_baselines():
    from tokenflow_ray.lab.gpu.step_grid import GRID, QUICK_GRID

    keys = [f"b{b}_p{p}" for b, p in GRID]
    assert keys == ["b1_p512", "b16_p512", "b64_p512", "b128_p512", "b256_p256", "b256_p1024", "b32_p2048"]
    assert set(QUICK_GRID) <= set(GRID)
    if (SHARED / "step_grid.json").is_file():
        assert list(json.loads((SHARED / "step_grid.json").read_text())["runs"]) == keys


def test_the_attention_comparison_fails_a_wrong_backend():
    """SDPA passes against the float64 reference; a backend off by 1% fails the tolerance, one that skips the KV
    write fails the write check."""
    import torch

    from tokenflow_ray.lab.gpu.attention import TOLERANCE, _compare, _passes
    from tokenflow_ray.lab.gpu.paged_cases import case_specs, make_case, reference
    from tokenflow_ray.layers.attention import SdpaPagedAttention

    class OffByOnePercent(SdpaPagedAttention):
        def forward(self, *args):
            return super().forward(*args) * 1.01

    class SkipsTheWrite(SdpaPagedAttention):
        def forward(self, q, k, v, k_cache, v_cache, meta):
            meta.kv_written = True
            return super().forward(q, k, v, k_cache, v_cache, meta)

    dims, specs = case_specs("dry")
    cpu = torch.device("cpu")
    for spec in specs:
        case = make_case(spec, dims, seed=1)
        expected = reference(case, torch.float32)
        good = _compare(SdpaPagedAttention(), case, expected, expected[0], cpu, torch.float32)
        assert _passes(good, TOLERANCE["float32"]) and good["max_abs_vs_reference"] < 1e-5, spec.name
        off = _compare(OffByOnePercent(), case, expected, expected[0], cpu, torch.float32)
        assert not _passes(off, TOLERANCE["float32"]) and off["kv_write_exact"], spec.name
        assert not _compare(SkipsTheWrite(), case, expected, expected[0], cpu, torch.float32)["kv_write_exact"]


@pytest.mark.parametrize("overlap", [False, True])
def test_drive_times_every_step_as_the_engine_serves_it(overlap):
    """drive() runs `LLMEngine.step()` (overlapped when the config says so) and records one timed step, with the
    shape of the plan that finished, for every step the engine ran, and every token of every stream."""
    from tests.engine.factories import make_fake_engine
    from tokenflow_ray.engine.sampling import SamplingParams
    from tokenflow_ray.lab.gpu.steps import drive
    from tokenflow_ray.sim.cost import StepShape

    engine, _ = make_fake_engine(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32)
    engine.config = dataclasses.replace(engine.config, overlap_scheduling=overlap)
    ids = [engine.add_request([1 + i, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(5)]
    shapes = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: shapes.append(StepShape.of(plan)) or execute(plan)
    out = drive(engine)
    assert [s.shape for s in out.steps] == shapes and engine.scheduler.num_unfinished == 0
    assert all(s.s >= 0 for s in out.steps) and sorted(out.tokens) == sorted(ids)
    assert all(len(t) == 6 for t in out.tokens.values())

