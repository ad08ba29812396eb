"""Decode capacity Γ and the overload test (Eq. 6): a burst within capacity must not collapse (issue 13, item 2)."""

import random

import pytest

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.cost_model import CostModel
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.step_time_model import StepTimeModel


def _burst(policy: str, streams: int = 40, rate: float = 20.0, slots: int = 16) -> tuple[int, float, bool]:
    """The issue's case: 40 streams at 20 tok/s into 16 slots of a 10 ms-a-step fake runner (Γ ≈ 1600 tok/s,
    demand 800). Returns (steps to finish, mean streams running, whether the policy ever declared overload)."""
    engine, _ = make_fake_engine(num_blocks=512, block_size=8, max_num_seqs=slots, max_num_batched_tokens=256,
                                 policy=policy, num_host_blocks=2048)
    for i in range(streams):
        engine.add_request([i % 200 + 1] * 16, SamplingParams(max_tokens=64, ignore_eos=True), rate=rate)
    steps, running, overloaded = 0, 0, False
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        running += engine.stats().num_running
        overloaded |= getattr(engine.scheduler.policy, "overloaded", False)
        steps += 1
        engine.clock.advance(engine.runner.step_cost_s)
        assert steps < 5000, "the burst did not finish"
    return steps, running / steps, overloaded


def test_a_burst_within_capacity_runs_at_full_batch():
    # Before the fix: tokenflow took 1395 steps at 1.8 streams running (Σ rates over waiting streams, Γ
    # extrapolated from the batch it had itself chosen, so the FCFS fallback admitted one stream at a time).
    fcfs_steps, fcfs_running, _ = _burst("fcfs")
    tf_steps, tf_running, overloaded = _burst("tokenflow")
    assert not overloaded
    assert tf_steps <= 1.1 * fcfs_steps
    assert tf_running >= 0.9 * fcfs_running


def test_capacity_is_predicted_for_a_batch_not_run():
    """A runner whose step time does not depend on the batch (weight-bound decode): Γ at 16 streams is 16 tokens
    a step, although only 2 ever ran."""
    cost = CostModel(block_bytes=512)
    for _ in range(50):
        cost.observe_step(0.01, 2, 0, 0.0, 0)
    assert cost.decode_capacity_tok_s(16) == pytest.approx(1600, rel=0.05)


def test_step_time_model_separates_fixed_decode_and_prefill_costs():
    rng = random.Random(0)
    model = StepTimeModel()
    for _ in range(300):
        decodes, prefill = rng.randint(1, 32), rng.choice([0, 0, 64, 128, 200])
        model.observe(decodes, prefill, 0.003 + 2e-4 * decodes + 5e-5 * prefill)
    fit = model.fit
    assert fit.fixed_s == pytest.approx(0.003, rel=0.05)
    assert fit.decode_s == pytest.approx(2e-4, rel=0.05)
    assert fit.prefill_s == pytest.approx(5e-5, rel=0.05)
    assert model.fit.predict(64) == pytest.approx(0.003 + 64 * 2e-4, rel=0.05)  # a batch never seen


def test_step_time_model_never_predicts_negative_costs():
    model = StepTimeModel()
    for b in (1, 2, 4, 8):  # step time falls with the batch (noise): the decode cost is pinned at 0, not < 0
        model.observe(b, 0, 0.01 - 1e-4 * b)
    fit = model.fit
    assert fit.decode_s == 0.0 and fit.fixed_s > 0 and fit.prefill_s > 0
    assert fit.predict(8) == pytest.approx(0.0095, rel=0.05)


def test_recompute_estimate_is_prefill_only():
    """Mixed steps: the recompute time per token is the prefill cost, not step time spread over decode tokens."""
    rng = random.Random(1)
    cost = CostModel(block_bytes=512, prefill_chunk_tokens=256)
    for _ in range(200):
        decodes, prefill = rng.randint(16, 64), rng.randint(16, 64)
        cost.observe_step(0.002 + 1e-4 * decodes + 1e-3 * prefill, decodes, prefill, 0.0, 0)
    # 100 tokens: one chunk's fixed cost plus 100 prefill tokens; the old estimate, compute / (prefill + decodes),
    # put it near 100 x 4.4e-4 s.
    assert cost.t_recompute(100) == pytest.approx(0.002 + 100 * 1e-3, rel=0.05)
    assert cost.t_recompute(600) == pytest.approx(3 * 0.002 + 600 * 1e-3, rel=0.05)  # three 256-token chunks


@pytest.mark.parametrize("margin", [1.0, 2.0])
def test_overload_margin_bounds_the_working_set_demand(margin):
    """Streams join the working set until its Σ rates reach margin × Γ; past that nobody new is admitted (Eq. 6).
    Γ here: 7 streams fit the device at mid-life (11 of its 80 blocks each), 10 ms a step whatever the batch -> 700
    tok/s; 40 streams at 40 tok/s."""
    from tokenflow_ray.engine.policies import TokenFlowConfig

    engine, _ = make_fake_engine(num_blocks=80, block_size=8, max_num_seqs=8, max_num_batched_tokens=256,
                                 policy="tokenflow", num_host_blocks=4096,
                                 tokenflow=TokenFlowConfig(overload_margin=margin, lam=0.0, delta_t=0.05,
                                                           patience_s=0.0, behind_leads=0.0))  # pause at once:
    # the cap, not patience nor the paused streams' lateness
    for i in range(40):
        engine.add_request([i + 1] * 16, SamplingParams(max_tokens=144, ignore_eos=True), rate=40.0)
    sched = engine.scheduler
    most = 0
    for _ in range(150):
        engine.step()
        engine.check_integrity()
        engine.clock.advance(engine.runner.step_cost_s)
        most = max(most, sched.view(engine.clock.now()).num_working)
    view = sched.view(engine.clock.now())
    assert view.max_device_batch == 7
    capacity = sched.cost.decode_capacity_tok_s(view.max_device_batch)
    assert capacity == pytest.approx(700, rel=0.05)
    assert most == pytest.approx(margin * capacity / 40.0, abs=2)


def test_capacity_counts_the_whole_step_not_only_the_model():
    """On the wall clock a step is more than the runner's compute (planning, a CPU shared with a proxy): Γ is what
    the engine delivers. The runner here reports 1 ms of compute while each step takes 6 ms of wall time."""
    import time
    from dataclasses import replace as dc_replace

    from tokenflow_ray.engine.clock import WallClock
    from tokenflow_ray.engine.llm_engine import LLMEngine

    engine, runner = make_fake_engine(num_blocks=512, block_size=8, max_num_seqs=8)
    execute = runner.execute

    def slow_execute(plan):
        result = execute(plan)
        time.sleep(0.006)
        return dc_replace(result, compute_s=0.001)

    runner.execute = slow_execute
    engine = LLMEngine(engine.config, runner, tokenizer=None, clock=WallClock())
    for i in range(8):
        engine.add_request([i + 1] * 8, SamplingParams(max_tokens=60, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    cost = engine.scheduler.cost
    assert cost.decode_capacity_tok_s(8) < 8 / 0.005  # not 8 / 0.001
    assert cost.step_s == pytest.approx(0.001, rel=0.2)  # copies still size to the model step
