"""The policies' ranking keys written out for speed give the order their definitions give: tokenflow's
`_rank_key` against sorting by `utility` itself (so the two cannot drift apart), `arrival_key` as the tuple."""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine.plan_digest import _fake_engine, _fake_requests
from tokenflow_ray.engine.policies.base import arrival_key
from tokenflow_ray.lab.host_bench import HostBenchConfig, build_engine


def _utility_ranking(engine):
    """The utility ranking (`ranking="utility"`, what `_rank_key` writes out); the default ranks by tiers."""
    policy = engine.scheduler.policy
    policy.config = dataclasses.replace(policy.config, ranking="utility")
    return engine


def _reference(policy, live, view):
    return sorted(live, key=lambda s: (-policy.utility(s, view), -s.rate, (s.arrival_time, s.stream_id)))


def _check_rankings(engine, steps: int, every: int) -> int:
    """Step the engine; every few steps rank its live streams both ways (at a time just after the clock's, as
    the next step will). Returns how many rankings were compared."""
    sched, compared = engine.scheduler, 0
    for i in range(steps):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.clock.advance(0.02)
        if i % every == 0 and sched.streams:
            view = sched.view(engine.clock.now())
            live = list(sched.streams.values())
            got = sched.policy.rank(live, view)
            if sched.policy.overloaded:  # the fallback ranks by arrival
                assert got == sorted(live, key=arrival_key)
                continue
            assert [s.stream_id for s in got] == [s.stream_id for s in _reference(sched.policy, live, view)]
            compared += 1
    return compared


def test_tokenflow_rank_key_orders_as_utility_does_in_the_bench_regime():
    engine = _utility_ranking(build_engine(HostBenchConfig(), "tokenflow", 150))
    assert _check_rankings(engine, steps=240, every=7) >= 20


@pytest.mark.parametrize("seed", [7, 8])
def test_tokenflow_rank_key_orders_as_utility_does_with_mixed_and_unpaced_readers(seed):
    engine = _utility_ranking(_fake_engine("tokenflow", overlap=False))
    _fake_requests(engine, seed=seed)  # rates 0, 8, 20, 40; eos, stop tokens, arrivals over 3 s
    live = engine.scheduler.streams
    for _ in range(20):
        engine.step()
        engine.clock.advance(0.02)
    sid = next(iter(live))
    engine.report_consumption(sid, rate=12.5)  # a reader's rate changed by its client
    assert _check_rankings(engine, steps=400, every=3) >= 10


def test_arrival_key_is_arrival_then_id():
    engine = build_engine(HostBenchConfig(), "fcfs", 3)
    s = engine.scheduler.streams["s00001"]
    assert arrival_key(s) == (s.arrival_time, "s00001")
