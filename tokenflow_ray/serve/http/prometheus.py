"""The app's own `GET /metrics`: the replicas' stats (serve/replica/metrics.py) in Prometheus' text format.

Ray's export lives on a per-node port that a user of the HTTP app may not reach, so the HTTP front renders the same
numbers with prometheus_client from the stats every replica sends to the central actor (a fresh CollectorRegistry
per scrape: no process-global registry).
"""

from __future__ import annotations

from typing import Any


def render_prometheus(by_replica: dict[str, dict[str, Any]]) -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    def buckets(h: dict[str, Any]) -> list[tuple[str, int]]:
        cum, out = 0, []
        for bound, count in zip([*h["bounds"], float("inf")], h["counts"]):
            cum += count
            out.append(("+Inf" if bound == float("inf") else str(bound), cum))
        return out

    class _Snapshot:
        def collect(self):
            for key, name, doc in (("ttft", "tokenflow_ttft_seconds", "submission to first token"),
                                   ("tbt", "tokenflow_tbt_seconds", "gap between tokens as emitted"),
                                   ("stall", "tokenflow_stall_seconds",
                                    "a finished stream's reader time with an empty buffer"),
                                   ("qoe", "tokenflow_qoe", "a finished stream's Andes QoE (1: every token on time)")):
                fam = HistogramMetricFamily(name, doc, labels=["replica"])
                for rid, s in by_replica.items():
                    h = s["totals"].get(key)
                    if h is not None:  # a replica of an older version sends no stall or QoE
                        fam.add_metric([rid], buckets(h), h["sum"])
                yield fam
            moves = {rid: s["moves"] for rid, s in by_replica.items() if s.get("moves")}
            fam = CounterMetricFamily("tokenflow_migrations", "streams moved away, by reason and outcome",
                                      labels=["replica", "reason", "outcome"])
            for rid, mv in moves.items():
                for reason, row in mv["counts"].items():
                    for outcome, n in row.items():
                        fam.add_metric([rid, reason, outcome], n)
            yield fam
            fam = HistogramMetricFamily("tokenflow_migration_handoff_seconds", "a move from its order to the hand-off",
                                        labels=["replica", "reason"])
            for rid, mv in moves.items():
                for reason, h in mv["handoff"].items():
                    fam.add_metric([rid, reason], buckets(h), h["sum"])
            yield fam
            for key, doc in (("tokens_total", "generated tokens"),
                             ("effective_tokens_total", "buffer-weighted tokens (rate() = effective throughput)")):
                fam = CounterMetricFamily(f"tokenflow_{key.removesuffix('_total')}", doc, labels=["replica"])
                for rid, s in by_replica.items():
                    fam.add_metric([rid], s["totals"][key])
                yield fam
            gauge_keys = sorted({k for s in by_replica.values() for k in s["gauges"]})
            for key in gauge_keys:
                fam = GaugeMetricFamily(f"tokenflow_{key}", key.replace("_", " "), labels=["replica"])
                for rid, s in by_replica.items():
                    if key in s["gauges"]:
                        fam.add_metric([rid], float(s["gauges"][key]))
                yield fam

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot())
    return generate_latest(registry)
