"""Delta grouping: the first token at once, then intervals that follow the reader's buffer and the replica's load."""

import pytest

from tokenflow_ray.serve.config import ServeConfig
from tokenflow_ray.serve.grouping import DeltaGrouper, GroupingConfig

CFG = GroupingConfig(min_interval_s=0.05, max_interval_s=0.25, events_per_s=200)


def test_first_token_and_the_last_go_at_once():
    g = DeltaGrouper(CFG, rate=20.0)
    assert g.due(0.0, finished=False, active_streams=64)
    g.sent_now(0.0, 1)
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


def test_paced_streams_share_the_replica_budget_too():
    # 64 streams: 0.32 s by the budget, capped at 0.25 s, even with little buffer
    assert CFG.interval(20.0, sent=2, since_first_s=0.05, active_streams=64) == 0.25
    assert CFG.interval(20.0, sent=6, since_first_s=0.1, active_streams=20) == pytest.approx(0.1)


def test_unpaced_streams_share_the_replica_budget():
    assert CFG.interval(0.0, sent=10, since_first_s=1.0, active_streams=2) == 0.05
    assert CFG.interval(None, sent=10, since_first_s=1.0, active_streams=32) == pytest.approx(0.16)
    assert CFG.interval(0.0, sent=10, since_first_s=1.0, active_streams=500) == 0.25


def test_grouper_holds_until_the_interval_passes():
    g = DeltaGrouper(CFG, rate=None)
    g.sent_now(0.0, 1)
    assert not g.due(0.10, finished=False, active_streams=32)  # 32 unpaced streams: 0.16 s
    assert g.due(0.17, finished=False, active_streams=32)


@pytest.mark.parametrize("fields", [dict(stream_interval_s=0.3, stream_max_interval_s=0.2),
                                    dict(stream_events_per_s=0), dict(stream_max_interval_s=2.0)])
def test_bad_grouping_config_is_rejected(fields):
    with pytest.raises(ValueError, match="stream"):
        ServeConfig(images=False, **fields)
