"""Delta grouping: the first token at once, then intervals that follow the reader's buffer and the replica's load."""

import pytest

from tokenflow_ray.serve.config import ServeConfig
from tokenflow_ray.serve.replica.grouping import DeltaGrouper, GroupingConfig

CFG = GroupingConfig(min_interval_s=0.05, max_interval_s=0.25, events_per_s=200)


def test_first_token_and_the_last_go_at_once():
    g = DeltaGrouper(CFG, rate=20.0)
    assert g.due(0.0, finished=False, active_streams=64)
    g.hold(1)
    g.sent_now(0.0)
    assert not g.due(0.01, finished=False, active_streams=64)
    assert g.due(0.01, finished=True, active_streams=64)


def test_paced_reader_interval_is_half_its_buffer_time_within_bounds():
    # 20 tok/s reader, 1 token sent: 0.05 s of buffer -> the minimum interval
    assert CFG.interval(20.0, sent=1, since_first_s=0.0, active_streams=1) == 0.05
    # 4 tokens ahead (0.2 s) -> 0.1 s
    assert CFG.interval(20.0, sent=6, since_first_s=0.1, active_streams=1) == pytest.approx(0.1)
    # far ahead -> capped; behind (the reader has caught up) -> the minimum
    assert CFG.interval(20.0, sent=200, since_first_s=1.0, active_streams=1) == 0.25
    assert CFG.interval(20.0, sent=10, since_first_s=5.0, active_streams=1) == 0.05


def test_while_tokens_outpace_the_reader_the_budget_stretches_only_what_the_buffer_covers():
    # 64 streams: the budget asks 0.32 s. Right after the first tokens (0.05 s of buffer) the reader would run dry
    # long before that: the minimum interval, not the budget's (that wait was most of the served demo's stall).
    assert CFG.interval(20.0, sent=2, since_first_s=0.05, active_streams=64, outpacing=True) == 0.05
    # 0.3 s of buffer: the budget's wait, but min_interval_s before the reader runs dry (0.25 s)
    assert CFG.interval(20.0, sent=7, since_first_s=0.05, active_streams=64, outpacing=True) == pytest.approx(0.25)
    # 0.2 s of buffer: half of it is 0.1 s; the budget may take it to 0.15 s
    assert CFG.interval(20.0, sent=6, since_first_s=0.1, active_streams=64, outpacing=True) == pytest.approx(0.15)
    # a small budget share and a short buffer: half the buffer
    assert CFG.interval(20.0, sent=6, since_first_s=0.1, active_streams=20, outpacing=True) == pytest.approx(0.1)


def test_a_stream_made_slower_than_it_is_read_keeps_the_budget():
    # Its reader waits for tokens whatever the grouping: items beyond the budget would only take CPU from the engine.
    assert CFG.interval(20.0, sent=2, since_first_s=0.05, active_streams=64) == 0.25  # 0.32 s, capped
    assert CFG.interval(20.0, sent=6, since_first_s=0.1, active_streams=20) == pytest.approx(0.1)


@pytest.mark.parametrize("sent", range(1, 40))
@pytest.mark.parametrize("active", (1, 8, 64, 500))
def test_a_group_of_an_outpacing_stream_lands_before_the_reader_runs_dry(sent, active):
    # Whatever the load, a paced reader holding at least 2 x min_interval_s is never made to wait past its buffer
    # less min_interval_s (delivery), and one holding less waits min_interval_s at most.
    since = 0.3
    buffer_s = max(0.0, sent / 20.0 - since)
    wait = CFG.interval(20.0, sent=sent, since_first_s=since, active_streams=active, outpacing=True)
    assert wait <= max(CFG.min_interval_s, buffer_s - CFG.min_interval_s) + 1e-12


def test_unpaced_streams_share_the_replica_budget():
    assert CFG.interval(0.0, sent=10, since_first_s=1.0, active_streams=2) == 0.05
    assert CFG.interval(None, sent=10, since_first_s=1.0, active_streams=32) == pytest.approx(0.16)
    assert CFG.interval(0.0, sent=10, since_first_s=1.0, active_streams=500) == 0.25


def test_grouper_holds_until_the_interval_passes():
    g = DeltaGrouper(CFG, rate=None)
    g.hold(1)
    g.sent_now(0.0)
    assert not g.due(0.10, finished=False, active_streams=32)  # 32 unpaced streams: 0.16 s
    assert g.due(0.17, finished=False, active_streams=32)


def test_held_tokens_are_flushed_when_due_without_a_next_output():
    g = DeltaGrouper(CFG, rate=20.0)
    assert not g.flush_due(0.0, active_streams=64)  # nothing held: wait for the first token
    g.hold(1)
    assert g.flush_due(0.0, active_streams=64)  # the first token goes at once
    g.sent_now(0.0)
    assert g.held == 0 and g.sent == 1 and not g.flush_due(0.01, active_streams=64)
    g.hold(9)  # 10 tokens sent by 0.05 s: 0.45 s of buffer, the interval is the 0.25 s cap
    g.sent_now(0.05)
    g.hold(2)  # 2 tokens in 0.19 s are slower than the reader's 20 tok/s: the budget's interval, to the cap
    assert not g.flush_due(0.24, active_streams=64)
    assert not g.due(0.29, finished=False, active_streams=64) and g.due(0.30, finished=False, active_streams=64)
    g.hold(4)  # 6 tokens in 0.19 s outpace the reader: the group must land while it still holds 0.05 s
    # The reader reads meanwhile: at 0.24 s it holds 0.26 s and the interval is 0.21 s, shrinking as it reads; the
    # group is due at 0.25 s, not at the cap's 0.30 s
    assert not g.flush_due(0.24, active_streams=64) and not g.due(0.24, finished=False, active_streams=64)
    assert g.flush_due(0.251, active_streams=64) and g.due(0.27, finished=False, active_streams=64)


@pytest.mark.parametrize("fields", [dict(stream_interval_s=0.3, stream_max_interval_s=0.2),
                                    dict(stream_events_per_s=0), dict(stream_max_interval_s=2.0)])
def test_bad_grouping_config_is_rejected(fields):
    with pytest.raises(ValueError, match="stream"):
        ServeConfig(images=False, **fields)
