from __future__ import annotations

import json
import math

import pytest

from tokenflow_ray.metrics import (
    BufferSample,
    ReaderModel,
    StreamRecord,
    buffer_timeline,
    effective_tokens,
    effective_weight,
    stream_qoe,
    stream_stall_s,
    summarize,
)


def make_record(stream_id, arrival, rate, tokens, finished=True, **kwargs) -> StreamRecord:
    record = StreamRecord(stream_id, arrival, rate, prompt_len=5, **kwargs)
    for t, buffer in tokens:
        record.record_token(t, buffer)
    if finished:
        record.mark_finished()
    return record


@pytest.mark.parametrize(
    ("buffer", "weight"),
    [(0, 1.0), (5, 1.0), (10, 1.0), (12, 0.8), (15, 0.5), (20, 0.0), (25, 0.0)],
)
def test_effective_weight_boundaries(buffer, weight):
    # L = 100: full weight up to 0.1L = 10, linear to 0 at 0.2L = 20.
    assert effective_weight(buffer, 100) == pytest.approx(weight)


def test_effective_tokens_of_a_record():
    # L = 10: thresholds 1 and 2 tokens of buffer.
    buffers = [1.0, 1.5, 2.0] + [0.0] * 7
    record = make_record("s", 0.0, 5.0, [(i * 0.1, b) for i, b in enumerate(buffers)])
    assert effective_tokens(record) == pytest.approx(1 + 0.5 + 0 + 7)


def test_ttft_tbt_and_timeline():
    record = make_record("s", 0.5, 2.0, [(1.0, 0), (1.25, 0), (2.0, 1)])
    assert record.ttft_s == pytest.approx(0.5)
    assert record.tbt_s == pytest.approx([0.25, 0.75])
    assert record.output_len == 3
    assert buffer_timeline(record) == [
        BufferSample(1.0, 0.0),
        BufferSample(1.25, 0.0),
        BufferSample(2.0, 1.0),
    ]
    assert StreamRecord("empty", 0.0, 1.0, 3).ttft_s is None


def test_stall_replays_declared_rate_unless_engine_recorded_it():
    # rate 2: reads at 1.0, 1.5, 2.0; ready at 2.5 but token 4 comes at 3.0 -> 0.5 s stall.
    record = make_record("s", 0.0, 2.0, [(1.0, 0), (1.5, 0), (2.0, 0), (3.0, 0)])
    assert stream_stall_s(record) == pytest.approx(0.5)
    live = make_record("s", 0.0, 2.0, [(1.0, 0)], finished=False)
    live.mark_finished(stall_s=4.0)
    assert stream_stall_s(live) == 4.0
    assert stream_stall_s(make_record("u", 0.0, 0.0, [(1.0, 0), (9.0, 0)])) == 0.0


def test_qoe_on_time_is_one_and_late_is_less():
    # Expected delivery with target 1 s at rate 2: 1.0, 1.5, 2.0, 2.5.
    on_time = make_record("a", 0.0, 2.0, [(0.2, 0), (0.3, 1), (1.5, 1), (2.5, 0)])
    assert stream_qoe(on_time, ttft_target_s=1.0) == 1.0
    late = make_record("b", 0.0, 2.0, [(1.0, 0), (1.5, 0), (2.0, 0), (3.0, 0)])
    # horizon 3.0: S_whole = 2 + 1.5 + 1 + 0.5 = 5; S_delay = 0.5 (last token 0.5 s late).
    assert stream_qoe(late, ttft_target_s=1.0) == pytest.approx(0.9)
    assert stream_qoe(late, ttft_target_s=1.5) == 1.0  # a looser target forgives the lag
    very_late = make_record("c", 0.0, 2.0, [(10.0, 0), (10.5, 0), (11.0, 0), (11.5, 0)])
    assert 0.0 <= stream_qoe(very_late) < stream_qoe(late)
    assert stream_qoe(make_record("u", 0.0, 0.0, [(1.0, 0)])) is None  # unpaced: no expected pace
    with pytest.raises(ValueError, match="ttft_target_s"):
        stream_qoe(late, ttft_target_s=math.nan)


def test_summarize_hand_computed():
    a = make_record(
        "a", 0.0, 2.0, [(1.0, 0), (1.5, 0), (2.0, 0), (3.0, 0)], preemptions=2, tokens_recomputed=10
    )
    b = make_record("b", 0.5, 1.0, [(2.5, 0), (2.6, 1), (2.7, 2)], finished=False, preemptions=1)
    c = StreamRecord("c", 1.0, 1.0, prompt_len=3)  # never started
    s = summarize([a, b, c], bytes_to_host=4096, bytes_from_host=1024)
    assert (s.num_streams, s.num_started, s.num_finished, s.total_tokens) == (3, 2, 1, 7)
    assert s.makespan_s == pytest.approx(3.0)  # last token 3.0 - first arrival 0.0
    # TTFTs 1.0 and 2.0 (numpy linear percentiles).
    assert (s.ttft_p50_s, s.ttft_p90_s, s.ttft_p99_s, s.ttft_mean_s) == pytest.approx((1.5, 1.9, 1.99, 1.5))
    # TBTs pooled: 0.1, 0.1, 0.5, 0.5, 1.0.
    assert (s.tbt_p50_s, s.tbt_p99_s) == pytest.approx((0.5, 0.98))
    assert s.raw_tput == pytest.approx(7 / 3)
    # a: L=4, all buffers 0 -> 4; b: L=3, thresholds 0.3/0.6 -> weights 1, 0, 0.
    assert s.effective_tput == pytest.approx(5 / 3)
    # a stalls 0.5 s (see above); b is still reading its buffer at 2.7.
    assert (s.stall_s, s.stall_per_stream_mean_s) == pytest.approx((0.5, 0.25))
    # QoE a = 0.9; b: e = 1.5, 2.5, 3.5, horizon 3.5, S_whole = 3, S_delay = 1.0 + 0.1 = 1.1.
    assert s.qoe_mean == pytest.approx((0.9 + (1 - 1.1 / 3)) / 2)
    assert (s.preemptions, s.tokens_recomputed, s.bytes_to_host, s.bytes_from_host) == (3, 10, 4096, 1024)
    assert summarize([a, b, c], makespan_s=7.0).raw_tput == pytest.approx(1.0)


def test_to_dict_is_strict_json_even_without_data():
    empty = summarize([])
    payload = json.loads(json.dumps(empty.to_dict(), allow_nan=False))
    assert payload["num_streams"] == 0 and payload["ttft_p99_s"] is None
    full = summarize([make_record("a", 0.0, 2.0, [(1.0, 0), (2.0, 0)])])
    keys = {"ttft_p50_s", "ttft_p99_s", "effective_tput", "raw_tput", "stall_s", "preemptions", "qoe_mean"}
    assert keys <= set(full.to_dict())


def test_reader_and_record_together():
    # The engine's convention: record the buffer before handing the token to the reader.
    reader, record = ReaderModel(4.0), StreamRecord("s", 0.0, 4.0, prompt_len=2)
    for t in (0.5, 0.5, 0.5, 0.6, 2.0):
        record.record_token(t, reader.buffer_at(t))
        reader.on_tokens(t)
    reader.finish(2.0)
    record.mark_finished(stall_s=reader.stall_time_at(2.0))
    # Reads at 0.5 (c_0 = g_0), 0.75, 1.0, 1.25; ready again at 1.5, token 5 comes at 2.0: 0.5 s stall.
    assert record.token_buffers == [0, 0, 1, 2, 0]
    assert stream_stall_s(record) == pytest.approx(0.5)
    assert record.stall_s == pytest.approx(
        stream_stall_s(make_record("r", 0.0, 4.0, [(t, 0) for t in record.token_times]))
    )


def test_record_and_summary_validation():
    with pytest.raises(ValueError, match="rate"):
        StreamRecord("s", 0.0, -1.0, prompt_len=1)
    with pytest.raises(ValueError, match="arrival_s"):
        StreamRecord("s", math.inf, 1.0, prompt_len=1)
    record = StreamRecord("s", 1.0, 1.0, prompt_len=1)
    with pytest.raises(ValueError, match="before"):
        record.record_token(0.5, 0)
    with pytest.raises(ValueError, match="buffer"):
        record.record_token(1.5, -1)
    with pytest.raises(ValueError, match="buffer"):
        record.record_token(1.5, math.nan)
    with pytest.raises(ValueError, match="tokens"):
        record.record_recompute(-3)
    assert record.token_times == [] and record.tokens_recomputed == 0
    record.record_preemption()
    record.record_recompute(4)
    assert (record.preemptions, record.tokens_recomputed) == (1, 4)
    record.mark_finished()
    with pytest.raises(ValueError, match="after finish"):
        record.record_token(2.0, 0)
    with pytest.raises(ValueError, match="makespan_s"):
        summarize([record], makespan_s=0.0)
    with pytest.raises(ValueError, match="bytes_to_host"):
        summarize([record], bytes_to_host=-1)
