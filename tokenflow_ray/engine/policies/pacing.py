"""[extension] Deadline-aware pacing for tokenflow (`TokenFlowConfig.pace`, on by default).

A token generated far ahead of its reader has no effective-throughput value (paper §7.1.3: weight 0 once the buffer
passes 20% of the length), while the device time it took could have fed another reader. D is when a work-conserving
engine at Γ would have generated every live stream's tokens: a fluid reference whose work drains at Γ whatever the
engine did (so time spent paced never moves D out) and grows with each new stream's work, while a lower Γ (the pool
filling as contexts grow) does move it. A running stream is held back for a step when

- its reader holds `pace_buffer` of its length (30%: past the 20% where its tokens weigh 0, and never under four
  steps of reading, so step jitter cannot stall the reader),
- its reader could read `pace_min_read_share` of its length between its first token and D (50%): where the engine
  finishes far sooner than readers read (short outputs on a fast engine), holding only shrinks the batch and costs
  raw throughput that no reader gets back,
- it is ahead of the uniform schedule from its first token to D (with `pace_slack`),
- and the rebalance may pause it (the policy's `hold`): its buffer covers μ x the switch.

Figures (simulator, tokenflow / fcfs, docs/results/simulator.md): without pacing, streams run far ahead of their
readers where the engine has capacity to spare, H200 (b) effective 1.44x and (c) 1.21x; with it 1.58x and 1.84x,
raw 1.01x and 1.00x. The 30% threshold is the trade-off measured on H200 (b): at 10% effective 3.7x but raw 0.90x,
at 20% 2.5x and 0.93x (the fluid D is optimistic: Γ at mid-life contexts, while the pool holds fewer streams at the
end, so holding tokens that still have value pushes work into the run's long-context tail). Without the reading-share
gate, the CPU sweep's burst at 0.5x Γ loses raw throughput (0.90x); with it 0.96x. D used to be the realized decode
throughput at arrival, which a burst that briefly fits the pool overstates: pacing then never engaged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from tokenflow_ray.engine.stream import Stream


class Pacer:
    """D and the hold rule; the policy calls `track` once a step (in rank) and asks `candidates`."""

    def __init__(self, pace_buffer: float, min_read_share: float, slack: float) -> None:
        self.pace_buffer = pace_buffer
        self.min_read_share = min_read_share
        self.slack = slack
        self.active = False  # pacing acts this step (off in the FCFS fallback)
        self.deadline = -math.inf  # D
        self._left = 0.0  # tokens the fluid engine at Γ would still have to generate
        self._at: float | None = None  # when _left was last drained
        self._accounted: set[str] = set()  # live streams whose work _left includes
        self._end = math.inf  # the uniform schedules' end this step: D with slack
        self._min_s = 0.0  # a held reader's least buffer, in seconds: four steps

    def track(self, streams: Iterable[Stream], now: float, capacity: float, step_s: float, active: bool) -> None:
        """Drain the fluid work at Γ (`capacity`, tok/s) since the last step, add each new stream's work, and set
        D and this step's hold window."""
        capacity = max(capacity, 1e-6)
        if self._at is not None:
            self._left = max(0.0, self._left - capacity * (now - self._at))
        self._at = now
        live = set()
        for s in streams:
            live.add(s.stream_id)
            if s.stream_id not in self._accounted:
                self._left += s.sampling.max_tokens - s.num_output_tokens
        self._accounted = live
        self.deadline = now + self._left / capacity
        self._end = now + (self.deadline - now) * (1 + self.slack)
        self._min_s = 4 * step_s
        self.active = active

    def paced(self, s: Stream, now: float, buffered: float) -> bool:
        """Whether pacing holds this stream back this step (`buffered`: its reader's buffer now, in tokens)."""
        if not self.active or s.rate <= 0 or s.first_token_time is None:
            return False
        length = s.sampling.max_tokens
        if buffered < max(self.pace_buffer * length, s.rate * self._min_s):
            return False
        span = self._end - s.first_token_time
        if s.rate * span < self.min_read_share * length:
            return False
        return s.num_output_tokens >= (length * min(1.0, (now - s.first_token_time) / span) if span > 0 else length)

    def candidates(self, running: Sequence[Stream], now: float) -> list[Stream]:
        """The running streams (decoding, not mid-prefill) that pacing would hold back this step; the policy keeps
        those it may pause."""
        if not self.active:
            return []
        return [s for s in running if s.num_uncomputed_tokens == 1 and self.paced(s, now, s.reader.buffer_at(now))]
