"""When a replica sends a stream's pending tokens: the first at once, later ones grouped by an interval that
adapts to the reader and to the replica's load.

Each streamed item costs about a millisecond of CPU across replica, ingress and proxy (ray-notes §5), so items, not
tokens, are what streaming overhead scales with: all streams share a replica-wide budget of items per second (at
64 streams an item every 50 ms each would take more than the whole CPU of a small box from the engine, which then
feeds every reader late). A paced reader with seconds of tokens in its buffer gains nothing from frequent items
either: its interval may grow to half of its estimated buffer time. Both stay within [min_interval_s,
max_interval_s].
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupingConfig:
    min_interval_s: float = 0.05
    max_interval_s: float = 0.25
    events_per_s: float = 200.0  # replica-wide budget of items per second

    def __post_init__(self) -> None:
        if not 0 <= self.min_interval_s <= self.max_interval_s <= 1:
            raise ValueError("stream intervals: need 0 <= stream_interval_s <= stream_max_interval_s <= 1")
        if self.events_per_s <= 0:
            raise ValueError("stream_events_per_s: must be positive")

    def interval(self, rate: float | None, sent: int, since_first_s: float, active_streams: int) -> float:
        wanted = active_streams / self.events_per_s
        if rate:  # the reader started on the first token; what it has not read yet is its buffer
            wanted = max(wanted, 0.5 * max(0.0, sent / rate - since_first_s))
        return min(self.max_interval_s, max(self.min_interval_s, wanted))


class DeltaGrouper:
    """Per stream: is it time to send what is pending?"""

    def __init__(self, config: GroupingConfig, rate: float | None) -> None:
        self.config, self.rate = config, rate
        self.sent = 0  # tokens sent so far
        self.first_at: float | None = None
        self.last_at: float | None = None

    def due(self, now: float, finished: bool, active_streams: int) -> bool:
        if finished or self.last_at is None:
            return True
        interval = self.config.interval(self.rate, self.sent, now - self.first_at, active_streams)
        return now - self.last_at >= interval

    def sent_now(self, now: float, tokens: int) -> None:
        if self.first_at is None:
            self.first_at = now
        self.sent += tokens
        self.last_at = now
