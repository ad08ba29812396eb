"""The mechanisms behind tokenflow's raw-throughput loss and tail on the GPU runs (issue 35), each with its fix:
a capacity estimate one-off steps cannot swing, an overload fallback that does not flap, the fallback's memory-aware
admission, rotation by need (tiers) within a copy budget, and reload against recompute weighted by the batch.

Engine-level checks run on the fake runner with integrity checked every step; the end-to-end one on the simulator
with its conservation and block-integrity checks on every step.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tests.engine.factories import make_fake_engine, step_engine
from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow_ray.engine.cost_model import MIN_DECODE_STEPS, CostModel
from tokenflow_ray.engine.policies import TokenFlowConfig, TokenFlowPolicy
from tokenflow_ray.engine.policies.base import SchedulerView
from tokenflow_ray.engine.policies.tokenflow_config import AS_BEFORE
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.step_time_model import StepTimeFit, StepTimeModel
from tokenflow_ray.sim.cost import CalibratedStepCost, HostLink
from tokenflow_ray.sim.experiments import summarize_outcome
from tokenflow_ray.sim.simulator import ReplicaSetup, Simulation
from tokenflow_ray.workloads.generators import RequestSpec

OLD = replace(TokenFlowConfig(), **AS_BEFORE)  # the policy as it ran on the H200 (commit 5e9bf8e)


# ---- capacity: one-off steps cannot swing Γ ----------------------------------------------------------------------
def test_decode_step_capacity_holds_against_new_shape_steps_and_cold_prefills():
    """The H200 engine's steps: ~17 ms + 70 µs a decode, every 4th decode step paying a new shape (+56 ms), every
    10th a prefill of a few prompts paying new shapes (+61 ms each). Γ at 83 streams from decode steps stays
    within the band the warm and cold decode steps span, every step; the mixed model's is moved by the prefills."""
    rng = random.Random(0)
    cost = CostModel(block_bytes=2 << 20, prefill_chunk_tokens=8192)
    warm = 83 / (0.017 + 7e-5 * 83)
    seen_mixed, seen_decode = [], []
    for i in range(400):
        if i % 10 == 3:
            tokens = rng.randint(300, 1500)
            cost.observe_step(0.017 + 2.3e-5 * tokens + 0.061 * rng.randint(1, 4), 60, tokens, 0.0, 0)
        else:
            d = rng.randint(60, 110)
            cost.observe_step(0.017 + 7e-5 * d + (0.056 if i % 4 == 0 else 0.0), d, 0, 0.0, 0)
        if cost.decode_steps.samples >= MIN_DECODE_STEPS:
            seen_decode.append(cost.decode_step_capacity_tok_s(83))
            seen_mixed.append(cost.decode_capacity_tok_s(83))
    assert all(0.5 * warm <= g <= 1.05 * warm for g in seen_decode), (min(seen_decode), max(seen_decode), warm)
    assert max(seen_decode) / min(seen_decode) < 1.3
    assert max(seen_mixed) / min(seen_mixed) > max(seen_decode) / min(seen_decode)


def test_a_clipped_step_time_model_bounds_what_one_step_teaches():
    plain, clipped = StepTimeModel(0.02, 5e-4), StepTimeModel(0.02, 5e-4, clip=2.0)
    for m in (plain, clipped):
        for _ in range(50):
            m.observe(64, 0, 0.02)
        m.observe(64, 0, 2.0)  # a one-off 100x step (a kernel loaded on first use)
    assert clipped.fit.predict(64) < 1.05 * 0.02 < plain.fit.predict(64)
    with pytest.raises(ValueError, match="clip"):
        StepTimeModel(clip=1.0)


def test_the_bounded_fit_is_the_best_feasible_corner():
    """Exact: no feasible pinning of the three costs has a smaller squared error than the fit returned."""
    rng = random.Random(3)
    for _ in range(20):
        m = StepTimeModel(0.02, 5e-4)
        for _ in range(30):
            d, p = rng.randint(0, 200), rng.choice([0, 0, 400, 4000])
            m.observe(d, p, max(1e-4, 0.02 + rng.gauss(0, 0.02) - 1e-4 * d + 3e-5 * p))
        fit = m.fit
        best = m._objective([fit.fixed_s, fit.decode_s, fit.prefill_s])
        for theta in ([0.0, fit.decode_s, fit.prefill_s], [fit.fixed_s, 0.0, fit.prefill_s]):
            assert best <= m._objective(theta) + 1e-12


# ---- the overload flag does not flap -------------------------------------------------------------------------------
def _view(cost: CostModel, sum_rate: float) -> SchedulerView:
    return SchedulerView(now=0.0, cost=cost, device_blocks=100, host_blocks=400, block_size=16, max_num_seqs=64,
                         num_working=10, sum_rate=sum_rate, mean_full_blocks=10.0, mean_rate=20.0,
                         max_device_batch=10)


@pytest.mark.parametrize(("hysteresis", "flips"), [(0.0, 3), (0.1, 1)])
def test_overload_fallback_holds_until_demand_is_clearly_back(hysteresis, flips):
    cost = CostModel(block_bytes=512)
    for _ in range(20):
        cost.observe_step(0.01, 10, 0, 0.0, 0)  # Γ = 1000 tok/s at 10 streams: the limit is 2000
    policy = TokenFlowPolicy(TokenFlowConfig(overload_hysteresis=hysteresis))
    states = []
    for demand in (2100, 1950, 2050, 1950, 1850, 1750):  # ±5% around the limit, then clearly under it
        policy.rank([], _view(cost, demand))
        states.append(policy.overloaded)
    assert sum(a != b for a, b in zip(states, states[1:])) == flips
    assert states[0] and not states[-1]


# ---- the fallback's memory-aware admission ----------------------------------------------------------------------
def _overloaded_burst(config: TokenFlowConfig) -> tuple[int, int]:
    """24 streams at 200 tok/s into a 10 ms fake runner whose pool holds ~6 at mid-life: deep overload, the FCFS
    fallback. Returns (preemptions, tokens recomputed); integrity is checked after every step."""
    engine, _ = make_fake_engine(num_blocks=48, block_size=8, max_num_seqs=16, max_num_batched_tokens=128,
                                 policy="tokenflow", num_host_blocks=512, tokenflow=config)
    for i in range(24):
        engine.add_request([i % 50 + 1] * 12, SamplingParams(max_tokens=48, ignore_eos=True), rate=200.0)
    overloaded = 0
    steps = 0
    while engine.has_unfinished():
        step_engine(engine)
        overloaded += engine.scheduler.policy.overloaded
        steps += 1
        assert steps < 5000
    assert overloaded > steps / 2  # the regime: the fallback held for most of the run
    records = list(engine.finished_records)
    return sum(r.preemptions for r in records), sum(r.tokens_recomputed for r in records)


def test_memory_aware_admission_in_the_fallback_stops_the_thrash():
    with_reserve = _overloaded_burst(replace(OLD, capacity_from="decode_steps", overload_hysteresis=0.1,
                                             growth_reserve=True))
    without = _overloaded_burst(replace(OLD, capacity_from="decode_steps", overload_hysteresis=0.1))
    # Since a load waits for room for its next token (scheduler_admission.py) the run without the reserve is
    # preempted less (21 -> 18-19 times; 15 with it): the reserve's gain shows in the tokens recomputed.
    assert with_reserve[0] < without[0] and with_reserve[1] < 0.8 * without[1], (with_reserve, without)


# ---- rotation by need, within a copy budget ------------------------------------------------------------------------
def test_a_paused_stream_with_buffer_ranks_after_new_ones_and_a_due_one_before_the_running():
    engine, _ = make_fake_engine(num_blocks=64, block_size=4, num_host_blocks=256, policy="tokenflow",
                                 tokenflow=TokenFlowConfig(delta_t=0.1))
    sched = engine.scheduler
    a = engine.add_request([1] * 8, SamplingParams(max_tokens=400), stream_id="a", rate=2.0)
    b = engine.add_request([2] * 8, SamplingParams(max_tokens=400), stream_id="b", rate=2.0)
    step_engine(engine, 40)  # ~40 tokens each, read at 2 tok/s: ~19 s of buffer
    assert sched.preempt(a, engine.clock.now())
    step_engine(engine)
    c = engine.add_request([3] * 8, SamplingParams(max_tokens=400), stream_id="c", rate=2.0)
    policy, view = sched.policy, sched.view(engine.clock.now())
    tiers = {s.stream_id: policy.tier(s, view) for s in sched.streams.values()}
    assert tiers == {"a": 2, "b": 3, "c": 4}  # paused with buffer, running with full value, new
    assert [s.stream_id for s in policy.rank(list(sched.streams.values()), view)] == [c, b, a]
    now = engine.clock.now()
    lead = policy.lead_s(sched.streams[a], view)
    engine.clock.advance(sched.streams[a].buffer_s(now) - lead / 2)  # a's reader drains its buffer: a is due
    view = sched.view(engine.clock.now())
    assert policy.tier(sched.streams[a], view) == 4
    assert policy.rank([sched.streams[b], sched.streams[a]], view)[0].stream_id == a


def test_a_rebalance_starts_reloads_only_within_its_link_budget():
    engine, _ = make_fake_engine(num_blocks=256, block_size=4, num_host_blocks=1024, policy="tokenflow",
                                 max_num_batched_tokens=256,
                                 tokenflow=TokenFlowConfig(delta_t=0.5, switch_link_share=0.25))
    sched = engine.scheduler
    sids = [engine.add_request([i + 1] * 40, SamplingParams(max_tokens=400), rate=5.0) for i in range(6)]
    step_engine(engine, 3)
    for sid in sids:
        assert sched.preempt(sid, engine.clock.now())
    step_engine(engine)  # tails to the host: six paused streams of 11 blocks each
    view = sched.view(engine.clock.now())
    sched.cost._copy.value = 25 * sched.cost.block_bytes / (0.25 * 0.5)  # the learnt link: 25 blocks a budget
    budget = sched.policy.load_budget_blocks(view)
    assert budget == pytest.approx(25)
    paused = [sched.streams[s] for s in sids]
    taken = sched._admissible_before_next_rebalance(paused, len(paused), view)
    blocks = [sched.pool.blocks_for_tokens(s.num_host_tokens) for s in taken]
    assert len(taken) == 2 and sum(blocks) <= budget  # 11 + 11 of 25: the third waits for a later rebalance
    new = engine.add_request([9] * 8, SamplingParams(max_tokens=8), rate=5.0)
    taken = sched._admissible_before_next_rebalance(paused + [sched.streams[new]], 7, view)
    assert sched.streams[new] in taken  # a new stream needs no reload: the budget does not hold it back


def test_reload_is_preferred_unless_the_batch_would_wait_longer_on_a_recompute():
    policy = TokenFlowPolicy(TokenFlowConfig())
    engine, _ = make_fake_engine(num_blocks=64, block_size=4, num_host_blocks=256, policy="tokenflow")
    sid = engine.add_request([1] * 8, SamplingParams(max_tokens=40), rate=0.0)
    stream = engine.scheduler.streams[sid]
    view = replace(engine.scheduler.view(0.0), max_device_batch=80)
    assert policy.resume_by_load(stream, t_io=0.5, t_recompute=0.01, view=view)  # 0.5 s < 80 x 10 ms
    assert not policy.resume_by_load(stream, t_io=1.0, t_recompute=0.01, view=view)
    assert not TokenFlowPolicy(OLD).resume_by_load(stream, t_io=0.5, t_recompute=0.01, view=view)  # the sooner


def _mild_overload(config: TokenFlowConfig | None, policy: str = "tokenflow") -> dict:
    """60 streams of ~1k-token prompts and ~400-token outputs at 20 tok/s on a law of 10 ms + 0.1 ms a decode,
    a pool that holds a third of them, a 3 GB/s link: the H200 setups' regime (long contexts, Σ rates above Γ)."""
    requests = [RequestSpec(i, 0.0, 1024 + (i * 13) % 32, 384 + (i * 29) % 64, 20.0) for i in range(60)]
    engine = EngineConfig(cache=CacheConfig(block_size=16, num_device_blocks=1200, num_host_blocks=8000),
                          scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, policy=policy,
                                                    tokenflow=config or TokenFlowConfig()), record_history=80)
    info = ModelInfo("m", 1000, 8192, frozenset(), 65536)
    setup = ReplicaSetup(engine, info, CalibratedStepCost(StepTimeFit(0.01, 1e-4, 2e-5)), HostLink(3e9))
    return summarize_outcome(Simulation(setup, checks=True, integrity=True).run(requests))


def test_rotation_by_need_keeps_raw_throughput_where_the_old_rotation_lost_it():
    fcfs = _mild_overload(None, "fcfs")
    old, new = _mild_overload(OLD), _mild_overload(TokenFlowConfig())
    assert old["raw_tput"] < 0.92 * fcfs["raw_tput"]  # the mechanism: every Δt half the set reloaded
    assert new["raw_tput"] >= 0.97 * fcfs["raw_tput"]
    assert new["preemptions"] < old["preemptions"]
    assert new["ttft_p99_s"] <= 0.3 * fcfs["ttft_p99_s"] and new["effective_tput"] >= 1.5 * fcfs["effective_tput"]
    assert new["num_finished"] == old["num_finished"] == 60
    for s in (old, new):
        assert s["total_tokens"] == fcfs["total_tokens"]


def test_the_fused_ranking_key_orders_as_tier_then_utility():
    """rank() computes tier and the order within it in one pass per stream (it runs every step): the same order as
    the methods, over running, paused (due or not), new and unpaced streams."""
    engine, _ = make_fake_engine(num_blocks=40, block_size=4, num_host_blocks=512, policy="tokenflow",
                                 max_num_seqs=8, tokenflow=TokenFlowConfig(delta_t=0.1))
    sched = engine.scheduler
    rng = random.Random(5)
    for i in range(14):
        engine.add_request([i + 1] * rng.randint(4, 20), SamplingParams(max_tokens=rng.randint(40, 200)),
                           rate=rng.choice([0.0, 2.0, 5.0, 20.0]))
    for step in range(60):
        step_engine(engine)
        if step % 7 == 3:  # pause a running stream now and then, so paused ones of every age are about
            running = [s for s in sched.streams.values() if s.status.name == "RUNNING"]
            if running:
                sched.preempt(rng.choice(running).stream_id, engine.clock.now())
        policy, view = sched.policy, sched.view(engine.clock.now())
        live = list(sched.streams.values())
        expected = sorted(live, key=lambda s: (-policy.tier(s, view), policy.within_tier(s, view), -s.rate,
                                               s.arrival_time, s.stream_id))
        assert [s.stream_id for s in policy.rank(live, view)] == [s.stream_id for s in expected] or \
            policy.overloaded
