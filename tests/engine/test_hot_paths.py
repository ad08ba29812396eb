"""The per-token fast paths the engine takes every step give what the general calls give, and still refuse bad
input: ReaderModel.buffer_then_token against buffer_at + on_tokens, StreamRecord.record_token's fast path, a
reader's settled buffer read off, the scheduler's kept working-set sums."""

from __future__ import annotations

import math
import random

import pytest

from tokenflow_ray.metrics.reader import ReaderModel
from tokenflow_ray.metrics.stream_metrics import StreamRecord


def _state(r: ReaderModel, t: float) -> tuple:
    return (r.generated, r.consumed_at(t), r.buffer_at(t), r.stall_time_at(t), r.first_token_time)


@pytest.mark.parametrize("seed", range(6))
def test_buffer_then_token_equals_buffer_at_then_on_tokens(seed):
    rng = random.Random(seed)
    rate = rng.choice([0.0, 5.0, 20.0, 100.0])
    fast, slow = ReaderModel(rate), ReaderModel(rate)
    t = rng.uniform(-5, 5)
    for _ in range(300):
        t += rng.choice([0.0, rng.expovariate(30.0), rng.expovariate(3.0)])
        if rng.random() < 0.05:  # a client report changes the model on both
            kw = rng.choice([{"rate": rng.choice([0.0, 10.0, 50.0])}, {"paused": rng.random() < 0.5},
                             {"consumed_tokens": rng.randint(0, fast.generated)}])
            fast.apply_report(t, **kw)
            slow.apply_report(t, **kw)
        want = slow.buffer_at(t)
        slow.on_tokens(t)
        assert fast.buffer_then_token(t) == want
        assert _state(fast, t) == _state(slow, t)
    fast.finish(t)
    with pytest.raises(ValueError, match="after finish"):
        fast.buffer_then_token(t)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, True, "1.0"])
def test_reader_fast_path_still_checks_times(bad):
    r = ReaderModel(10.0)
    r.buffer_then_token(1.0)
    with pytest.raises(ValueError):
        r.buffer_then_token(bad)
    with pytest.raises(ValueError, match="earlier"):
        r.buffer_then_token(0.5)


def test_record_token_fast_path_matches_and_refuses():
    rec = StreamRecord("s", arrival_s=1.0, rate=5.0, prompt_len=3)
    rec.record_token(1.5, 0)
    rec.record_token(2, 1.5)  # an int time and a float buffer: the checked path, same result
    assert rec.token_times == [1.5, 2.0] and rec.token_buffers == [0.0, 1.5]
    for t, buffer in [(1.9, 0), (math.inf, 0), (math.nan, 0), (3.0, -1), (3.0, True), (3.0, math.nan)]:
        with pytest.raises(ValueError):
            rec.record_token(t, buffer)
    assert rec.token_times == [1.5, 2.0]
    rec.mark_finished()
    with pytest.raises(ValueError, match="after finish"):
        rec.record_token(3.0, 0)


@pytest.mark.parametrize("seed", range(8))
def test_a_buffer_asked_again_at_one_time_is_read_off_exactly(seed):
    """A reader remembers the time it is settled at (nothing left to read there) and answers later asks at that
    time without advancing: against a twin made to advance on every ask, answers and state stay equal through
    tokens, reports, pauses and shifts."""
    rng = random.Random(seed)
    rate = rng.choice([0.0, 5.0, 20.0, 37.0])
    fast, slow = ReaderModel(rate), ReaderModel(rate)

    def ask(t):
        answers = []
        for _ in range(rng.randint(1, 3)):
            slow._settled = None  # the twin forgets: it advances on every ask, as before the memo
            want = (slow.buffer_at(t), slow.buffer_seconds_at(t))
            answers.append((fast.buffer_at(t), fast.buffer_seconds_at(t)) == want)
        return all(answers)

    t = rng.uniform(0, 2)
    for _ in range(300):
        t += rng.choice([0.0, 0.0, rng.expovariate(40.0), 0.05])
        op = rng.random()
        if op < 0.5:
            slow._settled = None
            assert fast.buffer_then_token(t) == slow.buffer_then_token(t)
        elif op < 0.6:
            kw = rng.choice([{"rate": rng.choice([0.0, 10.0, 50.0])}, {"paused": rng.random() < 0.5},
                             {"consumed_tokens": rng.randint(0, fast.generated)}])
            fast.apply_report(t, **kw)
            slow.apply_report(t, **kw)
        elif op < 0.63:
            fast.shifted(0.5)
            slow.shifted(0.5)
            t += 0.5
        assert ask(t)
        assert _state(fast, t) == _state(slow, t)


def test_view_rate_sums_follow_admissions_and_rate_reports():
    """The view's working-set sums are kept between steps: a client's rate report and a new admission show in
    the next view, equal to a recount (check_integrity compares the two after every step of the engine tests)."""
    from tests.engine.factories import make_fake_engine, step_engine
    from tokenflow_ray.engine.sampling import SamplingParams
    from tokenflow_ray.engine.stream import StreamStatus

    engine, _ = make_fake_engine(num_blocks=64, max_num_seqs=2, policy="tokenflow")
    for i in range(3):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=30), stream_id=f"s{i}", rate=10.0)
    sched = engine.scheduler
    assert sched.view(0.0).num_working == 0 and sched.view(0.0).sum_rate == 0.0
    step_engine(engine, 2)
    view = sched.view(engine.clock.now())
    assert view.num_working == 2 and view.sum_rate == 20.0 and view.mean_rate == 10.0
    working = next(s for s in sched.streams.values() if s.status == StreamStatus.RUNNING)
    engine.report_consumption(working.stream_id, rate=25.0)
    view = sched.view(engine.clock.now())
    assert view.sum_rate == 35.0 and view.mean_rate == 15.0
    assert sched._working_sums == sched._count_working()
