"""Andes (arXiv 2404.16283), ported as the TokenFlow authors did: QoE-gain ranking, recompute-only preemption.

Each Δt the policy ranks streams by the QoE they would lose if kept off the device for the next Δt, per unit of
memory (the greedy knapsack of the paper): a paced stream loses max(0, Δt − b) seconds of smooth delivery (b:
seconds of buffer), a stream still waiting for its first token loses the part of Δt past its TTFT target, both
over the stream's expected duration S_whole = TTFT target + max_tokens / rate. Preemptions are capped at
`max_preemptions_per_s` to bound recompute cost (the paper's frequency parameter P).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tokenflow_ray.engine.policies.base import SchedulerView, SchedulingPolicy, arrival_key
from tokenflow_ray.engine.stream import Stream


@dataclass(frozen=True)
class AndesConfig:
    delta_t: float = 0.5  # scheduling horizon and interval, seconds
    ttft_target_s: float = 1.0  # expected-delivery curve: first token due this long after arrival
    max_preemptions_per_s: float = 4.0  # P

    def __post_init__(self) -> None:
        for name in ("delta_t", "ttft_target_s", "max_preemptions_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"andes.{name}: must be a finite number > 0, got {value!r}")


class AndesPolicy(SchedulingPolicy):
    name = "andes"
    proactive = True
    uses_host_store = False  # recompute only, as the authors' port

    def __init__(self, config: AndesConfig | None = None) -> None:
        self.config = config or AndesConfig()
        self._last_rebalance = -math.inf
        self._preempt_times: deque[float] = deque()

    def qoe_gain(self, s: Stream, now: float) -> float:
        c = self.config
        whole = c.ttft_target_s + (s.sampling.max_tokens / s.rate if s.rate > 0 else c.delta_t)
        if s.first_token_time is None:
            due = s.arrival_time + c.ttft_target_s
            lost = min(c.delta_t, max(0.0, now + c.delta_t - due))
        elif s.rate == 0:
            lost = c.delta_t
        else:
            lost = max(0.0, c.delta_t - s.buffer_s(now))
        return lost / whole

    def rank(self, streams: Sequence[Stream], view: SchedulerView) -> list[Stream]:
        return sorted(streams, key=lambda s: (-self.qoe_gain(s, view.now) / max(s.num_tokens, 1), arrival_key(s)))

    def should_rebalance(self, streams: Sequence[Stream], view: SchedulerView) -> bool:
        if view.now - self._last_rebalance < self.config.delta_t:
            return False
        self._last_rebalance = view.now
        return True

    def may_preempt(self, stream: Stream, view: SchedulerView) -> bool:
        while self._preempt_times and self._preempt_times[0] < view.now - 1.0:
            self._preempt_times.popleft()
        return len(self._preempt_times) < self.config.max_preemptions_per_s

    def on_preempt(self, stream: Stream, view: SchedulerView) -> None:
        self._preempt_times.append(view.now)
