"""Stopping the whole app cleanly (`tokenflow serve` on SIGTERM or Ctrl-C), in three mixins' worth of code:

- the driver asks the app's central actor to `stop_serving` (serve/lifecycle.py);
- the central actor hands every replica a `StopOrder` on its report long-poll (the channel it already keeps open to
  each replica) and answers once each has taken it: `CentralStop`, mixed into CentralScheduler;
- a replica that took the order refuses new streams (503 `server_shutting_down`, before any SSE header) and ends
  each live one with `ServerStopping`, which the HTTP layer turns into an OpenAI-shaped error event and `[DONE]`
  (ingress.py, errors.py): `ReplicaStopping`, mixed into LLMServer. A stream waiting for a step (queued, paused)
  is woken by a tick, so it ends at once too, not when its next token would have come.

Serve's own graceful shutdown, which comes next, then finds no request to wait for. Without the order a stopping
replica would keep every stream open until Serve's graceful timeout and then cut the connections with no event.
"""

from __future__ import annotations

import asyncio
import logging

from tokenflow_ray.serve.errors import ServerStopping
from tokenflow_ray.serve.messages import StopOrder

log = logging.getLogger(__name__)


class CentralStop:
    """Uses CentralScheduler's `heard` (known replicas), `_orders`, `_wake` and `_taken`."""

    stopping: str | None = None  # the reason, once stop_serving was called
    _stop_told: frozenset[str] = frozenset()  # replicas whose stop order is queued or taken

    async def stop_serving(self, reason: str = "shutting down", timeout_s: float = 5.0) -> int:
        """Order every known replica to stop serving; returns once each took its order (or after timeout_s).
        Returns how many replicas were told. A replica that polls later gets the order then (`_stop_pending`)."""
        self.stopping = reason
        told = list(self.heard)
        waits = []
        for rid in told:
            self._stop_pending(rid)
            waits.append(self._taken.setdefault(rid, asyncio.Event()).wait())
            wake = self._wake.get(rid)
            if wake is not None:
                wake.set()
        if waits:
            try:
                await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
            except asyncio.TimeoutError:
                log.warning("stop_serving: not every replica took its stop order within %.1f s", timeout_s)
        return len(told)

    def _stop_pending(self, replica_id: str) -> None:
        """Queue the stop order for this replica once (called by stop_serving and on each long-poll)."""
        if self.stopping is None:
            return
        if replica_id not in self._stop_told:
            self._stop_told = self._stop_told | {replica_id}
            self._orders.setdefault(replica_id, []).append(StopOrder(self.stopping))


class ReplicaStopping:
    """Uses LLMServer's `aengine` and `changes` (its live streams)."""

    _stopping: str | None = None  # the reason, once a StopOrder came

    def _stop_serving(self, order: StopOrder) -> None:
        """From now on: new streams are refused, live ones end with ServerStopping (at their next output or tick)."""
        if self._stopping is not None:
            return
        self._stopping = order.reason
        live = list(self.changes.live)
        log.info("replica stopping (%s): ending %d live stream(s)", order.reason, len(live))
        for sid in live:
            self.aengine.tick(sid)

    def _check_stopping(self) -> None:
        if self._stopping is not None:
            raise ServerStopping(self._stopping)
