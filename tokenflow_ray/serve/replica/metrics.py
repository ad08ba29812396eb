"""A replica's serving metrics, two ways from one snapshot.

1. `ReplicaMetrics`: `ray.util.metrics` Histogram/Counter/Gauge in each replica; Ray exports them on every node's
   metrics port (what a Prometheus scraping the Ray cluster sees).
2. The totals (`StreamTotals`, `MoveTotals`) as plain dicts in the stats every replica sends to the central actor,
   which the app's own `GET /metrics` renders (serve/http/prometheus.py).

Definitions (TTFT, TBT, effective-throughput weights) are tokenflow_ray.metrics', counted over finished streams.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

from tokenflow_ray.metrics.stream_metrics import StreamRecord, effective_tokens, stream_qoe, stream_stall_s

# ReplicaStats fields (tokenflow_ray/cluster/replica_stats.py) the replica also exports through Ray; /metrics
# renders every gauge in the snapshot, these included.
ROUTING_GAUGES = ("num_paused", "num_live", "sum_rate", "waiting_rate", "capacity_tok_s", "min_buffer_s",
                  "queued_prefill_s", "host_blocks_free", "admitted_total")
# Prefix caching (EngineStats): cached blocks, and the hit rate over every lookup and over prompts.
PREFIX_GAUGES = ("device_blocks_cached", "prefix_lookup_tokens", "prefix_hit_tokens_device", "prefix_hit_rate_device",
                 "prompt_tokens_total", "prompt_cached_tokens_total")
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
TBT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# What a reader feels, per finished stream: seconds its reader waited with an empty buffer, and Andes' QoE (1: every
# token on time; metrics/stream_metrics.py). Histograms, so a dashboard reads the mean and the P99 of each.
STALL_BUCKETS = (0.01, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
QOE_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
# A served move, the source's order to the target's import: 40-150 ms here (docs/results/cluster.md).
HANDOFF_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class HistogramCounts:
    """Cumulative-friendly bucket counts (picklable plain data; merged across replicas by the renderer)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe_many(self, values: Iterable[float]) -> None:
        for v in values:
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.total += v

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}


class StreamTotals:
    """What a replica accumulates from its finished streams."""

    def __init__(self) -> None:
        self.ttft = HistogramCounts(TTFT_BUCKETS)
        self.tbt = HistogramCounts(TBT_BUCKETS)
        self.stall = HistogramCounts(STALL_BUCKETS)
        self.qoe = HistogramCounts(QOE_BUCKETS)
        self.tokens = 0
        self.effective_tokens = 0.0

    def add(self, records: Iterable[StreamRecord]) -> None:
        for r in records:
            if r.ttft_s is not None:
                self.ttft.observe_many([r.ttft_s])
            self.tbt.observe_many(r.tbt_s)
            if r.token_times:
                self.stall.observe_many([stream_stall_s(r)])
                if (q := stream_qoe(r)) is not None:
                    self.qoe.observe_many([q])
            self.tokens += r.output_len
            self.effective_tokens += effective_tokens(r)

    def to_dict(self) -> dict[str, Any]:
        return {"ttft": self.ttft.to_dict(), "tbt": self.tbt.to_dict(), "stall": self.stall.to_dict(),
                "qoe": self.qoe.to_dict(), "tokens_total": self.tokens,
                "effective_tokens_total": self.effective_tokens}


class MoveTotals:
    """The moves a replica made of its streams (it is their source): how many per reason (overloaded,
    device_full, drain, requested) and outcome (moved, failed), and how long each hand-off took, per reason."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        self.handoff: dict[str, HistogramCounts] = {}

    def add(self, result: dict[str, Any]) -> None:
        reason = str(result.get("reason") or "requested")
        outcome = "moved" if result.get("moved") else "failed"
        row = self.counts.setdefault(reason, {"moved": 0, "failed": 0})
        row[outcome] += 1
        if result.get("moved") and result.get("handoff_s") is not None:
            self.handoff.setdefault(reason, HistogramCounts(HANDOFF_BUCKETS)).observe_many([result["handoff_s"]])

    def to_dict(self) -> dict[str, Any]:
        return {"counts": {r: dict(c) for r, c in self.counts.items()},
                "handoff": {r: h.to_dict() for r, h in self.handoff.items()}}


class ReplicaMetrics:
    """Ray-exported metrics of one replica (created in the replica's constructor, never at import)."""

    def __init__(self, model: str) -> None:
        from ray.util import metrics as m

        tags, keys = {"model": model}, ("model",)
        self.ttft = m.Histogram("tokenflow_ttft_seconds", "submission to first token", list(TTFT_BUCKETS), keys)
        self.tbt = m.Histogram("tokenflow_tbt_seconds", "gap between tokens as emitted", list(TBT_BUCKETS), keys)
        self.stall = m.Histogram("tokenflow_stall_seconds", "a finished stream's reader time with an empty buffer",
                                 list(STALL_BUCKETS), keys)
        self.qoe = m.Histogram("tokenflow_qoe", "a finished stream's Andes QoE (1: every token on time)",
                               list(QOE_BUCKETS), keys)
        self.tokens = m.Counter("tokenflow_tokens_total", "generated tokens", keys)
        self.effective = m.Counter("tokenflow_effective_tokens_total",
                                   "tokens weighted by reader buffer (rate() = effective throughput)", keys)
        self.gauges = {name: m.Gauge(f"tokenflow_{name}", name.replace("_", " "), keys)
                       for name in ("buffer_tokens_mean", "num_running", "num_waiting", "device_blocks_free",
                                    "preemptions", "bytes_to_host", "bytes_from_host", "effective_tput",
                                    *PREFIX_GAUGES, *ROUTING_GAUGES)}
        self.moves = m.Counter("tokenflow_migrations_total", "streams this replica moved away, by reason and outcome",
                               (*keys, "reason", "outcome"))
        self.handoff = m.Histogram("tokenflow_migration_handoff_seconds", "a move from its order to the hand-off",
                                   list(HANDOFF_BUCKETS), (*keys, "reason"))
        for metric in (self.ttft, self.tbt, self.stall, self.qoe, self.tokens, self.effective, self.moves, self.handoff,
                       *self.gauges.values()):
            metric.set_default_tags(tags)

    def observe_move(self, result: dict[str, Any]) -> None:
        reason = str(result.get("reason") or "requested")
        self.moves.inc(1, {"reason": reason, "outcome": "moved" if result.get("moved") else "failed"})
        if result.get("moved") and result.get("handoff_s") is not None:
            self.handoff.observe(result["handoff_s"], {"reason": reason})

    def observe(self, records: Sequence[StreamRecord], stats: dict[str, Any]) -> None:
        for r in records:
            if r.ttft_s is not None:
                self.ttft.observe(r.ttft_s)
            for gap in r.tbt_s:
                self.tbt.observe(gap)
            if r.token_times:
                self.stall.observe(stream_stall_s(r))
                if (q := stream_qoe(r)) is not None:
                    self.qoe.observe(q)
            if r.output_len:
                self.tokens.inc(r.output_len)
                self.effective.inc(effective_tokens(r))
        for name, gauge in self.gauges.items():
            # ReplicaStats leaves min_buffer_s out while no paced stream runs: NaN, not the last value seen.
            value = stats.get(name, math.nan if name == "min_buffer_s" else None)
            if isinstance(value, (int, float)):
                gauge.set(float(value))


def engine_stats_dict(stats: Any) -> dict[str, Any]:
    out = {k: v for k, v in asdict(stats).items() if isinstance(v, (int, float))}
    if hasattr(stats, "prefix_hit_rate_device"):
        out["prefix_hit_rate_device"] = stats.prefix_hit_rate_device
    return out
