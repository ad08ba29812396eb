"""ChangeLog: what a replica owes the central table since its last batch (cluster/stream_table.py).

The replica records every stream it adds and ends and every report it applies, and sends the lot in one batch per
interval. When a batch fails (the central actor is down) or the table asks for it (a restart emptied it), the next
batch is a full snapshot of the live streams instead, so the table is rebuilt from the replicas themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenflow_ray.cluster.messages import Report
from tokenflow_ray.cluster.stream_table import ReplicaChanges, merge_reports


@dataclass
class ChangeLog:
    live: dict[str, float | None] = field(default_factory=dict)  # stream id -> declared rate
    _added: dict[str, float | None] = field(default_factory=dict)
    _removed: list[str] = field(default_factory=list)
    _reports: dict[str, Report] = field(default_factory=dict)
    _full: bool = True  # the first batch is a snapshot: the table may know nothing of this replica

    def add(self, stream_id: str, rate: float | None) -> None:
        self.live[stream_id] = rate
        self._added[stream_id] = rate

    def remove(self, stream_id: str) -> None:
        if self.live.pop(stream_id, ...) is ...:
            return
        self._reports.pop(stream_id, None)
        self._added.pop(stream_id, None)  # added and ended within one batch: the table only learns it ended
        self._removed.append(stream_id)

    def moved_out(self, stream_id: str) -> None:
        """The stream went to another replica, unfinished: the table hears it from there (central.moved), and
        it is not sent as ended from here."""
        self.live.pop(stream_id, None)
        self._added.pop(stream_id, None)
        self._reports.pop(stream_id, None)

    def reported(self, report: Report) -> None:
        if report.stream_id not in self.live:
            return
        if report.rate is not None:
            self.live[report.stream_id] = report.rate
        queued = self._reports.get(report.stream_id)
        self._reports[report.stream_id] = report if queued is None else merge_reports(queued, report)

    def need_full(self) -> None:
        """The next batch is a snapshot (the last one failed, or the table asked for one)."""
        self._full = True

    @property
    def pending(self) -> bool:
        return self._full or bool(self._added or self._removed or self._reports)

    def drain(self, buffers: tuple[tuple[str, float], ...] = ()) -> ReplicaChanges:
        """The batch to send now; the log starts over (call need_full() if sending it fails)."""
        if self._full:
            changes = ReplicaChanges(full=True, added=tuple(self.live.items()),
                                     reports=tuple(self._reports.values()), buffers=buffers)
        else:
            changes = ReplicaChanges(added=tuple(self._added.items()), removed=tuple(self._removed),
                                     reports=tuple(self._reports.values()), buffers=buffers)
        self._full = False
        self._added, self._removed, self._reports = {}, [], {}
        return changes


def paced_buffers(streams: Iterable, now: float) -> tuple[tuple[str, float], ...]:
    """(stream id, reader buffer in seconds) of the paced streams that have started: what a replica's batch
    carries as `buffers` (engine thread; the simulator sends the same)."""
    return tuple((s.stream_id, s.buffer_s(now)) for s in streams if s.rate > 0 and s.reader.generated > 0)
