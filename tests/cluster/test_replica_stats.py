"""ReplicaStats built from a real engine over the fake runner: every field from the engine's own accounting."""

from __future__ import annotations

import pytest

from tests.engine.factories import make_fake_engine, step_engine
from tokenflow_ray.cluster.replica_stats import ReplicaStats, replica_stats_from_engine
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus


def test_stats_of_an_idle_engine():
    engine, _ = make_fake_engine(num_blocks=64, block_size=8, num_host_blocks=32)
    rs = replica_stats_from_engine(engine, wall_time=5.0)
    assert (rs.computed_at, rs.block_size, rs.device_blocks_total, rs.device_blocks_free) == (5.0, 8, 64, 64)
    assert (rs.host_blocks_total, rs.host_blocks_free) == (32, 32)
    assert (rs.num_live, rs.admitted_total, rs.sum_rate, rs.queued_prefill_s) == (0, 0, 0.0, 0.0)
    assert rs.min_buffer_s is None  # no paced reader: no slack to protect, not zero slack
    assert rs.capacity_tok_s > 0


def test_stats_follow_running_waiting_and_finished_streams():
    # A batch of 2: of 4 streams two run and two wait; one runs unpaced.
    engine, runner = make_fake_engine(num_blocks=64, block_size=8, max_num_seqs=2, max_num_batched_tokens=64,
                                      num_host_blocks=32, policy="fcfs")
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request([1] * 12, sp, rate=10.0)
    engine.add_request([2] * 12, sp, rate=0.0)
    engine.add_request([3] * 20, sp, rate=4.0)
    engine.add_request([4] * 9, sp, rate=6.0)
    step_engine(engine, 5)
    rs = replica_stats_from_engine(engine)
    es = engine.stats()
    live = list(engine.scheduler.streams.values())
    running = [s for s in live if s.status == StreamStatus.RUNNING]
    waiting = [s for s in live if s.status == StreamStatus.WAITING]
    assert (rs.num_running, rs.num_waiting, rs.num_paused, rs.num_live) == (2, 2, 0, 4)
    assert rs.device_blocks_free == engine.pool.num_free == es.device_blocks_free
    assert rs.device_blocks_free == 64 - sum(len(s.block_ids) for s in running)
    # Working set: the running streams; the waiting ones (never run) are demand about to join.
    assert rs.sum_rate == pytest.approx(sum(s.rate for s in running))
    assert rs.waiting_rate == pytest.approx(sum(s.rate for s in waiting))
    assert rs.sum_rate + rs.waiting_rate == pytest.approx(20.0) == es.sum_rate
    assert rs.waiting_prompt_blocks == sum(-(-s.num_prompt_tokens // 8) for s in waiting)
    cost = engine.scheduler.cost
    assert rs.queued_prefill_s == pytest.approx(sum(cost.t_recompute(s.num_prompt_tokens) for s in waiting))
    assert rs.prefill_s(20) == pytest.approx(cost.t_recompute(20))
    assert rs.decode_step_s == pytest.approx(cost.fit.predict(2))  # a step at the running batch of 2
    view = engine.scheduler.view(engine.clock.now())
    assert rs.capacity_tok_s == pytest.approx(cost.decode_capacity_tok_s(view.max_device_batch))
    paced = [s for s in running if s.rate > 0 and s.first_token_time is not None]
    assert paced, "the test needs a running paced stream"
    assert rs.min_buffer_s == pytest.approx(min(s.buffer_s(engine.clock.now()) for s in paced))
    assert rs.min_buffer_s > 0
    assert rs.admitted_total == 4
    # The same numbers as the engine's stats, which /metrics exports alongside.
    assert (rs.num_running, rs.num_waiting) == (es.num_running, es.num_waiting)
    # Until everything finished: admitted_total stays, the live counts drain.
    while engine.has_unfinished():
        step_engine(engine, 10)
    done = replica_stats_from_engine(engine)
    assert (done.num_live, done.admitted_total, done.device_blocks_free, done.min_buffer_s) == (0, 4, 64, None)
    assert (rs.finished_total, done.finished_total) == (0, 4)
    assert ReplicaStats.from_dict(done.to_dict()) == done


def test_gauges_are_the_numeric_fields():
    engine, _ = make_fake_engine()
    rs = replica_stats_from_engine(engine)
    g = rs.gauges()
    assert "computed_at" not in g and "min_buffer_s" not in g
    assert g["device_blocks_free"] == rs.device_blocks_free and g["capacity_tok_s"] == rs.capacity_tok_s


def test_a_stream_mid_prefill_has_no_buffer_slack_to_protect_yet():
    # A 40-token prompt in chunks of 16: running (it holds blocks) for three steps before its first token.
    engine, _ = make_fake_engine(num_blocks=64, block_size=8, max_num_batched_tokens=16)
    engine.add_request([5] * 40, SamplingParams(max_tokens=8, ignore_eos=True), rate=10.0)
    step_engine(engine, 1)
    (stream,) = engine.scheduler.streams.values()
    assert stream.status == StreamStatus.RUNNING and stream.first_token_time is None
    assert engine.stats().min_buffer_s == 0.0  # the engine's own figure counts it, at zero
    assert replica_stats_from_engine(engine).min_buffer_s is None
    step_engine(engine, 3)
    assert stream.first_token_time is not None
    assert replica_stats_from_engine(engine).min_buffer_s == pytest.approx(stream.buffer_s(engine.clock.now()))
