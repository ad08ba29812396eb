"""Issue 34 item 0's measure: the share of a serving run's wall time spent in steps slower than twice the median
step of their batch bucket (goal <= 5%). A slow step is a shape the device had not seen (kernel selection, a cuDNN
graph build), a block boundary changing the gathered width, or a copy join; steps of one bucket do about the same
work, so twice their median is a stall, not work.

A step's batch is the tokens it runs (decodes + prefill tokens: a decode-only step's batch size), bucketed in
powers of two ([2^k, 2^(k+1))): a full-budget prefill step is then compared with others of its size, not with the
decodes. Beside it, the issue's first count: the share of wall time in steps over 60 ms.

Rows are `setup_a_eighth_*.json` samples: [decodes, prefill_tokens, decode_context, prefill_pairs, sampled, step_s].
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

FACTOR = 2.0
OVER_S = 0.060


def bucket(tokens: int) -> int:
    """The power of two at or below `tokens` (>= 1)."""
    return 1 << (max(1, int(tokens)).bit_length() - 1)


def slow_step_share(samples: Sequence[Sequence[float]], wall_s: float, factor: float = FACTOR) -> dict:
    if wall_s <= 0:
        raise ValueError(f"wall_s: must be > 0, got {wall_s!r}")
    by_bucket: dict[int, list[float]] = {}
    for row in samples:
        by_bucket.setdefault(bucket(row[0] + row[1]), []).append(row[5])
    buckets = {}
    slow_s = 0.0
    slow_n = 0
    for b in sorted(by_bucket):
        times = by_bucket[b]
        median = statistics.median(times)
        slow = [t for t in times if t > factor * median]
        slow_s += sum(slow)
        slow_n += len(slow)
        buckets[str(b)] = {"steps": len(times), "median_ms": median * 1e3, "slow_steps": len(slow),
                           "slow_s": sum(slow)}
    over = [row[5] for row in samples if row[5] > OVER_S]
    return {"share": slow_s / wall_s, "slow_s": slow_s, "slow_steps": slow_n, "steps": len(samples),
            "wall_s": wall_s, "factor": factor, "buckets": buckets,
            "over_60ms_share": sum(over) / wall_s, "over_60ms_s": sum(over), "over_60ms_steps": len(over)}
