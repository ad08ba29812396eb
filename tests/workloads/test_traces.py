"""The trace reader (workloads/traces.py) on the shipped slices of each format, and its errors."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest

from tokenflow_ray.workloads.traces import (
    TraceError,
    TraceOptions,
    detect_format,
    load_trace,
    parse_rates,
    parse_window,
    read_trace,
)

DATA = Path(__file__).with_name("data")
AZURE, MOONCAKE, BURSTGPT = (DATA / "azure_conv_slice.csv", DATA / "mooncake_slice.jsonl",
                             DATA / "burstgpt_format_sample.csv")


@pytest.mark.parametrize("path, fmt", [(AZURE, "azure"), (MOONCAKE, "mooncake"), (BURSTGPT, "burstgpt")])
def test_each_format_is_told_by_its_content(path, fmt):
    assert detect_format(path) == fmt


def test_azure_rows_are_the_files_rows_in_order_with_arrivals_from_the_first():
    trace = load_trace(AZURE)
    with AZURE.open() as f:
        rows = list(csv.DictReader(f))
    assert len(trace.requests) == len(rows) == 300
    assert [(r.prompt_len, r.output_len) for r in trace.requests] == [
        (int(r["ContextTokens"]), max(1, int(r["GeneratedTokens"]))) for r in rows]
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    # 18:15:46.6805900 -> 18:15:50.9951690: the seventh fractional digit is kept.
    assert arrivals[1] == pytest.approx(4.314579, abs=1e-6)


def test_window_speed_and_rates():
    whole = load_trace(AZURE)
    minute = load_trace(AZURE, TraceOptions(window=(0.5, 0.5)))
    origin_s = 30.0  # the window's start, from the trace's first request
    in_window = [r for r in whole.requests if origin_s <= r.arrival_s < 60.0]
    assert [(r.prompt_len, r.output_len) for r in minute.requests] == [(r.prompt_len, r.output_len) for r in in_window]
    assert minute.requests[0].arrival_s == 0.0
    fast = load_trace(AZURE, TraceOptions(speed=4.0))
    assert [r.arrival_s for r in fast.requests] == pytest.approx([r.arrival_s / 4 for r in whole.requests])
    # The paper's mix in exact proportions, seeded: another seed shuffles, the counts stay.
    counts = Counter(r.rate for r in whole.requests)
    assert counts == {15.0: 120, 20.0: 180}
    other = load_trace(AZURE, TraceOptions(seed=1))
    assert Counter(r.rate for r in other.requests) == counts
    assert [r.rate for r in other.requests] != [r.rate for r in whole.requests]
    assert load_trace(AZURE).requests == whole.requests  # the same options, the same requests


def test_length_scale_and_max_context():
    whole = load_trace(AZURE)
    quarter = load_trace(AZURE, TraceOptions(length_scale=0.25))
    for a, b in zip(whole.requests, quarter.requests):
        assert b.prompt_len == max(1, round(a.prompt_len * 0.25)) and b.output_len == max(1, round(a.output_len * 0.25))
    capped = load_trace(AZURE, TraceOptions(max_context=512))
    assert all(r.prompt_len + r.output_len <= 512 and r.prompt_len >= 1 for r in capped.requests)
    assert capped.truncated == sum(r.prompt_len + r.output_len > 512 for r in whole.requests) > 0
    # Outputs are kept where they fit: the prompt is cut first.
    assert all(c.output_len == w.output_len for c, w in zip(capped.requests, whole.requests) if w.output_len < 256)


def test_mooncake_keeps_hash_ids_and_milliseconds():
    trace = load_trace(MOONCAKE)
    assert len(trace.requests) == 40 and trace.format == "mooncake"
    first = MOONCAKE.read_text().splitlines()[0]
    assert trace.hash_ids[0][:3] == (0, 1, 2) and '"timestamp": 0' in first
    assert all(len(h) == -(-r.prompt_len // 512) for h, r in zip(trace.hash_ids, trace.requests))
    assert trace.requests[2].arrival_s == pytest.approx(0.040)


def test_burstgpt_skips_failed_rows():
    fmt, rows, failed = read_trace(BURSTGPT)
    assert fmt == "burstgpt" and failed == 5 and len(rows) == 55
    trace = load_trace(BURSTGPT)
    assert trace.rows_failed == 5 and all(r.output_len > 0 for r in trace.requests)


@pytest.mark.parametrize("text, line, message", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47,abc,3\n", 3,
     "ContextTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,374,44\n", 2, "TIMESTAMP"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,374\n", 2, "columns"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2}\n{"timestamp": 5, "input_length": 10}\n', 2,
     "output_length"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2}\nnot json\n', 2, "JSON"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,GPT-4,-3,4,1,API log\n", 2,
     "Request tokens"),
])
def test_a_bad_row_names_the_file_and_line(tmp_path, text, line, message):
    path = tmp_path / ("t.jsonl" if text.startswith("{") else "t.csv")
    path.write_text(text)
    with pytest.raises(TraceError, match=rf"^{path}:{line}: .*{message}"):
        load_trace(path)


def test_bad_files_and_options(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "missing.csv")
    odd = tmp_path / "odd.csv"
    odd.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match=rf"^{odd}:1: not a known trace format"):
        load_trace(odd)
    with pytest.raises(TraceError, match=rf"^{odd}:1: expected the header"):
        load_trace(odd, TraceOptions(format="azure"))
    with pytest.raises(TraceError, match="no requests in --window 90:1"):
        load_trace(AZURE, TraceOptions(window=(90, 1)))
    for bad in ("10", "a:b", "-1:2", "0:0"):
        with pytest.raises(ValueError, match="--window"):
            parse_window(bad)
    assert parse_window("0:10") == (0.0, 10.0)
    assert parse_rates("15:0.4,20:0.6") == ((15.0, 0.4), (20.0, 0.6)) and parse_rates("18") == ((18.0, 1.0),)
    for bad in ("15:0.5,20:0.6", "x", "0:1"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)
    with pytest.raises(ValueError, match="speed"):
        TraceOptions(speed=0)
