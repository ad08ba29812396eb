"""The central actor's part in stopping the app (the whole protocol: serve/replica/stopping.py): `CentralStop`,
mixed into CentralScheduler, hands every replica a `StopOrder` on its report long-poll and answers once each took it.
"""

from __future__ import annotations

import asyncio
import logging

from tokenflow_ray.cluster.messages import StopOrder

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
