"""An LLMServer replica's link to the central actor (serve/control/central.py): consumption reports, and the
central table kept current.

Reports for the replica's own streams are applied on the engine thread the moment they arrive (`apply_report`);
reports that reached the cluster elsewhere come through the central actor's long-poll (`_poll_loop`), with the
actor's orders (move, relieve, stop). Either way the central table hears of every stream and report in batches
(cluster/change_log.py, `_sync_loop`), off the token path.

A mixin: it uses the replica's engine (`engine`, `aengine`), settings, change log, central actor handle, `port`,
`_relayed` and the migration and stopping mixins' handlers, set in LLMServer.__init__.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tokenflow_ray.cluster.change_log import paced_buffers
from tokenflow_ray.cluster.messages import MoveOrder, RelieveOrder, Report, StopOrder

log = logging.getLogger(__name__)


class CentralLink:
    """Reports in, the central table kept current, the central actor's orders taken."""

    async def apply_report(self, report: Report) -> bool:
        """A report for one of this replica's streams, applied now; False if the stream is unknown or finished.
        A report the reader model refuses (e.g. more consumed than was generated) raises ValueError."""
        def apply() -> bool:  # engine thread
            try:
                self.engine.report_consumption(report.stream_id, report.consumed_tokens, report.rate, report.paused)
            except LookupError:
                return False
            return True

        known = await self.aengine.call(apply)
        if known:
            self.changes.reported(report)
        return known

    async def _poll_loop(self) -> None:
        last_stats = 0.0
        while True:
            try:
                stats = None
                if time.monotonic() - last_stats >= self.settings.stats_interval_s:
                    stats, last_stats = await self._stats_snapshot(), time.monotonic()
                reports = await self.central.wait_reports.remote(self.replica_id, stats)
                for order in [r for r in reports if isinstance(r, MoveOrder)]:
                    self._spawn(self._migrate_out(order))
                for order in [r for r in reports if isinstance(r, RelieveOrder)]:
                    self._spawn(self._relieve(order))
                for order in [r for r in reports if isinstance(r, StopOrder)]:
                    self._stop_serving(order)
                reports = [r for r in reports if isinstance(r, Report)]
                for r in [r for r in reports if r.stream_id in self._relayed]:
                    self._relayed[r.stream_id].report.remote(r)  # it moved on: forward it
                if reports:
                    await self.aengine.call(lambda rs=reports: self._apply(rs))
                    for r in reports:
                        self.changes.reported(r)
            except asyncio.CancelledError:
                raise
            except Exception:  # the central actor is restarting: the sync loop resends a full snapshot
                log.warning("report poll failed; retrying", exc_info=True)
                self.changes.need_full()
                await asyncio.sleep(0.5)

    def _apply(self, reports: list[Report]) -> None:  # engine thread
        for r in reports:
            try:
                self.engine.report_consumption(r.stream_id, r.consumed_tokens, r.rate, r.paused)
            except (LookupError, ValueError) as exc:  # finished meanwhile, or ahead of what was generated
                log.debug("report for %s dropped: %s", r.stream_id, exc)

    async def _sync_loop(self) -> None:
        """One batch of changes per interval to the central table; a full snapshot whenever it lost track.

        Batches are not awaited one by one: a slow actor must not delay the next batch (registrations would pile
        up behind it). Order does not matter to the table: a stream's end that overtakes its registration marks
        it finished, and the late registration is then ignored (StreamTable.apply_changes)."""
        interval = self.settings.sync_interval_s
        sending: set[asyncio.Task] = set()
        while True:
            await asyncio.sleep(interval)
            if not self.changes.pending:
                continue
            changes = self.changes.drain(await self.aengine.call(self._buffers))
            task = asyncio.get_running_loop().create_task(self._send(changes))
            sending.add(task)
            task.add_done_callback(sending.discard)

    async def _send(self, changes) -> None:
        try:
            if await self.central.update.remote(self.replica_id, changes):
                self.changes.need_full()  # the table was emptied (a restart): the next batch rebuilds it
                if self.port is not None:
                    await self.central.register_port.remote(self.replica_id, self.port)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("central table update failed; the next one is a full snapshot", exc_info=True)
            self.changes.need_full()

    def _buffers(self) -> tuple[tuple[str, float], ...]:  # engine thread
        return paced_buffers(self.engine.scheduler.streams.values(), self.engine.clock.now())
