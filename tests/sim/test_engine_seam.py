"""The engine's seams for the simulator: a step in two halves, future arrivals held, the next event time."""

from __future__ import annotations

import pytest

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.sampling import SamplingParams


def _params(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_step_is_begin_execute_finish():
    a, _ = make_fake_engine(policy="tokenflow", num_host_blocks=64)
    b, _ = make_fake_engine(policy="tokenflow", num_host_blocks=64)
    for e in (a, b):
        for i in range(6):
            e.add_request(list(range(1, 10 + 3 * i)), _params(12), stream_id=f"s{i}", rate=20.0)
    out_a, out_b = [], []
    for _ in range(40):
        out_a += [(o.stream_id, o.token_ids, o.finished) for o in a.step()]
        begun = b.begin_step()
        if begun.plan is not None:
            out_b += [(o.stream_id, o.token_ids, o.finished) for o in b.finish_step(begun,
                                                                                    b.runner.execute(begun.plan))]
        else:
            out_b += [(o.stream_id, o.token_ids, o.finished) for o in begun.outputs]
        for e in (a, b):
            e.check_integrity()
            e.clock.advance(0.01)
    assert out_a == out_b and out_a
    assert [r.token_times for r in a.finished_records] == [r.token_times for r in b.finished_records]


def test_future_arrival_is_held_until_the_clock_reaches_it():
    engine, _ = make_fake_engine()
    assert engine.next_event_time() is None
    sid = engine.add_request([1, 2, 3], _params(), arrival_time=5.0)
    assert engine.has_unfinished() and sid not in engine.scheduler.streams
    assert engine.get_stream(sid).arrival_time == 5.0
    assert engine.next_event_time() == 5.0
    assert engine.step() == [] and engine.idle  # nothing due yet
    engine.clock.advance(5.0)
    out = engine.step()
    assert sid in engine.scheduler.streams or any(o.stream_id == sid for o in out)
    engine.clock.advance(0.01)
    while engine.has_unfinished():
        engine.step()
        engine.clock.advance(0.01)
    (record,) = engine.finished_records
    assert record.arrival_s == 5.0 and record.token_times[0] >= 5.0


def test_next_event_time_is_now_while_work_is_runnable():
    engine, _ = make_fake_engine()
    engine.add_request([1, 2, 3], _params())
    engine.add_request([1, 2, 3], _params(), arrival_time=2.0)
    assert engine.next_event_time() == engine.clock.now()


def test_future_arrival_is_validated_at_add_and_can_be_aborted():
    engine, _ = make_fake_engine(max_num_seqs=4, max_num_batched_tokens=8, chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        engine.add_request(list(range(1, 20)), _params(), arrival_time=1.0)
    engine.add_request([1, 2], _params(), stream_id="x", arrival_time=1.0)
    with pytest.raises(ValueError, match="already live"):
        engine.add_request([1, 2], _params(), stream_id="x", arrival_time=2.0)
    assert engine.abort("x")
    assert engine.next_arrival_time() is None
    (out,) = engine.step()
    assert out.stream_id == "x" and out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished()
