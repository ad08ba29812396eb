"""When a paced client's consumption report carries news for the server.

The server models each reader from its declared rate and the tokens it sent (metrics/reader.py), and a report
replaces that model from the report's time on (docs/design.md §6.1). So a report tells
the server something only where the reader departs from the model: it paused, read slower or faster than it
declared, or caught up after a gap. The client keeps a mirror of the server's model, fed the tokens as they arrive
and reset by each report it sends, and reports when its reader and the mirror differ by `drift_s` seconds of
reading (at least one token). A reader that keeps to its declared rate sends none.

Why not a report every interval: each one is a full HTTP request through the proxy and the replica. In the served
demo on a 2-core box, one report a second per stream cost about 25 ms of CPU each across client, proxy and
replica, and the buffer-aware policy, which keeps every stream open while it is read, lost 45% of its raw
throughput to them (README's "Demo" results at commit 1a5a8e0).
"""

from __future__ import annotations

import math

from tokenflow_ray.metrics.reader import ReaderModel


def check_drift_s(drift_s: float | None) -> None:
    if drift_s is not None and not (math.isfinite(drift_s) and drift_s >= 0):
        raise ValueError(f"report drift: must be a finite number >= 0 or None, got {drift_s!r}")


class ReportTrigger:
    """Per stream. Times are the client's clock, non-decreasing across calls."""

    def __init__(self, rate: float, drift_s: float | None) -> None:
        """drift_s: seconds of reading the reader may be off the mirror before a report; None: report every time
        `due` is asked (the check interval alone paces reports)."""
        check_drift_s(drift_s)
        self.mirror = ReaderModel(rate)
        self.threshold = None if drift_s is None else max(1.0, rate * drift_s)

    def on_tokens(self, t: float, n: int) -> None:
        self.mirror.on_tokens(t, n)

    def due(self, t: float, consumed: int) -> bool:
        """Does a report of `consumed` at `t` tell the server something its model does not already hold?"""
        if self.mirror.generated == 0:
            return False  # before the first token nothing is read: the model and the reader agree
        return self.threshold is None or abs(self.mirror.consumed_at(t) - consumed) >= self.threshold

    def reported(self, t: float, consumed: int) -> None:
        """The server now holds `consumed` at `t`: the mirror follows it from there."""
        self.mirror.apply_report(t, consumed_tokens=consumed)
