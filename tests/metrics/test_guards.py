"""Reader-felt guards (metrics/guards.py) and the shared table (metrics/table.py)."""

import pytest

from tokenflow_ray.metrics.guards import describe, failed, guards
from tokenflow_ray.metrics.table import policy_table

FCFS_KEEPS_UP = {"qoe_mean": 0.99, "ttft_mean_s": 0.5, "ttft_p99_s": 1.5, "raw_tput": 1000.0,
                 "effective_tput": 400.0, "stall_per_stream_mean_s": 0.02}


def test_no_worse_where_fcfs_keeps_up_passes_and_each_harm_is_named():
    same = guards(dict(FCFS_KEEPS_UP), FCFS_KEEPS_UP)
    assert same["ok"] and same["harm_ok"] and same["regime"] == "fcfs keeps up"
    worse = {**FCFS_KEEPS_UP, "stall_per_stream_mean_s": 0.5, "qoe_mean": 0.95, "raw_tput": 900.0}
    report = guards(worse, FCFS_KEEPS_UP)
    assert not report["ok"] and set(failed(report)) == {"stall_mean", "qoe", "raw_tput"}
    assert "stall_mean FAIL" in describe(report) and "ttft_mean ok" in describe(report)
    # The limits are the issue's: TTFT mean 1.05 F + 0.05 s, P99 1.1 F + 0.1 s.
    edge = {**FCFS_KEEPS_UP, "ttft_mean_s": 1.05 * 0.5 + 0.05, "ttft_p99_s": 1.1 * 1.5 + 0.1}
    assert guards(edge, FCFS_KEEPS_UP)["ok"]
    past = {**edge, "ttft_p99_s": 1.1 * 1.5 + 0.11}
    assert failed(guards(past, FCFS_KEEPS_UP)) == ["ttft_p99"]


def test_overload_asks_for_the_papers_gains_and_missing_data_fails():
    fcfs = {**FCFS_KEEPS_UP, "ttft_p99_s": 30.0, "ttft_mean_s": 10.0}
    half = {**fcfs, "ttft_mean_s": 5.0, "effective_tput": 520.0, "stall_per_stream_mean_s": 9.0}
    report = guards(half, fcfs)
    assert report["regime"] == "overload" and report["ok"]  # stalls are not a guard past capacity
    assert failed(guards({**half, "ttft_mean_s": 6.0}, fcfs)) == ["ttft_mean_gain"]
    none = guards({**FCFS_KEEPS_UP, "qoe_mean": None}, FCFS_KEEPS_UP)
    assert "qoe" in failed(none)


@pytest.mark.parametrize("missing", ["qoe_mean", "stall_per_stream_p99_s"])
def test_table_shows_every_reader_felt_column_and_dashes_for_no_data(missing):
    row = {"ttft_mean_s": 0.5, "ttft_p99_s": 1.5, "qoe_mean": 0.987, "stall_per_stream_mean_s": 0.02,
           "stall_per_stream_p99_s": 0.3, "raw_tput": 4748.2, "effective_tput": 1595.3, "preemptions": 0}
    row[missing] = None
    head, line = policy_table({"fcfs": row}).splitlines()
    for col in ("TTFT mean", "TTFT p99", "QoE", "stall mean", "stall p99", "raw", "effective"):
        assert col in head
    assert "—" in line and "4748.2" in line
