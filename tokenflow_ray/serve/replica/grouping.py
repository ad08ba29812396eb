"""When a replica sends a stream's pending tokens: the first at once, later ones grouped by an interval that
adapts to the reader and to the replica's load.

Each streamed item costs about a millisecond of CPU across replica, ingress and proxy (ray-notes §5), so items, not
tokens, are what streaming overhead scales with: all streams share a replica-wide budget of items per second (at
64 streams an item every 50 ms each would take more than the whole CPU of a small box from the engine, which then
feeds every reader late). A paced reader with seconds of tokens in its buffer gains nothing from frequent items
either: its interval may grow to half of its estimated buffer time. Both stay within [min_interval_s,
max_interval_s].

While a stream's tokens come faster than its reader reads them, the budget never makes the reader wait past its
buffer: it stretches the interval only while what the reader holds covers the wait with `min_interval_s` to spare
(delivery through proxy and client). That is when grouping alone decides whether the reader stalls: the buffer is
about to grow (a stream's start, a resume), and a group held past it is time the reader could have been reading.
Stretched whatever the buffer, the budget's interval was the largest part of the served demo's stall: with 48
streams, 0.32 s right after each first token, when the reader held one token (62 ms at 16 tok/s); 34 of 48 readers
stalled there, 14.5 s of the run's 28.9 s. A stream made slower than it is read keeps the budget's interval: its
reader waits for tokens whatever the grouping (its stall is set by the rate tokens come at), and items beyond the
budget only take CPU from the engine. Sent early there too, an overloaded routing burst (`tokenflow bench routing
--pin-cpus`, 52.5 tok/s readers) lost a quarter of its raw throughput and doubled its stall.

Tokens held for a group go out when due even if the stream makes no new token by then (a paused stream): the
replica's flusher asks `DeltaGrouper.flush_due`.
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

    def interval(self, rate: float | None, sent: int, since_first_s: float, active_streams: int,
                 outpacing: bool = False) -> float:
        """`outpacing`: the stream's tokens are coming at least as fast as its reader reads (module docstring)."""
        share = active_streams / self.events_per_s  # this stream's share of the replica's item budget
        if rate:  # the reader started on the first token; what it has not read yet is its buffer
            buffer_s = max(0.0, sent / rate - since_first_s)
            wanted = max(0.5 * buffer_s, min(share, buffer_s - self.min_interval_s) if outpacing else share)
        else:
            wanted = share
        return min(self.max_interval_s, max(self.min_interval_s, wanted))


class DeltaGrouper:
    """Per stream: the tokens held, and whether it is time to send them."""

    def __init__(self, config: GroupingConfig, rate: float | None) -> None:
        self.config, self.rate = config, rate
        self.sent = 0  # tokens sent so far
        self.held = 0  # tokens made and not sent yet
        self.first_at: float | None = None
        self.last_at: float | None = None

    def hold(self, tokens: int) -> None:
        self.held += tokens

    def _interval(self, now: float, active_streams: int) -> float:
        # Held tokens made since the last send at the reader's rate or faster: its buffer is about to grow.
        outpacing = bool(self.rate) and self.held >= self.rate * (now - self.last_at)
        return self.config.interval(self.rate, self.sent, now - self.first_at, active_streams, outpacing)

    def due(self, now: float, finished: bool, active_streams: int) -> bool:
        if finished or self.last_at is None:
            return True
        return now - self.last_at >= self._interval(now, active_streams)

    def flush_due(self, now: float, active_streams: int) -> bool:
        """Tokens are held and their group is due: send them without waiting for a next output."""
        return self.held > 0 and self.due(now, False, active_streams)

    def sent_now(self, now: float) -> None:
        """Everything held was sent at `now`."""
        if self.first_at is None:
            self.first_at = now
        self.sent += self.held
        self.held = 0
        self.last_at = now
