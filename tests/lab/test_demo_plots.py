"""Demo plots from client records, without a server."""

from pathlib import Path

from tests.client_results import fake_load_result


def test_demo_plots_are_written(tmp_path):
    """The demo's plots (shared TTFT CDF, per-policy buffers) from the same kind of client records."""
    from tokenflow_ray.lab.demo_plots import write_plots

    runs = {"tokenflow": fake_load_result(0.1, streams=3, tokens=4, finished=True),
            "fcfs": fake_load_result(0.6, streams=3, tokens=4, finished=True)}
    paths = write_plots(runs, tmp_path / "demo")
    assert {Path(p).name for p in paths} >= {"ttft_cdf.png"}
    assert all(Path(p).stat().st_size > 1000 for p in paths)


def _record(rate: float, arrivals: list[tuple[float, int]]):
    """A stream record as the pacing client builds it: each token's buffer from a live reader at that rate."""
    from tokenflow_ray.metrics.reader import ReaderModel
    from tokenflow_ray.metrics.stream_metrics import StreamRecord

    rec, reader = StreamRecord("cmpl-x", 0.0, rate, 4), ReaderModel(rate)
    for t, n in arrivals:
        for _ in range(n):
            rec.record_token(t, reader.buffer_at(t))
            reader.on_tokens(t)
    return rec


def _at(trace, t: float) -> float:
    """The trace's value at t (steps-post: the last sample at or before t)."""
    value = None
    for ts, b in zip(trace.times, trace.buffers):
        if ts <= t:
            value = b
    return value


def test_buffer_trace_drains_at_the_rate_between_arrivals_and_shows_the_stall():
    from tokenflow_ray.lab.demo_plots import buffer_trace

    # 3 tokens at 0 s, read at 10 tok/s (the first at once, then at 0.1 and 0.2); nothing until 4 tokens at 1.0 s,
    # a stall in between. A waiting reader reads an arriving token at once, so 4 arrive and 3 stay buffered.
    trace = buffer_trace(_record(10.0, [(0.0, 3), (1.0, 4)]))
    assert trace.times == sorted(trace.times)
    assert max(trace.buffers) == 3 and min(trace.buffers) == 0
    assert [_at(trace, t) for t in (0.05, 0.15, 0.25, 0.9)] == [2, 1, 0, 0]  # falls one token per 1/rate
    assert [_at(trace, t) for t in (1.05, 1.15, 1.25, 1.35)] == [3, 2, 1, 0]
    i = trace.times.index(1.0)  # up at the arrival: the sample before it is empty, the one after is not
    assert (trace.buffers[i], trace.buffers[i + 1]) == (0, 3)
    assert len(trace.stalls) == 1
    start, end = trace.stalls[0]
    assert 0.2 <= start <= 0.26 and end == 1.0
    assert trace.buffers[-1] == 0 and trace.times[-1] >= 1.3  # the last token is read too


def test_buffer_trace_agrees_with_the_buffers_the_client_recorded():
    from tokenflow_ray.lab.demo_plots import buffer_trace

    arrivals = [(0.0, 1), (0.05, 2), (0.3, 4), (0.31, 1), (1.2, 3)]
    rec = _record(16.0, arrivals)
    trace = buffer_trace(rec)
    firsts = [rec.token_times.index(t) for t, _ in arrivals]
    before = [trace.buffers[trace.times.index(t)] for t, _ in arrivals]  # the sample just before each arrival
    assert before == [rec.token_buffers[j] for j in firsts]
    assert trace.stalls and all(b > a for a, b in trace.stalls)


def test_an_unpaced_reader_has_an_empty_buffer():
    from tokenflow_ray.lab.demo_plots import buffer_trace

    trace = buffer_trace(_record(0.0, [(0.0, 2), (0.5, 1)]))
    assert set(trace.buffers) == {0.0} and trace.stalls == []
