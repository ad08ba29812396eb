"""The pure autoscaling decision (cluster/autoscaling.py): signals, hysteresis, pending scale-ups, invariants."""

from __future__ import annotations

import math
import random

import pytest

from tests.engine.factories import make_fake_engine, step_engine
from tokenflow_ray.cluster.autoscaling import (
    METRIC_NAMES,
    ReplicaLoad,
    ScalingRules,
    count_buffer_critical,
    decide,
)
from tokenflow_ray.cluster.replica_stats import replica_stats_from_engine
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus

RULES = ScalingRules(target_utilization=0.8, downscale_utilization=0.5, waiting_per_replica=0.0,
                     critical_per_replica=0.0, pressure_cooldown_s=5.0)


def load(demand=0.0, gamma=100.0, live=0, batch=64, waiting=0, critical=0) -> ReplicaLoad:
    return ReplicaLoad(demand_rate=demand, capacity_tok_s=gamma, num_live=live, batch_capacity=batch,
                       num_waiting=waiting, num_critical=critical)


def fleet(*loads: ReplicaLoad) -> dict[str, ReplicaLoad]:
    return {f"r{i}": x for i, x in enumerate(loads)}


def test_an_idle_replica_holds():
    d = decide(fleet(load()), current=1, rules=RULES, now=100.0)
    assert (d.target, d.reason) == (1, "hold")


def test_declared_rate_over_capacity_scales_proportionally():
    # 300 tok/s of readers over replicas of Γ = 100 at 80%: ceil(300 / 80) = 4.
    d = decide(fleet(load(demand=200.0), load(demand=100.0)), current=2, rules=RULES, now=0.0)
    assert (d.target, d.reason) == (4, "rate")
    assert d.demand_rate == 300.0 and d.capacity_tok_s == 200.0


def test_unpaced_streams_scale_on_batch_occupancy():
    # 60 unpaced streams (rate 0) on a batch of 64: 60 / (0.8 * 64) > 1.
    d = decide(fleet(load(live=60)), current=1, rules=RULES, now=0.0)
    assert (d.target, d.reason) == (2, "rate")


def test_waiting_streams_add_one_replica_once_the_last_scale_up_settled():
    busy = fleet(load(demand=10.0, live=8, waiting=3))
    assert decide(busy, 1, RULES, now=100.0).target == 2  # never scaled up before
    assert decide(busy, 1, RULES, now=100.0, last_scale_up=90.0).reason == "pressure"
    just = decide(busy, 1, RULES, now=100.0, last_scale_up=97.0)
    assert (just.target, just.reason) == (1, "pending")
    # The new replica counts in `current` but has not reported yet: wait for it, do not ask for a third.
    pending = decide(busy, 2, RULES, now=100.0)
    assert (pending.target, pending.reason) == (2, "pending")


def test_buffer_critical_streams_are_pressure():
    d = decide(fleet(load(demand=20.0, live=4, critical=1), load()), current=2, rules=RULES, now=10.0)
    assert (d.target, d.reason) == (3, "pressure")
    tolerant = ScalingRules(critical_per_replica=1.0)
    # One critical stream within the tolerance (1 per replica) is no pressure: the light load scales down.
    assert decide(fleet(load(demand=20.0, live=4, critical=1), load()), 2, tolerant, now=10.0).reason == "down"


def test_scale_down_needs_the_smaller_fleet_to_fit_at_the_lower_utilization():
    # Three replicas of Γ = 100. 120 tok/s needs 2 at 80% but 3 at 50%: hold. 40 tok/s fits 1 at 50%: down to 1.
    mid = fleet(load(demand=60.0), load(demand=60.0), load())
    assert decide(mid, 3, RULES, now=0.0).reason == "hold"
    low = fleet(load(demand=40.0), load(), load())
    d = decide(low, 3, RULES, now=0.0)
    assert (d.target, d.reason) == (1, "down")


def test_no_flapping_between_up_and_down():
    # Demand 120 took the fleet to 2 (ceil(120/80)); at 2 the same demand must hold (down needs 120/50 -> 3).
    assert decide(fleet(load(demand=120.0)), 1, RULES, now=0.0).target == 2
    assert decide(fleet(load(demand=60.0), load(demand=60.0)), 2, RULES, now=0.0).reason == "hold"


def test_no_scale_down_under_pressure_or_with_a_silent_replica():
    waiting = fleet(load(waiting=1), load())
    assert decide(waiting, 2, RULES, now=0.0).reason == "pressure"
    assert decide(waiting, 2, RULES, now=0.0, last_scale_up=-1.0).reason == "pending"
    silent = fleet(load())  # 2 replicas, 1 reporting
    assert decide(silent, 2, RULES, now=0.0).reason == "hold"


def test_no_metrics_keeps_the_current_target():
    assert decide({}, 2, RULES, now=0.0).reason == "no-metrics"
    assert decide({}, 2, RULES, now=0.0).target == 2


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="utilization"):
        ScalingRules(target_utilization=0.5, downscale_utilization=0.6)
    with pytest.raises(ValueError, match="pressure_cooldown_s"):
        ScalingRules(pressure_cooldown_s=-1.0)
    with pytest.raises(ValueError, match="capacity_tok_s"):
        load(gamma=0.0)
    with pytest.raises(ValueError, match="demand_rate"):
        load(demand=math.nan)
    with pytest.raises(ValueError, match="current"):
        decide({}, -1, RULES, now=0.0)


def test_rules_round_trip_through_policy_kwargs():
    rules = ScalingRules(target_utilization=0.7, waiting_per_replica=2.0)
    assert ScalingRules(**rules.to_kwargs()) == rules
    assert set(load().to_metrics()) == set(METRIC_NAMES)


def test_invariants_over_random_fleets():
    rng = random.Random(7)
    for _ in range(2000):
        current = rng.randint(1, 6)
        n = rng.randint(0, current)
        loads = fleet(*(load(demand=rng.choice([0.0, rng.uniform(0, 400)]), gamma=rng.uniform(20, 200),
                             live=rng.randint(0, 80), waiting=rng.choice([0, 0, rng.randint(1, 5)]),
                             critical=rng.choice([0, 0, 0, rng.randint(1, 3)])) for _ in range(n)))
        now, last_up = 100.0, rng.choice([None, 99.0, 50.0])
        d = decide(loads, current, RULES, now, last_up)
        assert d.target >= 1
        pressure = d.num_waiting > 0 or d.num_critical > 0
        if d.reason == "down":
            assert d.target < current and not pressure and n == current
            gamma = sum(x.capacity_tok_s for x in loads.values()) / n
            assert d.demand_rate <= RULES.downscale_utilization * gamma * d.target + 1e-6
        elif d.reason in ("rate", "pressure"):
            assert d.target > current
        else:
            assert d.target == current
        if d.reason == "pressure":
            assert d.target == current + 1 and n == current
        # More demand never asks for fewer replicas.
        if loads:
            k = next(iter(loads))
            more = dict(loads, **{k: load(demand=loads[k].demand_rate + 50.0, gamma=loads[k].capacity_tok_s,
                                          live=int(loads[k].num_live), waiting=int(loads[k].num_waiting),
                                          critical=int(loads[k].num_critical))})
            assert decide(more, current, RULES, now, last_up).target >= d.target


# ---- the replica side: metrics from a real engine over the fake runner ----------------------------------------

def test_replica_load_from_engine_counts_critical_readers():
    engine, _ = make_fake_engine(num_blocks=64, block_size=8, max_num_seqs=2, num_host_blocks=32, policy="fcfs")
    sp = SamplingParams(max_tokens=200, ignore_eos=True)
    fast = engine.add_request([1] * 8, sp, rate=1000.0)  # reads faster than it is generated: always critical
    engine.clock.advance(0.001)  # distinct arrivals: FCFS order is then fixed
    engine.add_request([2] * 8, sp, rate=0.5)  # buffers quickly
    engine.clock.advance(0.001)
    engine.add_request([3] * 8, sp, rate=5.0)  # waits: batch of 2
    step_engine(engine, 30)
    now = engine.clock.now()
    streams = engine.scheduler.streams
    assert streams[fast].status == StreamStatus.RUNNING
    critical = count_buffer_critical(engine, t_critical_s=1.0)
    expected = [s for s in streams.values() if s.rate > 0 and s.first_token_time is not None
                and s.buffer_s(now) < 1.0]
    assert critical == len(expected) >= 1
    assert count_buffer_critical(engine, t_critical_s=0.0) == 0
    rs = replica_stats_from_engine(engine)
    x = ReplicaLoad.from_replica_stats(rs, batch_capacity=2, num_critical=critical)
    assert x.demand_rate == pytest.approx(1005.5) and x.num_waiting == 1 == rs.num_waiting
    assert (x.num_live, x.batch_capacity, x.capacity_tok_s) == (3, 2, rs.capacity_tok_s)
    assert all(isinstance(v, float) for v in x.to_metrics().values())  # Serve drops non-numeric metrics
