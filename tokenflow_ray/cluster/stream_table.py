"""StreamTable: the central scheduler's live-stream table, and the reports it owes each replica.

Replicas own their streams; the table is the cluster's view of them, kept from two sources:
- replicas send `ReplicaChanges` in batches (streams added and removed, the reports they applied themselves, each
  stream's reader buffer), or a full snapshot of their live streams when the table has none of theirs: after the
  central actor restarts the table is rebuilt from those snapshots, nothing is kept in the actor alone;
- reports that reached the cluster somewhere other than the owning replica (a non-owner replica, the ingress) are
  queued here for the owner, coalesced per stream, and taken by the owner's next poll: one batch per replica per
  interval, however many readers reported.

It prices nothing itself: what a report changes (a reader's rate, pause, consumed count) is applied by the owning
replica's scheduler, which reranks the stream on its next step. The table's summary (per replica: live streams,
Σ declared rate, streams short of buffer) is what the router and the autoscaler read across replicas.

Pure Python (no ray): serve/control/central.py is the actor around it, the simulator drives it directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenflow_ray.cluster.messages import Report


@dataclass(frozen=True)
class ReplicaChanges:
    """One replica's batch since its last one (full=True: `added` is all its live streams; nothing else is)."""

    full: bool = False
    added: tuple[tuple[str, float | None], ...] = ()  # (stream id, declared rate)
    removed: tuple[str, ...] = ()
    reports: tuple[Report, ...] = ()  # reports the replica received and applied itself
    buffers: tuple[tuple[str, float], ...] = ()  # (stream id, reader buffer in seconds) of running paced streams

    @property
    def empty(self) -> bool:
        return not (self.full or self.added or self.removed or self.reports or self.buffers)


@dataclass
class StreamEntry:
    replica_id: str
    rate: float | None
    last_report: Report | None = None
    last_report_t: float | None = None
    buffer_s: float | None = None  # the owner's latest estimate of its reader's buffer


def merge_reports(older: Report, newer: Report) -> Report:
    """One report with the newest value of each field: what the owner would end with applying both in order."""
    return Report(newer.stream_id,
                  newer.consumed_tokens if newer.consumed_tokens is not None else older.consumed_tokens,
                  newer.rate if newer.rate is not None else older.rate,
                  newer.paused if newer.paused is not None else older.paused)


@dataclass(frozen=True)
class TableSettings:
    finished_memory: int = 4096  # recently finished ids kept, so late reports for them are refused at once
    dropped_memory: int = 1024
    critical_buffer_s: float = 1.0  # a running paced reader with less buffered than this is short of buffer

    def __post_init__(self) -> None:
        if self.finished_memory < 1 or self.dropped_memory < 1:
            raise ValueError("finished_memory/dropped_memory: must be >= 1")
        if not self.critical_buffer_s >= 0:
            raise ValueError("critical_buffer_s: must be >= 0")


@dataclass
class StreamTable:
    settings: TableSettings = field(default_factory=TableSettings)
    streams: dict[str, StreamEntry] = field(default_factory=dict)
    finished: OrderedDict[str, None] = field(default_factory=OrderedDict)
    replicas: set[str] = field(default_factory=set)  # replicas whose streams the table holds (or that have none)
    dropped: OrderedDict[str, None] = field(default_factory=OrderedDict)
    pushes: dict[str, dict[str, Report]] = field(default_factory=dict)  # owner -> stream id -> coalesced report

    # ---- from replicas ------------------------------------------------------------------------------------------
    def knows_replica(self, replica_id: str) -> bool:
        return replica_id in self.replicas

    def apply_changes(self, replica_id: str, changes: ReplicaChanges, now: float) -> bool:
        """Apply one replica's batch; True when the table needs a full snapshot from it first (nothing applied)."""
        if not changes.full and replica_id not in self.replicas:
            return True
        self.replicas.add(replica_id)
        self.dropped.pop(replica_id, None)
        if changes.full:
            for sid in [s for s, e in self.streams.items() if e.replica_id == replica_id]:
                del self.streams[sid]
        for sid, rate in changes.added:
            if sid in self.finished:  # its end was reported first (batches from two paths): it stays finished
                continue
            entry = self.streams.get(sid)
            if entry is None or entry.replica_id != replica_id:
                self.streams[sid] = StreamEntry(replica_id, rate)
            else:
                entry.rate = rate
        for report in changes.reports:
            entry = self.streams.get(report.stream_id)
            if entry is not None:
                self._record(entry, report, now)
        for sid, buffer_s in changes.buffers:
            entry = self.streams.get(sid)
            if entry is not None:
                entry.buffer_s = buffer_s
        for sid in changes.removed:
            self.finish(sid)
        return False

    def finish(self, stream_id: str) -> None:
        entry = self.streams.pop(stream_id, None)
        if entry is not None:
            self.pushes.get(entry.replica_id, {}).pop(stream_id, None)
        self.finished[stream_id] = None
        self.finished.move_to_end(stream_id)
        while len(self.finished) > self.settings.finished_memory:
            self.finished.popitem(last=False)

    def move(self, stream_id: str, source: str, target: str) -> None:
        """A stream migrated from source to target: reports queued for the source follow it."""
        entry = self.streams.get(stream_id)
        if stream_id in self.finished or (entry is not None and entry.replica_id != source):
            return  # it ended, or the target's registration came first: nothing to redirect
        self.replicas.add(target)
        if entry is None:
            self.streams[stream_id] = StreamEntry(target, None)
            return
        entry.replica_id = target
        queued = self.pushes.get(source, {}).pop(stream_id, None)
        if queued is not None:
            self.pushes.setdefault(target, {})[stream_id] = queued

    def drop_replica(self, replica_id: str) -> int:
        """Forget a dead replica's entries and pending reports (not marked finished: if it was alive after all,
        its next batch finds the table without it and sends a full snapshot). Returns the entries dropped."""
        sids = [sid for sid, e in self.streams.items() if e.replica_id == replica_id]
        for sid in sids:
            del self.streams[sid]
        self.pushes.pop(replica_id, None)
        self.replicas.discard(replica_id)
        self.dropped[replica_id] = None
        while len(self.dropped) > self.settings.dropped_memory:
            self.dropped.popitem(last=False)
        return len(sids)

    # ---- reports from elsewhere ---------------------------------------------------------------------------------
    def report(self, report: Report, now: float) -> str | None:
        """Queue a report for its owner; the owner's id, or None when the stream is unknown or finished."""
        entry = self.streams.get(report.stream_id)
        if entry is None:
            return None
        self._record(entry, report, now)
        queue = self.pushes.setdefault(entry.replica_id, {})
        queued = queue.get(report.stream_id)
        queue[report.stream_id] = report if queued is None else merge_reports(queued, report)
        return entry.replica_id

    def has_pushes(self, replica_id: str) -> bool:
        return bool(self.pushes.get(replica_id))

    def take_pushes(self, replica_id: str) -> list[Report]:
        return list(self.pushes.pop(replica_id, {}).values())

    @staticmethod
    def _record(entry: StreamEntry, report: Report, now: float) -> None:
        entry.last_report = report if entry.last_report is None else merge_reports(entry.last_report, report)
        entry.last_report_t = now
        if report.rate is not None:
            entry.rate = report.rate

    # ---- the global view ----------------------------------------------------------------------------------------
    def is_finished(self, stream_id: str) -> bool:
        return stream_id in self.finished

    def owner(self, stream_id: str) -> str | None:
        entry = self.streams.get(stream_id)
        return None if entry is None else entry.replica_id

    def summary(self, replica_ids: Iterable[str] = ()) -> dict[str, dict[str, float]]:
        """Per replica (every known one, plus `replica_ids`): live streams, Σ declared rate, streams short of
        buffer. A stream without a declared rate counts 0 toward Σ rate (its replica's default is not known here)."""
        out = {rid: {"streams": 0, "sum_rate": 0.0, "short_of_buffer": 0} for rid in (*self.replicas, *replica_ids)}
        for entry in self.streams.values():
            row = out.setdefault(entry.replica_id, {"streams": 0, "sum_rate": 0.0, "short_of_buffer": 0})
            row["streams"] += 1
            row["sum_rate"] += entry.rate or 0.0
            if entry.buffer_s is not None and entry.buffer_s < self.settings.critical_buffer_s:
                row["short_of_buffer"] += 1
        return out

    def view(self) -> dict[str, dict]:
        return {sid: {"replica_id": e.replica_id, "rate": e.rate, "buffer_s": e.buffer_s,
                      "last_report": None if e.last_report is None else vars(e.last_report)}
                for sid, e in self.streams.items()}

    def check_integrity(self) -> None:
        for sid, entry in self.streams.items():
            assert entry.replica_id in self.replicas, f"{sid}: owner {entry.replica_id} unknown"
            assert sid not in self.finished, f"{sid}: both live and finished"
        for rid, queue in self.pushes.items():
            for sid in queue:
                assert self.owner(sid) == rid, f"report for {sid} queued for {rid}, not its owner"
