"""Migration in the metrics (issue 15, item 3): each move the source made, by reason and outcome, and its hand-off
time, as `GET /metrics` renders them from the replicas' stats (no Ray: the HTTP path is in test_migration_http)."""

from __future__ import annotations

from tokenflow_ray.serve.http.prometheus import render_prometheus
from tokenflow_ray.serve.replica.metrics import MoveTotals, StreamTotals


def _lines(text: str, prefix: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def test_moves_are_counted_by_reason_and_outcome_with_their_hand_off_times():
    moves = MoveTotals()
    for result in ({"moved": True, "reason": "drain", "handoff_s": 0.07},
                   {"moved": True, "reason": "drain", "handoff_s": 0.3},
                   {"moved": False, "reason": "drain", "why": "the target did not take it"},
                   {"moved": True, "reason": "overloaded", "handoff_s": 0.04},
                   {"moved": False}):  # a manual move that failed before it was timed
        moves.add(result)
    replicas = {"r1": {"gauges": {}, "totals": StreamTotals().to_dict(), "moves": moves.to_dict()},
                "r2": {"gauges": {}, "totals": StreamTotals().to_dict()}}  # stats from before moves were counted
    text = render_prometheus(replicas).decode()
    assert _lines(text, "tokenflow_migrations_total{") == {
        'tokenflow_migrations_total{outcome="moved",reason="drain",replica="r1"}': 2.0,
        'tokenflow_migrations_total{outcome="failed",reason="drain",replica="r1"}': 1.0,
        'tokenflow_migrations_total{outcome="moved",reason="overloaded",replica="r1"}': 1.0,
        'tokenflow_migrations_total{outcome="failed",reason="overloaded",replica="r1"}': 0.0,
        'tokenflow_migrations_total{outcome="moved",reason="requested",replica="r1"}': 0.0,
        'tokenflow_migrations_total{outcome="failed",reason="requested",replica="r1"}': 1.0}
    handoff = _lines(text, "tokenflow_migration_handoff_seconds_")
    assert handoff['tokenflow_migration_handoff_seconds_count{reason="drain",replica="r1"}'] == 2.0
    assert abs(handoff['tokenflow_migration_handoff_seconds_sum{reason="drain",replica="r1"}'] - 0.37) < 1e-9
    assert handoff['tokenflow_migration_handoff_seconds_bucket{le="0.1",reason="drain",replica="r1"}'] == 1.0
    assert handoff['tokenflow_migration_handoff_seconds_bucket{le="+Inf",reason="drain",replica="r1"}'] == 2.0
    assert 'reason="requested"' not in "".join(handoff)  # an untimed failure has no hand-off


def test_stream_totals_count_each_readers_stall_and_qoe():
    from tokenflow_ray.metrics.stream_metrics import StreamRecord

    on_time = StreamRecord("a", arrival_s=0.0, prompt_len=4, rate=4.0,
                           token_times=[0.1, 0.35, 0.6, 0.85], token_buffers=[0.0] * 4, finished=True)
    stalled = StreamRecord("b", arrival_s=0.0, prompt_len=4, rate=4.0,
                           token_times=[0.1, 0.35, 3.0, 3.25], token_buffers=[0.0] * 4, finished=True)
    totals = StreamTotals()
    totals.add([on_time, stalled])
    d = totals.to_dict()
    assert sum(d["qoe"]["counts"]) == sum(d["stall"]["counts"]) == 2
    assert d["stall"]["sum"] > 2.0 and d["qoe"]["sum"] < 2.0  # the stalled reader lost QoE
    text = render_prometheus({"r1": {"gauges": {}, "totals": d}}).decode()
    assert 'tokenflow_qoe_count{replica="r1"} 2.0' in text and "tokenflow_stall_seconds_sum" in text
