from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenflow_ray.metrics import ReaderModel

TOL = 1e-6


def reference(gen_times: list[float], rate: float) -> tuple[list[float], list[float]]:
    """The recurrence of docs/design.md §6.1: consumption times c_j and the stall added by each token."""
    period = 1.0 / rate
    consume, stalls = [gen_times[0]], [0.0]
    for g in gen_times[1:]:
        ready = consume[-1] + period
        consume.append(max(ready, g))
        stalls.append(max(0.0, g - ready))
    return consume, stalls


def ref_state(gen_times, consume, stalls, rate, t):
    """Reference consumed count bounds and stall at t (tokens with g <= t are generated)."""
    k = sum(g <= t for g in gen_times)
    lo = sum(c <= t - TOL for c in consume[:k])
    hi = sum(c <= t + TOL for c in consume[:k])
    stall = sum(stalls[:k])
    if k and consume[k - 1] + 1.0 / rate < t:
        stall += t - (consume[k - 1] + 1.0 / rate)
    return k, lo, hi, stall


gaps = st.lists(st.floats(0.0, 2.0, allow_nan=False), min_size=1, max_size=40)
rates = st.floats(0.25, 50.0, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(gaps=gaps, rate=rates, query_gaps=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=30))
def test_matches_recurrence(gaps, rate, query_gaps):
    gen_times = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    queries = [sum(query_gaps[: i + 1]) for i in range(len(query_gaps))]
    consume, stalls = reference(gen_times, rate)
    reader = ReaderModel(rate)
    # Merge events by time; tokens first on ties so generated(t) counts g <= t.
    events = sorted([(g, 0) for g in gen_times] + [(q, 1) for q in queries])
    for t, kind in events:
        if kind == 0:
            reader.on_tokens(t)
            continue
        k, lo, hi, stall = ref_state(gen_times, consume, stalls, rate, t)
        consumed = reader.consumed_at(t)
        assert reader.generated == k
        assert lo <= consumed <= hi
        assert reader.buffer_at(t) == k - consumed >= 0
        assert reader.stall_time_at(t) == pytest.approx(stall, abs=1e-6)
        assert reader.buffer_seconds_at(t) == pytest.approx((k - consumed) / rate)
    end = max(gen_times[-1], queries[-1])
    reader.finish(end)
    drained = end + len(gen_times) / rate + 1.0  # late enough to read every token (40 at 0.25 tok/s take 160 s)
    assert reader.stall_time_at(drained) == pytest.approx(sum(stalls), abs=1e-6)
    assert reader.buffer_at(drained) == 0  # after finish the reader still drains the buffer


def test_batched_tokens_equal_single_tokens():
    batched, single = ReaderModel(4.0), ReaderModel(4.0)
    batched.on_tokens(1.0, n=5)
    for _ in range(5):
        single.on_tokens(1.0)
    for t in (1.0, 1.2, 1.25, 1.9, 2.0, 3.0):
        assert batched.consumed_at(t) == single.consumed_at(t)
    assert [ReaderModel(4.0).first_token_time, batched.first_token_time] == [None, 1.0]


def test_hand_example_stall_and_ongoing_wait():
    reader = ReaderModel(2.0)  # one read every 0.5 s
    reader.on_tokens(0.0)
    reader.on_tokens(0.1)
    assert reader.consumed_at(0.5) == 2
    assert reader.stall_time_at(1.5) == pytest.approx(0.5)  # ready at 1.0, waiting since
    reader.on_tokens(2.0)
    assert reader.stall_time_at(2.0) == pytest.approx(1.0)
    reader.finish(4.0)
    assert reader.stall_time_at(9.0) == pytest.approx(1.0)  # waiting after finish is not a stall


def test_no_stall_before_first_token():
    reader = ReaderModel(10.0)
    assert reader.stall_time_at(5.0) == 0.0  # waiting for the first token is TTFT, not a stall
    reader.on_tokens(6.0)
    assert reader.stall_time_at(6.05) == 0.0


@settings(max_examples=60, deadline=None)
@given(gaps=gaps, counts=st.lists(st.integers(1, 5), min_size=40, max_size=40))
def test_unpaced_never_stalls(gaps, counts):
    reader = ReaderModel(0)
    t = 0.0
    for gap, n in zip(gaps, counts):
        t += gap
        reader.on_tokens(t, n)
        assert reader.buffer_at(t) == 0
        assert reader.buffer_seconds_at(t) == 0.0
        assert reader.stall_time_at(t) == 0.0
    assert reader.consumed_at(t + 1.0) == reader.generated


def test_report_consumed_overrides_model():
    reader = ReaderModel(1.0)
    reader.on_tokens(0.0, n=10)
    assert reader.consumed_at(2.5) == 3  # reads at 0, 1, 2
    reader.apply_report(2.5, consumed_tokens=1)
    assert reader.consumed_at(2.5) == 1
    assert reader.consumed_at(3.4) == 1
    assert reader.consumed_at(3.5) == 2  # next read 1/rate after the report
    reader.apply_report(4.0, consumed_tokens=10)  # client is ahead of the model
    assert reader.buffer_at(4.0) == 0


def test_report_rate_rescales_the_read_in_progress():
    reader = ReaderModel(1.0)
    reader.on_tokens(0.0, n=10)
    assert reader.consumed_at(2.5) == 3  # next read due at 3.0, half done
    reader.apply_report(2.5, rate=2.0)  # the half left now takes 0.25 s
    assert reader.rate == 2.0
    assert reader.consumed_at(2.74) == 3
    assert reader.consumed_at(2.75) == 4
    assert reader.consumed_at(3.25) == 5


def test_report_rate_zero_and_back():
    reader = ReaderModel(1.0)
    reader.on_tokens(0.0, n=10)
    reader.apply_report(2.5, rate=0)
    assert reader.buffer_at(2.5) == 0
    reader.apply_report(3.0, rate=1.0)
    reader.on_tokens(4.0, n=2)
    assert reader.consumed_at(4.0) == 11
    assert reader.stall_time_at(4.0) == pytest.approx(1.0)  # paced again from 3.0, nothing to read


def test_pause_stops_consumption_and_stall():
    reader = ReaderModel(1.0)
    reader.on_tokens(0.0, n=10)
    reader.apply_report(2.5, paused=True)
    assert reader.paused
    reader.on_tokens(5.0, n=5)
    assert reader.consumed_at(10.0) == 3
    assert reader.buffer_at(10.0) == 12  # only grows while paused
    reader.apply_report(10.0, paused=False)
    assert reader.consumed_at(10.49) == 3
    assert reader.consumed_at(10.5) == 4  # the interrupted read resumes where it stopped


def test_no_stall_accrues_while_paused():
    reader = ReaderModel(1.0)
    reader.on_tokens(0.0)
    reader.apply_report(0.5, paused=True)
    assert reader.stall_time_at(5.0) == 0.0
    reader.apply_report(5.0, paused=False)
    assert reader.stall_time_at(5.5) == 0.0  # ready at 5.5
    assert reader.stall_time_at(7.0) == pytest.approx(1.5)


def test_first_token_while_paused():
    reader = ReaderModel(1.0)
    reader.apply_report(0.0, paused=True)
    reader.on_tokens(1.0, n=3)
    assert reader.buffer_at(4.0) == 3
    reader.apply_report(4.0, paused=False)
    assert reader.consumed_at(4.0) == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, True, "2", None])
def test_bad_rate_rejected(bad):
    with pytest.raises(ValueError, match="rate"):
        ReaderModel(bad)


def _loaded_reader() -> ReaderModel:
    reader = ReaderModel(2.0)
    reader.on_tokens(0.0, n=4)
    reader.consumed_at(1.0)
    return reader


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rate": math.nan}, "rate"),
        ({"rate": math.inf}, "rate"),
        ({"rate": -0.5}, "rate"),
        ({"rate": False}, "rate"),
        ({"consumed_tokens": 5}, "consumed_tokens"),
        ({"consumed_tokens": -1}, "consumed_tokens"),
        ({"consumed_tokens": 1.0}, "consumed_tokens"),
        ({"consumed_tokens": True}, "consumed_tokens"),
        ({"consumed_tokens": 2, "rate": -1.0}, "rate"),  # one bad field: nothing applied
        ({"consumed_tokens": 2, "paused": "yes"}, "paused"),
    ],
)
def test_bad_report_rejected_without_state_change(kwargs, field):
    reader = _loaded_reader()
    before = copy.deepcopy(vars(reader))
    with pytest.raises(ValueError, match=field):
        reader.apply_report(1.0, **kwargs)
    assert vars(reader) == before


def test_time_going_back_or_finished_rejected_without_state_change():
    reader = _loaded_reader()
    before = copy.deepcopy(vars(reader))
    with pytest.raises(ValueError, match="time must not go back"):
        reader.apply_report(0.5, consumed_tokens=1)
    with pytest.raises(ValueError, match="time must not go back"):
        reader.on_tokens(0.5)
    with pytest.raises(ValueError, match="n must be"):
        reader.on_tokens(1.0, n=0)
    assert vars(reader) == before
    reader.finish(1.0)
    with pytest.raises(ValueError, match="finished"):
        reader.apply_report(1.0, consumed_tokens=1)
    with pytest.raises(ValueError, match="finish"):
        reader.on_tokens(1.0)


event = st.one_of(
    st.tuples(st.just("tok"), st.floats(0.0, 1.0), st.integers(1, 4)),
    st.tuples(st.just("query"), st.floats(0.0, 1.0), st.none()),
    st.tuples(st.just("consumed"), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    st.tuples(st.just("rate"), st.floats(0.0, 1.0), st.sampled_from([0.0, 0.5, 3.0, 20.0])),
    st.tuples(st.just("pause"), st.floats(0.0, 1.0), st.booleans()),
)


@settings(max_examples=150, deadline=None)
@given(rate=st.sampled_from([0.0, 1.0, 7.5]), events=st.lists(event, max_size=50))
def test_random_reports_keep_invariants(rate, events):
    reader = ReaderModel(rate)
    t, last_stall = 0.0, 0.0
    for kind, gap, arg in events:
        t += gap
        if kind == "tok":
            reader.on_tokens(t, arg)
        elif kind == "consumed":
            reader.apply_report(t, consumed_tokens=int(arg * reader.generated))
        elif kind == "rate":
            reader.apply_report(t, rate=arg)
        elif kind == "pause":
            reader.apply_report(t, paused=arg)
        buffered = reader.buffer_at(t)
        assert 0 <= buffered <= reader.generated
        assert reader.consumed_at(t) + buffered == reader.generated
        stall = reader.stall_time_at(t)
        assert stall >= last_stall - 1e-9  # stall history never shrinks while the stream runs
        last_stall = stall
