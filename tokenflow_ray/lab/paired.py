"""Paired comparison of two arms measured round by round: per-round ratios, their geometric mean with a seeded
percentile-bootstrap interval, win counts and a verdict.

Why paired: on a shared 2-core box the same command's throughput moved 890-1450 tok/s within an hour, and one
router's median over 3-5 rounds came out ahead in one run and behind in the next at the same settings. A bench that
alternates its arms round by round puts each pair side by side in time, so a pair's ratio cancels most of the
box's drift, and the spread of those ratios is the noise a claim has to clear: "better" only when the whole interval
is on the better side of 1 and an exact sign test over the pairs agrees (the bootstrap alone is overconfident on a
few pairs).

Pure Python (no numpy): a few dozen rounds, a few thousand resamples.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PairedRatio:
    metric: str
    higher_is_better: bool
    pairs: int  # round pairs compared (those with both values > 0)
    geo_mean: float  # of a / b over the pairs
    low: float  # the interval of the geometric mean, at `level`
    high: float
    wins: int  # pairs where a did better than b
    losses: int  # pairs where b did (equal pairs are neither)
    sign_p: float  # two-sided exact sign test of wins against losses
    verdict: str  # "better" | "worse": the whole interval on that side of 1 and sign_p < 1 - level; else "tie"

    def to_dict(self) -> dict:
        return asdict(self)


def paired_ratio(metric: str, a: Sequence[float], b: Sequence[float], higher_is_better: bool,
                 level: float = 0.95, resamples: int = 4000, seed: int = 0) -> PairedRatio:
    """a[i] / b[i] for each round i where both are > 0 (a round that delivered nothing has no ratio)."""
    if len(a) != len(b):
        raise ValueError(f"{metric}: {len(a)} rounds against {len(b)}: pairs need the same count")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError("level must be in (0, 1) and resamples >= 1")
    logs = _log_ratios(a, b)
    if len(logs) < 2:
        raise ValueError(f"{metric}: needs at least 2 pairs with values > 0, got {len(logs)}")
    rng = random.Random(seed)
    n = len(logs)
    means = sorted(statistics.fmean(rng.choices(logs, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    low = math.exp(means[int(tail * (resamples - 1))])
    high = math.exp(means[int(math.ceil((1 - tail) * (resamples - 1)))])
    sign = 1 if higher_is_better else -1
    wins = sum(1 for x in logs if sign * x > 0)
    losses = sum(1 for x in logs if sign * x < 0)
    p = sign_test(wins, losses)
    # The bootstrap alone is overconfident on a few pairs (3 pairs all one way give an interval clear of 1), so a
    # verdict needs the sign test too: 5 of 5 is p = 0.0625, not enough at 95%.
    above, below = low > 1, high < 1  # the whole interval on one side of 1
    verdict = "tie"
    if p < 1 - level and (above or below):
        verdict = "better" if above == higher_is_better else "worse"
    return PairedRatio(metric, higher_is_better, n, math.exp(statistics.fmean(logs)), low, high, wins, losses, p,
                       verdict)


def _log_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """log(a[i] / b[i]) for each pair where both are > 0."""
    return [math.log(x / y) for x, y in zip(a, b) if x > 0 and y > 0]


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of `wins` against `losses` under no difference (p = 1/2)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def compare_rounds(a_rounds: Sequence[dict], b_rounds: Sequence[dict], metrics: dict[str, bool],
                   level: float = 0.95) -> dict[str, PairedRatio]:
    """Pairs round i of arm a with round i of arm b (the bench ran them side by side) for each metric name ->
    higher_is_better; a metric with fewer than 2 usable pairs is left out."""
    if len(a_rounds) != len(b_rounds):
        raise ValueError(f"{len(a_rounds)} rounds against {len(b_rounds)}: pairs need the same count")
    out = {}
    for name, higher in metrics.items():
        a, b = [r[name] for r in a_rounds], [r[name] for r in b_rounds]
        if len(_log_ratios(a, b)) >= 2:
            out[name] = paired_ratio(name, a, b, higher, level)
    return out
