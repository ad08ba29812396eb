"""ReportTrigger: a paced client reports only what the server's model of its reader does not already hold."""

import pytest

from tokenflow_ray.client.report_trigger import ReportTrigger
from tokenflow_ray.metrics.reader import ReaderModel


def _feed(trigger: ReportTrigger, reader: ReaderModel, t: float, n: int) -> None:
    reader.on_tokens(t, n)
    trigger.on_tokens(t, n)


def test_a_reader_that_keeps_its_declared_rate_never_reports():
    trigger, reader = ReportTrigger(10.0, 0.5), ReaderModel(10.0)
    for step in range(200):  # tokens in chunks of 5 every 0.4 s: faster than read, then a gap, then more
        t = step * 0.1
        if step % 4 == 0 and step < 120:
            _feed(trigger, reader, t, 5)
        assert not trigger.due(t, reader.consumed_at(t)), t


def test_a_slower_reader_reports_at_the_drift_then_again_only_after_more_drift():
    trigger, reader = ReportTrigger(10.0, 0.5), ReaderModel(5.0)  # declared 10 tok/s, reads at 5
    _feed(trigger, reader, 0.0, 100)
    times = []
    for step in range(1, 60):
        t = step * 0.1
        consumed = reader.consumed_at(t)
        if trigger.due(t, consumed):
            times.append(round(t, 1))
            # the server's model after the report holds exactly what the reader read
            trigger.reported(t, consumed)
            assert trigger.mirror.consumed_at(t) == consumed
    # The mirror runs 5 tok/s ahead: 5 tokens (0.5 s at the declared rate) take about 1 s to drift apart each time
    # (reads are whole tokens, the first at t = 0).
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(times) == 5 and 0.8 <= times[0] <= 1.0 and all(0.9 <= g <= 1.1 for g in gaps), times


def test_a_paused_reader_reports_once_it_is_half_a_second_behind():
    trigger, reader = ReportTrigger(20.0, 0.5), ReaderModel(20.0)
    _feed(trigger, reader, 0.0, 50)
    reader.apply_report(0.5, paused=True)  # the user stopped reading; the server cannot know
    due = [t / 10 for t in range(5, 20) if trigger.due(t / 10, reader.consumed_at(t / 10))]
    assert due and due[0] == 1.0  # 10 tokens (0.5 s at 20 tok/s) behind the model


def test_every_check_reports_without_a_drift_and_nothing_before_the_first_token():
    trigger = ReportTrigger(10.0, None)
    assert not trigger.due(0.5, 0)
    trigger.on_tokens(1.0, 3)
    assert trigger.due(1.0, 0) and trigger.due(1.5, 3)


def test_an_unpaced_reader_never_drifts():
    trigger, reader = ReportTrigger(0.0, 0.5), ReaderModel(0.0)
    for i in range(10):
        _feed(trigger, reader, float(i), 7)
        assert not trigger.due(i + 0.5, reader.consumed_at(i + 0.5))


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_bad_drift_is_refused(bad):
    with pytest.raises(ValueError, match="report drift"):
        ReportTrigger(10.0, bad)
