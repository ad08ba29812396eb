"""StreamTable and ChangeLog: the central table kept from replicas' batches, rebuilt from snapshots (pure Python)."""

from __future__ import annotations

import random

from tokenflow_ray.cluster.change_log import ChangeLog
from tokenflow_ray.cluster.http_requests import classify, owner_of
from tokenflow_ray.cluster.messages import Report
from tokenflow_ray.cluster.stream_table import ReplicaChanges, StreamTable, TableSettings, merge_reports


def test_merge_keeps_the_newest_value_of_each_field():
    assert merge_reports(Report("s", 3, 5.0, None), Report("s", None, None, True)) == Report("s", 3, 5.0, True)
    assert merge_reports(Report("s", 3, 5.0, True), Report("s", 4, 6.0, False)) == Report("s", 4, 6.0, False)


def test_batches_register_report_and_end_streams_and_the_summary_counts_them():
    table = StreamTable(TableSettings(critical_buffer_s=1.0))
    assert table.apply_changes("r1", ReplicaChanges(added=(("a", 1.0),)), 0.0) is True  # unknown: snapshot first
    assert not table.apply_changes("r1", ReplicaChanges(full=True, added=(("a", 1.0), ("b", None))), 0.0)
    assert not table.apply_changes("r2", ReplicaChanges(full=True, added=(("c", 4.0),),
                                                         buffers=(("c", 0.5),)), 0.0)
    assert not table.apply_changes("r1", ReplicaChanges(reports=(Report("a", rate=3.0),),
                                                         buffers=(("a", 2.0),)), 1.0)
    table.check_integrity()
    assert table.summary() == {"r1": {"streams": 2, "sum_rate": 3.0, "short_of_buffer": 0},
                               "r2": {"streams": 1, "sum_rate": 4.0, "short_of_buffer": 1}}
    assert table.report(Report("b", paused=True), 2.0) == "r1" and table.take_pushes("r1") == [Report("b", paused=True)]
    assert not table.apply_changes("r1", ReplicaChanges(removed=("a",)), 3.0)
    assert table.report(Report("a"), 3.0) is None and table.is_finished("a")
    # A full snapshot replaces what the table held for that replica.
    assert not table.apply_changes("r1", ReplicaChanges(full=True, added=(("d", 2.0),)), 4.0)
    assert set(table.view()) == {"c", "d"}
    table.check_integrity()


def test_a_change_log_rebuilds_a_fresh_table_exactly():
    log = ChangeLog()
    log.add("a", 1.0)
    log.add("b", 2.0)
    first = log.drain()
    assert first.full and dict(first.added) == {"a": 1.0, "b": 2.0}
    log.reported(Report("a", rate=5.0))
    log.remove("b")
    log.add("c", None)
    log.remove("c")  # added and ended within one batch
    second = log.drain()
    assert not second.full and second.added == () and set(second.removed) == {"b", "c"}
    assert second.reports == (Report("a", rate=5.0),)
    log.need_full()  # e.g. the last batch failed
    third = log.drain()
    assert third.full and third.added == (("a", 5.0),)  # the reported rate is the declared rate now
    assert not log.pending


def test_random_histories_keep_the_table_equal_to_the_replicas_live_streams():
    rng = random.Random(7)
    logs = {f"r{i}": ChangeLog() for i in range(3)}
    table = StreamTable()
    next_id = 0
    for step in range(600):
        rid = rng.choice(list(logs))
        log = logs[rid]
        op = rng.random()
        if op < 0.35:
            log.add(f"s{next_id}", rng.choice((None, 1.0, 20.0)))
            next_id += 1
        elif op < 0.55 and log.live:
            log.remove(rng.choice(list(log.live)))
        elif op < 0.7 and log.live:
            log.reported(Report(rng.choice(list(log.live)), rate=float(rng.randint(1, 30))))
        elif op < 0.75:
            table = StreamTable() if rng.random() < 0.5 else table  # the actor restarted
        batch = log.drain()
        if table.apply_changes(rid, batch, float(step)):
            log.need_full()
        table.check_integrity()
    for rid, log in logs.items():  # one more round: every replica heard, restarted table or not
        if table.apply_changes(rid, log.drain(), 1e9):
            log.need_full()
            assert not table.apply_changes(rid, log.drain(), 1e9)
    expected = {sid: (rid, rate) for rid, log in logs.items() for sid, rate in log.live.items()}
    assert {sid: (e["replica_id"], e["rate"]) for sid, e in table.view().items()} == expected


def test_http_requests_name_new_streams_and_report_owners():
    sid = "cmpl-" + "0" * 32 + "-abc123"
    assert owner_of(sid) == "abc123" and owner_of("chatcmpl-" + "f" * 32 + "-x-y") == "x-y"
    assert owner_of("cmpl-xyz") is None
    report = classify("POST", f"/app/v1/streams/{sid}/consumption", [])
    assert not report.new_stream and report.owner == "abc123"
    stream = classify("POST", "/v1/chat/completions", [(b"X-Consumption-Rate", b"12.5"), (b"content-length", b"300")])
    assert stream.new_stream and stream.rate == 12.5 and stream.body_bytes == 300
    assert classify("POST", "/v1/completions", [(b"x-consumption-rate", b"nan")]).rate is None
    assert not classify("GET", "/v1/models", []).new_stream
