"""Stopping the whole app cleanly (`tokenflow serve` on SIGTERM or Ctrl-C), in two mixins' worth of code:

- the driver asks the app's central actor to `stop_serving` (serve/lifecycle.py);
- the central actor hands every replica a `StopOrder` on its report long-poll (the channel it already keeps open to
  each replica) and answers once each has taken it: `CentralStop` (serve/control/stopping.py), mixed into CentralScheduler;
- a replica that took the order refuses new streams (503 `server_shutting_down`, before any SSE header) and ends
  each live one with `ServerStopping`, which the HTTP layer turns into an OpenAI-shaped error event and `[DONE]`
  (serve/http/ingress.py, errors.py): `ReplicaStopping`, here, mixed into LLMServer. A stream waiting for a step
  (queued, paused) is woken by a tick, so it ends at once too, not when its next token would have come.

Serve's own graceful shutdown, which comes next, then finds no request to wait for. Without the order a stopping
replica would keep every stream open until Serve's graceful timeout and then cut the connections with no event.
"""

from __future__ import annotations

import logging

from tokenflow_ray.cluster.messages import StopOrder
from tokenflow_ray.serve.http.errors import ServerStopping

log = logging.getLogger(__name__)


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
