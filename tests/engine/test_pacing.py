"""Deadline-aware pacing (engine/policies/pacing.py): D, the hold rule and its gates, and pacing in a live engine."""

import pytest

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.policies import TokenFlowConfig
from tokenflow_ray.engine.policies.pacing import Pacer
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus


def ids(streams) -> set[str]:
    return {s.stream_id for s in streams}


def _two_streams(steps: int = 12):
    """`ahead`: a 30-token stream whose reader reads 0.5 tok/s (far behind); `behind`: a reader at 50 tok/s that
    keeps up. Both run `steps` steps of 0.05 s."""
    engine, _ = make_fake_engine(num_blocks=64, block_size=4, num_host_blocks=64, policy="tokenflow",
                                 tokenflow=TokenFlowConfig(pace=True))
    ahead = engine.add_request([1] * 4, SamplingParams(max_tokens=30), rate=0.5)
    behind = engine.add_request([2] * 4, SamplingParams(max_tokens=200), rate=50.0)
    for _ in range(steps):
        engine.step()
        engine.check_integrity()
        engine.clock.advance(0.05)
    streams = engine.scheduler.streams
    return engine, streams[ahead], streams[behind]


def test_a_stream_ahead_of_its_reader_is_held_until_the_deadline_needs_it():
    engine, ahead, behind = _two_streams()
    now = engine.clock.now()
    left = (30 - ahead.num_output_tokens) + (200 - behind.num_output_tokens)
    pacer = Pacer(pace_buffer=0.3, min_read_share=0.5, slack=0.05)
    pacer.track([ahead, behind], now, capacity=1.0, step_s=0.05, active=True)  # D = now + left s: time to spare
    assert pacer.deadline == pytest.approx(now + left)
    assert ids(pacer.candidates([ahead, behind], now)) == {ahead.stream_id}  # the keeping-up reader is never held
    fresh = Pacer(pace_buffer=0.3, min_read_share=0.5, slack=0.05)
    fresh.track([ahead, behind], now, capacity=1000.0, step_s=0.05, active=True)  # D in 0.2 s: behind schedule
    assert ids(fresh.candidates([ahead, behind], now)) == set()
    fresh.track([ahead, behind], now, capacity=1.0, step_s=0.05, active=False)  # the FCFS fallback: no pacing
    assert ids(fresh.candidates([ahead, behind], now)) == set()


def test_only_a_reader_holding_pace_buffer_of_its_length_is_held():
    engine, ahead, behind = _two_streams()
    now = engine.clock.now()
    buffered = ahead.reader.buffer_at(now)
    for share, held in ((buffered / 30 - 0.05, True), (buffered / 30 + 0.05, False)):
        pacer = Pacer(pace_buffer=share, min_read_share=0.5, slack=0.05)
        pacer.track([ahead, behind], now, capacity=1.0, step_s=0.05, active=True)
        assert (ahead.stream_id in ids(pacer.candidates([ahead], now))) is held


def test_a_reader_that_cannot_read_half_its_stream_by_the_deadline_is_not_held():
    """D 20 s away: a 0.5 tok/s reader reads ~10 of 30 tokens by then, so holding its stream would only shrink the
    batch; with the gate off (share 0) the same stream is ahead of its schedule and is held."""
    engine, ahead, behind = _two_streams()
    now = engine.clock.now()
    left = (30 - ahead.num_output_tokens) + (200 - behind.num_output_tokens)
    for share, held in ((0.0, True), (0.5, False)):
        pacer = Pacer(pace_buffer=0.3, min_read_share=share, slack=0.0)
        pacer.track([ahead, behind], now, capacity=left / 20.0, step_s=0.05, active=True)
        assert ahead.rate * (pacer.deadline - ahead.first_token_time) < 0.5 * 30
        assert (ahead.stream_id in ids(pacer.candidates([ahead], now))) is held


def test_the_deadline_drains_at_capacity_grows_with_new_work_and_ignores_time_spent_paced():
    engine, ahead, behind = _two_streams()
    now = engine.clock.now()
    pacer = Pacer(pace_buffer=0.3, min_read_share=0.5, slack=0.05)
    pacer.track([ahead], now, capacity=10.0, step_s=0.05, active=True)
    d1 = pacer.deadline
    assert d1 == pytest.approx(now + (30 - ahead.num_output_tokens) / 10.0)
    pacer.track([ahead], now + 1.0, capacity=10.0, step_s=0.05, active=True)  # held a whole second: D stays
    assert pacer.deadline == pytest.approx(d1)
    pacer.track([ahead, behind], now + 1.0, capacity=10.0, step_s=0.05, active=True)  # new work moves D out
    assert pacer.deadline == pytest.approx(d1 + (200 - behind.num_output_tokens) / 10.0)
    d2 = pacer.deadline
    pacer.track([ahead, behind], now + 1.0, capacity=5.0, step_s=0.05, active=True)  # a lower Γ moves it out
    assert pacer.deadline > d2


def test_policy_holds_only_with_pace_on():
    engine, ahead, behind = _two_streams()
    policy = engine.scheduler.policy
    view = engine.scheduler.view(engine.clock.now())
    policy.pacer = Pacer(pace_buffer=0.3, min_read_share=0.5, slack=0.05)  # D set by hand: far away
    policy.pacer.track([ahead, behind], view.now, capacity=1.0, step_s=0.05, active=True)
    assert policy.hold([ahead, behind], view) == {ahead.stream_id}
    policy.config = TokenFlowConfig(pace=False)
    assert policy.hold([ahead, behind], view) == set()


def test_a_held_stream_is_always_one_the_rebalance_may_pause():
    """40 streams into 16 slots, readers slower than the engine: streams far ahead of their readers are held only
    while their buffer covers a switch, so a waiting stream can take their place (before, all 16 sat held and idle
    for ~50 steps), and the burst ends no later than under fcfs (tests/engine/test_capacity.py bounds the steps)."""
    engine, _ = make_fake_engine(num_blocks=512, block_size=8, max_num_seqs=16, max_num_batched_tokens=256,
                                 policy="tokenflow", num_host_blocks=2048,  # pacing as it was: held while others wait
                                 tokenflow=TokenFlowConfig(pace=True, pace_while_waiting=True, patience_s=0.0))
    for i in range(40):
        engine.add_request([i % 200 + 1] * 16, SamplingParams(max_tokens=64, ignore_eos=True), rate=20.0)
    policy, held_any, idle_with_waiting = engine.scheduler.policy, 0, 0
    while engine.has_unfinished():
        view = engine.scheduler.view(engine.clock.now())
        running = engine.scheduler.by_status(StreamStatus.RUNNING)
        held = policy.hold(running, view)
        assert all(policy.may_preempt(s, view) for s in running if s.stream_id in held)
        held_any += bool(held)
        engine.step()
        engine.check_integrity()
        idle_with_waiting += engine.idle and bool(engine.scheduler.by_status(StreamStatus.WAITING))
        engine.clock.advance(engine.runner.step_cost_s)
    assert held_any > 0
    assert idle_with_waiting <= 2


def test_pacing_serves_a_fast_reader_at_its_reading_pace_beside_a_long_stream():
    """Two slots of a 10 ms step (Γ 200 tok/s), Σ rates within it: D comes when both streams' 600 tokens would be
    done at Γ (3 s). The 200-token stream generates at 100 tok/s for a 40 tok/s reader: once its reader holds 30%
    of it and it is ahead of its schedule to D, it is held, and both finish with every
    block returned."""
    engine, _ = make_fake_engine(num_blocks=256, block_size=4, num_host_blocks=64, max_num_seqs=2, policy="tokenflow",
                                 tokenflow=TokenFlowConfig(pace=True, pace_while_waiting=True))
    fast = engine.add_request([1] * 4, SamplingParams(max_tokens=200, ignore_eos=True), rate=40.0)
    engine.add_request([2] * 4, SamplingParams(max_tokens=400, ignore_eos=True), rate=2.0)
    held_steps = 0
    policy = engine.scheduler.policy
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        s = engine.scheduler.streams.get(fast)
        if s is not None:
            view = engine.scheduler.view(engine.clock.now())
            if fast in policy.hold([s], view):
                held_steps += 1
                assert s.reader.buffer_at(view.now) >= 0.3 * 200
        engine.step()
        engine.check_integrity()
        engine.clock.advance(engine.runner.step_cost_s)
    assert not engine.has_unfinished() and held_steps > 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_pacing_fields_are_validated():
    for name in ("pace_buffer", "pace_min_read_share", "pace_slack"):
        with pytest.raises(ValueError, match=name):
            TokenFlowConfig(**{name: 1.5})
