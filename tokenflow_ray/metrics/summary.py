"""PolicySummary: one policy's run reduced to the numbers the benchmarks print and the JSON contract needs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from tokenflow_ray.checks import check_count, check_positive
from tokenflow_ray.metrics.stream_metrics import StreamRecord, effective_tokens, stream_qoe, stream_stall_s


@dataclass(frozen=True)
class PolicySummary:
    """Aggregates over streams. NaN marks a value with no data (e.g. TBT with one-token streams)."""

    num_streams: int
    num_started: int  # streams with at least one token (TTFT, QoE and stall means are over these)
    num_finished: int
    total_tokens: int
    makespan_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    tbt_p50_s: float
    tbt_p99_s: float
    effective_tput: float  # weighted tokens / makespan (paper §7.1.3)
    raw_tput: float  # tokens / makespan
    stall_s: float  # total stall seconds over all streams
    stall_per_stream_mean_s: float
    stall_per_stream_p99_s: float
    qoe_mean: float  # Andes QoE over paced streams with tokens
    preemptions: int
    tokens_recomputed: int
    bytes_to_host: int
    bytes_from_host: int

    def to_dict(self) -> dict[str, float | int | None]:
        """JSON-safe: NaN (no data) becomes None, since JSON has no NaN."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def summarize(
    records: Sequence[StreamRecord],
    makespan_s: float | None = None,
    *,
    ttft_target_s: float = 1.0,
    bytes_to_host: int = 0,
    bytes_from_host: int = 0,
) -> PolicySummary:
    """Reduce stream records to a PolicySummary.

    makespan_s defaults to (last token time - first arrival). Byte counters come from the spill store,
    which sees transfers, not streams; preemptions and recomputed tokens are summed over the records.
    """
    check_count(bytes_to_host, "bytes_to_host")
    check_count(bytes_from_host, "bytes_from_host")
    started = [r for r in records if r.token_times]
    if makespan_s is None:
        makespan_s = (
            max(r.token_times[-1] for r in started) - min(r.arrival_s for r in records)
            if started
            else math.nan
        )
    else:
        makespan_s = check_positive(makespan_s, "makespan_s")

    ttfts = [r.ttft_s for r in started]
    tbts = [gap for r in started for gap in r.tbt_s]
    total_tokens = sum(r.output_len for r in records)
    weighted = sum(effective_tokens(r) for r in started)
    stalls = [stream_stall_s(r) for r in started]
    qoes = [q for r in started if (q := stream_qoe(r, ttft_target_s)) is not None]
    # A zero makespan (one instant) has no meaningful rate.
    per_s = 1.0 / makespan_s if makespan_s > 0 else math.nan

    return PolicySummary(
        num_streams=len(records),
        num_started=len(started),
        num_finished=sum(r.finished for r in records),
        total_tokens=total_tokens,
        makespan_s=float(makespan_s),
        ttft_p50_s=_percentile(ttfts, 50),
        ttft_p90_s=_percentile(ttfts, 90),
        ttft_p99_s=_percentile(ttfts, 99),
        ttft_mean_s=_mean(ttfts),
        tbt_p50_s=_percentile(tbts, 50),
        tbt_p99_s=_percentile(tbts, 99),
        effective_tput=weighted * per_s,
        raw_tput=total_tokens * per_s,
        stall_s=float(sum(stalls)),
        stall_per_stream_mean_s=_mean(stalls),
        stall_per_stream_p99_s=_percentile(stalls, 99),
        qoe_mean=_mean(qoes),
        preemptions=sum(r.preemptions for r in records),
        tokens_recomputed=sum(r.tokens_recomputed for r in records),
        bytes_to_host=bytes_to_host,
        bytes_from_host=bytes_from_host,
    )


def policy_ratios(num: dict, den: dict) -> dict:
    """num / den for effective throughput, P99 and mean TTFT, raw throughput and QoE; None where den is 0 or
    undefined. Stalls are differences (num - den, seconds per stream): fcfs's are often 0, so a ratio says nothing."""
    def ratio(key: str) -> float | None:
        a, b = num.get(key), den.get(key)
        return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

    def diff(key: str) -> float | None:
        a, b = num.get(key), den.get(key)
        return a - b if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None

    return {"effective_tput": ratio("effective_tput"), "ttft_p99": ratio("ttft_p99_s"), "raw_tput": ratio("raw_tput"),
            "ttft_mean": ratio("ttft_mean_s"), "qoe": ratio("qoe_mean"),
            "stall_mean_minus_s": diff("stall_per_stream_mean_s"), "stall_p99_minus_s": diff("stall_per_stream_p99_s")}
