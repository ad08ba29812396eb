"""Live migration between simulated replicas: the central actor's table and relief policy, driven on the virtual
clock (issue 16 item 3).

The same pure objects as the Serve app, imported, not re-written:
- each replica keeps a `cluster/change_log.py` ChangeLog (streams added, ended, moved out), and every `interval_s`
  its `drain()` batch is applied to one `cluster/stream_table.py` StreamTable, as serve/replica/central_link.py's sync loop
  sends it to serve/control/central.py;
- the same tick runs `cluster/migration_policy.py`'s `plan_relief` over every replica's
  `replica_stats_from_engine(engine).gauges()` (serve/control/central.py's `relieve_now`, with its rule that a source just
  asked is left alone for two intervals), and each relief goes to its source, which picks the streams with
  `pick_streams` between two of its steps (serve/replica/migration.py's `_relieve`);
- a picked stream leaves through the engine's own `begin_export` / `try_export` (an `ExportedStream`), travels,
  and enters the target with `import_stream(exported, elapsed_s)`; the table hears of the move as from
  `CentralScheduler.move_result` (`StreamTable.move`).

A move is not free. The stream is paused (its KV in the source's host store) while its host blocks cross the
network: `MigrationLink.transfer_s` = a fixed per-move latency + KV bytes / network bandwidth. Once imported, the
KV sits in the target's host store and the stream resumes by a load the SimRunner prices on the target's host
link like any other. Its reader keeps reading meanwhile (the reader model travels with it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tokenflow_ray.cluster.change_log import ChangeLog, paced_buffers
from tokenflow_ray.cluster.migration_policy import (
    MigrationSettings,
    Relief,
    ReliefThrottle,
    pick_streams,
    plan_relief,
)
from tokenflow_ray.cluster.replica_stats import replica_stats_from_engine
from tokenflow_ray.cluster.stream_table import StreamTable
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.migration import ExportedStream, StreamNotExportable


@dataclass(frozen=True)
class MigrationLink:
    """The path a moved stream's KV takes between two replicas' host stores.

    bytes_s [our assumption]: a 100 Gb/s Ethernet/RoCE NIC per inference node (12.5 GB/s line rate) at ~88%
    goodput, 11 GB/s; HGX nodes with 400 Gb/s InfiniBand would be 4x faster, so this errs on the costly side.
    latency_s [measured, order of magnitude]: the Serve app's move on the 2-core box takes 3-9 ms from pause to
    hand-off (docs/results/cluster.md, `tokenflow bench migration`): export between steps, Ray's object put, the
    target port's offer and ack. 5 ms per move.
    """

    bytes_s: float = 11e9
    latency_s: float = 5e-3

    def __post_init__(self) -> None:
        if not (self.bytes_s > 0 and self.bytes_s < float("inf")) or not 0 <= self.latency_s < float("inf"):
            raise ValueError("migration link: bytes_s must be a finite number > 0, latency_s finite and >= 0")

    def transfer_s(self, kv_bytes: int) -> float:
        return self.latency_s + kv_bytes / self.bytes_s


@dataclass
class MoveTotals:
    ticks: int = 0
    reliefs: int = 0  # reliefs sent to a source (after the two-interval rule)
    migrations: int = 0  # streams imported on another replica
    taken_back: int = 0  # imports the target refused: the stream went back to its source
    kv_bytes: int = 0
    transfer_s: float = 0.0
    transfer_s_max: float = 0.0
    moved_streams: set[str] = field(default_factory=set)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["moved_streams"] = len(self.moved_streams)
        return out


@dataclass(frozen=True)
class InTransit:
    exported: ExportedStream
    source: int
    target: int
    kv_bytes: int
    transfer_s: float


class ClusterMigration:
    """The central table, each replica's change log, and the moves under way, for one Simulation."""

    def __init__(self, engines: list[LLMEngine], replica_ids: list[str], kv_bytes_per_token: int,
                 settings: MigrationSettings | None = None, link: MigrationLink | None = None,
                 enabled: bool = True) -> None:
        if len(engines) < 2:
            raise ValueError("migration: needs replicas >= 2")
        self.engines = engines
        self.ids = replica_ids
        self.kv_bytes_per_token = kv_bytes_per_token
        self.settings = settings or MigrationSettings()
        self.link = link or MigrationLink()
        self.enabled = enabled  # False: the table is still fed and checked, nothing moves (the comparison run)
        self.table = StreamTable()
        self.logs = [ChangeLog() for _ in engines]
        self.orders: list[list[Relief]] = [[] for _ in engines]  # reliefs a source has yet to act on
        self.exporting: list[list[tuple[str, int]]] = [[] for _ in engines]  # (stream id, target) begun, not out
        self.in_transit: dict[str, InTransit] = {}  # exported, not yet imported (landed ones included)
        self.landed: list[list[tuple[str, bool]]] = [[] for _ in engines]  # (stream id, forward) to import here
        self._throttle = ReliefThrottle(self.settings.interval_s)  # central.relieve_now's, the same class
        self.totals = MoveTotals()

    # ---- what each replica records (serve/replica/server.py's ChangeLog calls) ---------------------------------------
    def added(self, index: int, stream_id: str, rate: float | None) -> None:
        self.logs[index].add(stream_id, rate)

    def finished(self, index: int, stream_id: str) -> None:
        self.logs[index].remove(stream_id)

    # ---- the central actor's tick --------------------------------------------------------------------------------
    def tick(self, now: float) -> list[Relief]:
        """Feed the table one batch per replica, check it, and (when enabled) plan reliefs for the sources."""
        self.totals.ticks += 1
        for i, engine in enumerate(self.engines):
            if self.table.apply_changes(self.ids[i], self.logs[i].drain(self._buffers(engine, now)), now):
                self.logs[i].need_full()
        self.check(now)
        if not self.enabled:
            return []
        gauges = {rid: replica_stats_from_engine(e, wall_time=now).gauges() for rid, e in zip(self.ids, self.engines)}
        sent = self._throttle.admit(plan_relief(gauges, self.ids, self.settings), now)
        for relief in sent:
            self.orders[self.ids.index(relief.source)].append(relief)
        self.totals.reliefs += len(sent)
        return sent

    @staticmethod
    def _buffers(engine: LLMEngine, now: float) -> tuple[tuple[str, float], ...]:
        return paced_buffers(engine.scheduler.streams.values(), now)  # what serve/replica/ sends

    # ---- a replica, between two of its steps ----------------------------------------------------------------------
    def land(self, stream_id: str) -> int:
        """The stream's KV has crossed the network: it waits for its target's next step boundary (an engine takes
        imports between steps, as the replica's engine thread does). Returns the target's index."""
        move = self.in_transit[stream_id]
        self.landed[move.target].append((stream_id, True))
        return move.target

    def at_boundary(self, index: int, now: float, send: Callable[[InTransit, float], None]) -> int:
        """Between two of this replica's steps: import the streams that landed here, act on its reliefs
        (pick_streams, begin_export) and hand over the streams that can leave now (try_export);
        `send(move, arrival_time)` schedules each one's landing on its target. Returns the streams imported."""
        engine = self.engines[index]
        imported = 0
        for sid, forward in self.landed[index]:
            imported += self._import(index, sid, forward, now)
        self.landed[index].clear()
        for relief in self.orders[index]:
            target = self.ids.index(relief.target)
            for sid in self._pick(engine, now, relief):
                engine.begin_export(sid)
                self.exporting[index].append((sid, target))
        self.orders[index].clear()
        waiting = []
        for sid, target in self.exporting[index]:
            try:
                exported = engine.try_export(sid)
            except StreamNotExportable:  # it finished first
                continue
            if exported is None:
                waiting.append((sid, target))  # a copy of its KV is in flight: after the next step
                continue
            self.logs[index].moved_out(sid)
            kv_bytes = exported.num_kv_tokens * self.kv_bytes_per_token
            move = InTransit(exported, index, target, kv_bytes, self.link.transfer_s(kv_bytes))
            self.in_transit[sid] = move
            send(move, now + move.transfer_s)
        self.exporting[index] = waiting
        return imported

    def _pick(self, engine: LLMEngine, now: float, relief: Relief) -> list[str]:
        # serve/control/central.py passes MigrationSettings.move_waiting down with the order; serve/replica/migration.py hands it on.
        return pick_streams(engine.scheduler, now, relief.rate, relief.max_streams, self.settings.move_waiting)

    def _import(self, index: int, stream_id: str, forward: bool, now: float) -> int:
        move = self.in_transit[stream_id]
        exported, elapsed = move.exported, now - move.exported.exported_at
        try:
            self.engines[index].import_stream(exported, elapsed, moved=forward)
        except ValueError:
            if not forward:
                raise  # its own engine refused it back: nothing else could hold it
            # The target cannot hold it: the source takes it back (serve/replica/migration.py's take_back).
            self.landed[move.source].append((stream_id, False))
            self.totals.taken_back += 1
            return 0
        del self.in_transit[stream_id]
        self.logs[index].add(stream_id, exported.rate)
        if forward:
            self.table.move(stream_id, self.ids[move.source], self.ids[move.target])  # central.move_result
            t = self.totals
            t.migrations += 1
            t.kv_bytes += move.kv_bytes
            t.transfer_s += move.transfer_s
            t.transfer_s_max = max(t.transfer_s_max, move.transfer_s)
            t.moved_streams.add(stream_id)
        return 1

    @property
    def busy(self) -> bool:
        return bool(self.in_transit) or any(self.exporting) or any(self.orders) or any(self.landed)

    # ---- checks ---------------------------------------------------------------------------------------------------
    def check(self, now: float) -> None:
        """After a batch: the table's own integrity; each log holds exactly its engine's live streams; the table
        places every live stream at its owner, and a stream in transit at its source until it lands."""
        self.table.check_integrity()
        for i, engine in enumerate(self.engines):
            live = engine.live_stream_ids()
            if set(self.logs[i].live) != live:
                raise AssertionError(f"{self.ids[i]} at {now:.3f}: change log {len(self.logs[i].live)} streams, "
                                     f"engine {len(live)}: {sorted(live ^ set(self.logs[i].live))[:5]}")
            for sid in live:
                if self.table.owner(sid) != self.ids[i]:
                    raise AssertionError(f"{sid} lives on {self.ids[i]}, the table says {self.table.owner(sid)}")
        for sid, move in self.in_transit.items():
            if self.table.owner(sid) != self.ids[move.source]:
                raise AssertionError(f"{sid} in transit: the table says {self.table.owner(sid)}")
        owned = sum(r["streams"] for r in self.table.summary().values())
        expected = sum(len(log.live) for log in self.logs) + len(self.in_transit)
        if owned != expected:
            raise AssertionError(f"table holds {owned} live streams, the replicas and the network {expected}")
