"""Cost models: the GPU roofline against the measured anchors in gpu-notes.md, the calibrated fit, copies."""

from __future__ import annotations

import pytest

from tokenflow_ray.engine.plan import BlockCopy, ScheduledChunk, StepPlan
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.engine.step_time_model import StepTimeFit
from tokenflow_ray.sim.cost import CalibratedStepCost, HostLink, RooflineStepCost, StepShape, _nonnegative_2d
from tokenflow_ray.sim.hardware import DEPLOYMENTS, MODELS, deployment
from tokenflow_ray.sim.sim_runner import SimRunner


def _decode(batch: int, ctx: int) -> StepShape:
    return StepShape(batch, 0, batch * ctx, 0.0, batch)


def _prefill(tokens: int) -> StepShape:
    return StepShape(0, tokens, 0, tokens * tokens / 2, 1)


def test_kv_bytes_per_token_match_the_configs():
    assert MODELS["llama3-8b"].kv_bytes_per_token == 128 * 1024
    assert MODELS["qwen2.5-32b"].kv_bytes_per_token == 256 * 1024


def test_4090_llama_decode_at_batch_one_is_near_the_measured_18_2_ms():
    t = RooflineStepCost(deployment("4090", "llama3-8b")).step_s(_decode(1, 512))
    assert t == pytest.approx(18.2e-3, rel=0.10)  # llama.cpp F16 tg512 (gpu-notes.md §3.1)


def test_h200_llama_decode_at_batch_one_is_in_the_estimated_band():
    t = RooflineStepCost(deployment("h200", "llama3-8b")).step_s(_decode(1, 512))
    assert 4.5e-3 <= t <= 5.6e-3  # §3.1: 4.5-5.5 ms [est.]


@pytest.mark.parametrize(("gpu", "lo", "hi"), [("4090", 7e3, 10.5e3), ("a6000", 5e3, 8e3), ("h200", 35e3, 53e3)])
def test_llama_prefill_rate_is_in_the_estimated_band(gpu, lo, hi):
    t = RooflineStepCost(deployment(gpu, "llama3-8b")).step_s(_prefill(2048))
    assert lo <= 2048 / t <= hi  # §3.3 estimates (attention at 2k adds a few %)


def test_decode_grows_with_batch_and_context_and_tp_pays_all_reduce():
    cost = RooflineStepCost(deployment("4090", "llama3-8b"))
    assert cost.step_s(_decode(64, 512)) > cost.step_s(_decode(1, 512))
    assert cost.step_s(_decode(32, 4096)) > cost.step_s(_decode(32, 512))
    qwen = RooflineStepCost(deployment("4090", "qwen2.5-32b"))
    assert qwen._tp_s(256) > 0 and RooflineStepCost(deployment("h200", "qwen2.5-32b"))._tp_s(256) == 0
    assert cost.step_s(StepShape(0, 0, 0, 0.0, 0)) == 0.0


def test_every_deployment_fits_its_kv_pool_in_device_memory():
    for dep in DEPLOYMENTS.values():
        per_gpu = dep.model.weight_bytes / dep.tp + dep.kv_pool_tokens * dep.model.kv_bytes_per_token / dep.tp
        assert per_gpu < dep.gpu.memory_bytes, dep.name
    with pytest.raises(ValueError, match="no deployment"):
        deployment("h200", "gpt2")


def test_calibrated_fit_recovers_a_known_law():
    truth = CalibratedStepCost(StepTimeFit(0.004, 0.0002, 0.00005), context_s=1e-7)
    samples = []
    for d in range(1, 40, 3):
        for p in (0, 16, 64, 200):
            for ctx in (50, 150, 400):
                shape = StepShape(d, p, d * ctx, 0.0, d)
                samples.append((shape, truth.step_s(shape)))
    fitted = CalibratedStepCost.from_samples(samples)
    for shape, t in samples:
        assert fitted.step_s(shape) == pytest.approx(t, rel=0.05)
    with pytest.raises(ValueError, match="no measured steps"):
        CalibratedStepCost.from_samples([])


def test_calibrated_fit_recovers_the_prefill_attention_term():
    # Chunks of 16-256 tokens after prefixes of 0-512: pairs are not a multiple of tokens, so the two separate.
    truth = CalibratedStepCost(StepTimeFit(0.002, 0.0002, 0.0001), context_s=5e-7, pair_s=2e-7)
    samples = []
    for d in range(0, 40, 4):
        for ctx in (100, 400):  # context per decode varies too, or it is the decode term under another name
            for n, prefix in ((0, 0), (16, 0), (64, 0), (256, 0), (128, 256), (64, 512)):
                if d or n:
                    shape = StepShape(d, n, d * ctx, n * n / 2 + n * prefix, d + (n > 0))
                    samples.append((shape, truth.step_s(shape)))
    fitted = CalibratedStepCost.from_samples(samples)
    assert fitted.pair_s == pytest.approx(2e-7, rel=0.05) and fitted.context_s == pytest.approx(5e-7, rel=0.05)
    assert fitted.fit.prefill_s == pytest.approx(0.0001, rel=0.05)
    # for_policy keeps the model's terms, pairs included.
    assert fitted.for_policy(samples).pair_s == fitted.pair_s


def test_attention_terms_are_never_negative():
    # Steps that cost less the more context they read: the least-squares slope is negative; the fit pins it at 0.
    samples = [(StepShape(8, 0, ctx, 0.0, 8), 0.01 - 1e-6 * ctx) for ctx in range(100, 2000, 100)]
    assert CalibratedStepCost.from_samples(samples).context_s == 0.0
    assert _nonnegative_2d([(1.0, 2.0), (2.0, 1.0)], [-1.0, -1.0]) == (0.0, 0.0)
    assert _nonnegative_2d([(1.0, 0.0), (0.0, 1.0)], [3.0, -1.0]) == (3.0, 0.0)


def _runner(overlap: bool = True) -> SimRunner:
    info = ModelInfo("m", vocab_size=100, max_model_len=4096, eos_token_ids=frozenset({5}), kv_bytes_per_token=1000)
    cost = CalibratedStepCost(StepTimeFit(0.01, 0.001, 0.0001))
    return SimRunner(info, cost, block_size=10, link=HostLink(1e6, bidir_factor=0.5), overlap_copies=overlap,
                     cpu_overhead_s=0.001, token_id=3)


def _chunk(sid: str, n: int, start: int, sample: bool) -> ScheduledChunk:
    """A chunk with its block fields empty (the SimRunner reads only ids, lengths, positions and `sample`)."""
    return ScheduledChunk(stream_id=sid, token_ids=(1,) * n, start_pos=start, new_blocks=(), first_block=0,
                          sample=sample)


def _plan() -> StepPlan:
    decodes = (_chunk("a", 1, 7, True), _chunk("b", 1, 3, True))
    prefills = (_chunk("c", 20, 0, False),)
    out = (BlockCopy("x", 4, 0), BlockCopy("x", 5, 1), BlockCopy("y", 6, 2))
    return StepPlan(step_id=7, decodes=decodes, prefills=prefills, swap_out=out[:2], write_through=out[2:],
                    swap_in=(BlockCopy("z", 7, 3),))


def test_sim_runner_samples_only_finished_chunks_and_prices_the_plan():
    runner = _runner()
    result = runner.execute(_plan())
    assert result.sampled == {"a": 3, "b": 3} and result.step_id == 7
    assert result.compute_s == pytest.approx(0.01 + 2 * 0.001 + 20 * 0.0001)
    # 3 blocks out and 1 in at once: each direction at half the link, 10 kB a block -> 20 ms a block.
    assert result.swap_out_s == {"x": pytest.approx(0.04)}
    assert result.copy_s == pytest.approx(0.06)
    assert result.step_s == pytest.approx(max(result.compute_s, 0.06) + 0.001)
    assert result.copy_bytes == 4 * 10_000
    assert runner.totals.tokens_scheduled == 22 and runner.totals.tokens_sampled == 2


def test_without_overlap_copies_run_before_the_step_one_direction_at_a_time():
    result = _runner(overlap=False).execute(_plan())
    assert result.copy_s == pytest.approx(4 * 0.01)
    assert result.step_s == pytest.approx(result.compute_s + result.copy_s + 0.001)


def test_overlapped_scheduling_costs_only_what_exceeds_the_device_step():
    """The CUDA engine plans step N+1 while the device runs N: the scheduler's host time is hidden under a longer
    step and costs only its excess over a shorter one (serial: always added)."""
    info = ModelInfo("m", vocab_size=100, max_model_len=4096, eos_token_ids=frozenset({5}), kv_bytes_per_token=1000)
    cost = CalibratedStepCost(StepTimeFit(0.01, 0.001, 0.0001))
    plan = StepPlan(step_id=1, decodes=(_chunk("a", 1, 7, True),))

    def step_s(overhead: float, overlap: bool) -> float:
        return SimRunner(info, cost, 10, HostLink(1e6), cpu_overhead_s=overhead, token_id=3,
                         overlap_scheduling=overlap).execute(plan).step_s

    assert step_s(0.004, overlap=True) == pytest.approx(0.011)  # under the 11 ms step
    assert step_s(0.015, overlap=True) == pytest.approx(0.015)  # longer than the step: the device waits
    assert step_s(0.004, overlap=False) == pytest.approx(0.015)


def test_gpu_profiles_overlap_the_scheduler_like_the_cuda_engine():
    from tokenflow_ray.sim.setups import SCHEDULER_OVERHEAD_S, gpu_replica_setup

    setup = gpu_replica_setup("h200", "llama3-8b", "tokenflow")
    assert setup.overlap_scheduling and setup.cpu_overhead_s == SCHEDULER_OVERHEAD_S["tokenflow"]


def test_sim_runner_rejects_an_eos_token_id():
    info = ModelInfo("m", 10, 100, frozenset({0}), 8)
    with pytest.raises(ValueError, match="non-eos"):
        SimRunner(info, CalibratedStepCost(StepTimeFit(0.01, 0, 0.001)), 4, HostLink(1e9))


def test_for_policy_refits_the_per_step_and_per_decode_terms_only():
    law = CalibratedStepCost(StepTimeFit(0.002, 0.0001, 0.00005), context_s=1e-7)
    other = CalibratedStepCost(StepTimeFit(0.0025, 0.00015, 0.00005), context_s=1e-7)  # planning: +0.5 ms +50 µs/decode
    shapes = [StepShape(d, p, d * 100, 0.0, d) for d in range(1, 30) for p in (0, 64)]
    fitted = law.for_policy([(s, other.step_s(s)) for s in shapes])
    assert fitted.fit.fixed_s == pytest.approx(0.0025, rel=0.02)
    assert fitted.fit.decode_s == pytest.approx(0.00015, rel=0.02)
    assert (fitted.fit.prefill_s, fitted.context_s) == (0.00005, 1e-7)
