"""The central scheduling actor: the cluster's live-stream table (cluster/stream_table.py) as a named Ray actor.

What it does, and what it never does:
- Replicas send it their changes in batches (`update`: streams added/removed, the reports they applied, buffers),
  fire and forget: a stream's first token never waits for it, and a replica's own reports are applied by the
  replica before the actor hears of them, so nothing a reader reported depends on the actor being up.
- A report that reached the cluster elsewhere than the stream's owner (the ingress, another replica) comes here
  (`report`) and is pushed to the owner: each replica keeps one `wait_reports(replica_id, stats)` long-poll open,
  answered with the reports queued for it, coalesced per stream and batched over `push_interval_s`. The same call
  carries the replica's stats here, which /metrics, routing and autoscaling read (`stats`, `summary`).
- Registration is batched, so a report can arrive before its stream's registration does: `report` waits for it
  up to `register_grace_s` (up to `rebuild_grace_s` after a restart, while the replicas' snapshots come in).
- It is named, detached and restartable (`max_restarts=-1`). After a restart its table is empty; each replica's
  next batch is answered "send everything" and its full snapshot rebuilds the table. Callers of `report` retry
  across the restart (serve/http/ingress.py), and a forwarded report is answered only once its owner took it, so a report
  sent during the gap, or queued here when the actor died, is delivered late, not lost.

A replica Serve is stopping (scale-down; its graceful shutdown waits for its requests) is drained when migration
is on: the actor polls Serve's replica states (serve_replicas.py) and moves each of its streams to the other
replicas (`drain`, `migration_policy.plan_drain`), again each poll for any left. In the ingress placement the
ingress follows a moved stream to its new replica, so the stopping one is left with nothing to wait for; in the
direct placement it still relays the moved streams' responses, so there the drain only frees its engine.

A dead replica never sends its removals. The ingress ends each stream it saw fail with the replica; the rest goes
when the replica has not been heard from (a poll or a batch) for `stale_after_s`: a sweep drops it. A replica that
was only slow finds itself unknown at its next batch and sends a full snapshot, so its streams come back.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import ray

from tokenflow_ray.cluster.messages import MoveOrder, RelieveOrder, Report
from tokenflow_ray.cluster.migration_policy import (
    MigrationSettings,
    Relief,
    ReliefThrottle,
    choose_target,
    plan_drain,
    plan_relief,
)
from tokenflow_ray.cluster.stream_table import ReplicaChanges, StreamTable, TableSettings
from tokenflow_ray.serve.control.serve_replicas import stopping_replicas
from tokenflow_ray.serve.control.stopping import CentralStop


@dataclass(frozen=True)
class CentralSettings:
    """Where the actor lives and how it behaves; whichever deployment creates it first passes these."""

    name: str
    namespace: str
    poll_s: float = 1.0  # a replica's report long-poll returns after this long without reports
    push_interval_s: float = 0.05  # reports for one replica are gathered this long before they are pushed
    register_grace_s: float = 2.0  # a report for an unregistered id waits this long for its registration
    # A restarted actor's table fills as the replicas' full snapshots come in, which takes longer than a
    # registration on a loaded box: for this long after a restart a report for an id it has not heard of waits
    # up to the end of this window instead (a clean-clone CI run answered 404 to a live stream's report).
    rebuild_grace_s: float = 10.0
    # A forwarded report is answered once its owner took it (so a restart before then fails the call, and the
    # caller's retry delivers it), or after this long (the owner is dead: its streams are gone anyway).
    deliver_timeout_s: float = 5.0
    finished_memory: int = 4096  # recently finished ids kept, so reports for them are refused at once
    stale_after_s: float = 10.0  # a replica silent this long (10 polls) is taken for dead and dropped
    migration: MigrationSettings | None = None  # None: no automatic moves (migrate() still works)
    # With migration: how often Serve's replica states are read for replicas to drain (a stopping replica checks
    # its ongoing requests every 2 s).
    drain_poll_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("poll_s", "push_interval_s", "register_grace_s", "rebuild_grace_s", "deliver_timeout_s",
                     "stale_after_s", "drain_poll_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and value < float("inf")):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if self.poll_s <= 0 or self.stale_after_s <= 0 or self.drain_poll_s <= 0:
            raise ValueError("poll_s/stale_after_s/drain_poll_s: must be > 0")


class CentralScheduler(CentralStop):
    """The actor's class (created with ACTOR_OPTIONS by get_central; tests use it directly)."""

    def __init__(self, settings: CentralSettings | None = None) -> None:
        self.settings = settings or CentralSettings("central", "tokenflow")
        self.table = StreamTable(TableSettings(finished_memory=self.settings.finished_memory))
        self.heard: dict[str, float] = {}  # replica id -> monotonic time of its last poll or batch
        self.replica_stats: dict[str, tuple[float, dict]] = {}
        self._arrivals: dict[str, asyncio.Event] = {}  # ids that reports are waiting on
        self._wake: dict[str, asyncio.Event] = {}  # a replica's long-poll: reports are queued for it
        self._taken: dict[str, asyncio.Event] = {}  # set when a replica takes the reports queued for it so far
        self._sweeper: asyncio.Task | None = None
        self._mover: asyncio.Task | None = None
        self._drainer: asyncio.Task | None = None
        self.draining: set[str] = set()  # replicas Serve is stopping: they give streams, never take them
        self._throttle = ReliefThrottle(self.settings.migration.interval_s if self.settings.migration else 1.0)
        self.policy_on = True  # the migration policy acts (set_migration: benchmarks compare with and without)
        self.counts = {"batches": 0, "full_snapshots": 0, "reports_pushed": 0, "pushes": 0, "migrations": 0,
                       "migrations_failed": 0}
        self.ports: dict[str, object] = {}  # replica id -> its StreamPort (replicas that take migrated streams)
        self._orders: dict[str, list[MoveOrder]] = {}  # moves a replica is to make, taken with its next poll
        self._move_waiters: dict[str, asyncio.Future] = {}
        self.moves: deque[dict] = deque(maxlen=1024)  # the latest moves: reason, timing (metrics, bench)
        self.restarted = _restarted()  # by Ray, after this actor died: its table is rebuilt from snapshots
        # Until then an unknown id is more likely a live stream not yet resent than a finished or bogus one.
        self.rebuilding_until = time.monotonic() + self.settings.rebuild_grace_s if self.restarted else 0.0

    def _heard_from(self, replica_id: str) -> None:
        self.heard[replica_id] = time.monotonic()
        if self._sweeper is None or self._sweeper.done():  # lazily: __init__ may run outside the actor's loop
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())
        if self.settings.migration is not None and (self._mover is None or self._mover.done()):
            self._mover = asyncio.get_running_loop().create_task(self._migration_loop())
        if self.settings.migration is not None and (self._drainer is None or self._drainer.done()):
            self._drainer = asyncio.get_running_loop().create_task(self._drain_loop())

    def _arrived(self, stream_id: str) -> None:
        event = self._arrivals.pop(stream_id, None)
        if event is not None:
            event.set()

    # ---- from replicas ------------------------------------------------------------------------------------------
    async def update(self, replica_id: str, changes: ReplicaChanges) -> bool:
        """A replica's batch; True asks it for a full snapshot (the table has none of its streams: a restart)."""
        self._heard_from(replica_id)
        need_full = self.table.apply_changes(replica_id, changes, time.time())
        if not need_full:
            self.counts["batches"] += 1
            self.counts["full_snapshots"] += changes.full
            for sid, _ in changes.added:
                self._arrived(sid)
            for sid in changes.removed:
                self._arrived(sid)  # a report waiting on it answers "finished" now, not after the grace
        return need_full

    async def wait_reports(self, replica_id: str, stats: dict | None = None) -> list:
        """The replica's long-poll: the reports (and move and stop orders) queued for it, after at most poll_s."""
        self._heard_from(replica_id)
        self._stop_pending(replica_id)
        if stats is not None:
            self.replica_stats[replica_id] = (time.time(), stats)
        if not self.table.has_pushes(replica_id) and not self._orders.get(replica_id):
            event = self._wake.setdefault(replica_id, asyncio.Event())
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), self.settings.poll_s)
            except asyncio.TimeoutError:
                return []
            # Gather whatever else arrives for this replica within the push interval: one batch, not one each.
            await asyncio.sleep(self.settings.push_interval_s)
        reports: list = self.table.take_pushes(replica_id)
        reports.extend(self._orders.pop(replica_id, ()))
        taken = self._taken.pop(replica_id, None)
        if taken is not None:
            taken.set()
        if reports:
            self.counts["pushes"] += 1
            self.counts["reports_pushed"] += len(reports)
        return reports

    # ---- reports that did not reach their owner -----------------------------------------------------------------
    async def report(self, report: Report) -> bool:
        """Queue a client's report for the owning replica; False if the stream is unknown or finished."""
        if self.table.owner(report.stream_id) is None:
            await self._await_registration(report.stream_id)
        owner = self.table.report(report, time.time())
        if owner is None:
            return False
        wake = self._wake.get(owner)
        if wake is not None:
            wake.set()
        taken = self._taken.setdefault(owner, asyncio.Event())
        try:
            await asyncio.wait_for(taken.wait(), self.settings.deliver_timeout_s)
        except asyncio.TimeoutError:
            pass
        return True

    async def _await_registration(self, stream_id: str) -> None:
        """Registration is batched, so a report (or a move) right after the first token can get here first; or
        the id never existed: wait for it, bounded by register_grace_s (or, after a restart, by the end of the
        rebuild_grace_s window: the table is then rebuilt from snapshots that come when the replicas notice)."""
        grace = max(self.settings.register_grace_s, self.rebuilding_until - time.monotonic())
        if self.table.is_finished(stream_id) or grace <= 0:
            return
        event = self._arrivals.setdefault(stream_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), grace)
        except asyncio.TimeoutError:
            if self._arrivals.get(stream_id) is event:
                del self._arrivals[stream_id]

    async def deregister(self, stream_id: str) -> None:
        """A stream that ended where its replica could not say so (the ingress saw the replica die)."""
        self.table.finish(stream_id)
        self._arrived(stream_id)

    # ---- migration ----------------------------------------------------------------------------------------------
    async def register_port(self, replica_id: str, port: object) -> None:
        """The replica takes migrated streams through this StreamPort."""
        self.ports[replica_id] = port
        self._heard_from(replica_id)

    async def migrate(self, stream_id: str, target: str | None = None, reason: str = "requested",
                      timeout_s: float = 30.0) -> dict:
        """Move a live stream to `target` (None: the replica with a port and the least declared rate) and answer
        when its owner says how it went: {moved, source, target, reason, export_s, handoff_s} or {moved: False,
        why}. The owner pauses the stream, exports it between steps and hands it over; the client's response
        stays where it is and relays the rest."""
        if self.table.owner(stream_id) is None:
            await self._await_registration(stream_id)
        source = self.table.owner(stream_id)
        if source is None:
            return {"moved": False, "why": "unknown or finished stream"}
        target = target or choose_target(self.table.summary(self.ports), source, self._targets())
        if target is None or target not in self.ports or target == source:
            return {"moved": False, "why": f"no target replica to move to (ports: {sorted(self.ports)})"}
        if stream_id in self._move_waiters:
            return {"moved": False, "why": "a move of this stream is already under way"}
        future = asyncio.get_running_loop().create_future()
        self._move_waiters[stream_id] = future
        self._orders.setdefault(source, []).append(MoveOrder(stream_id, target, self.ports[target], reason))
        wake = self._wake.get(source)
        if wake is not None:
            wake.set()
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return {"moved": False, "why": f"the owner did not answer within {timeout_s} s"}
        finally:
            self._move_waiters.pop(stream_id, None)

    async def move_result(self, stream_id: str, result: dict) -> None:
        """The source replica's answer to a MoveOrder (also for moves it decided itself, e.g. a drain)."""
        if result.get("moved"):
            self.table.move(stream_id, result["source"], result["target"])
            self.counts["migrations"] += 1
        else:
            self.counts["migrations_failed"] += 1
        self.moves.append({"stream_id": stream_id, "t": time.time(), **result})
        future = self._move_waiters.get(stream_id)
        if future is not None and not future.done():
            future.set_result(result)

    def relieve_now(self) -> list[Relief]:
        """One tick of the migration policy: reliefs for overloaded replicas, sent down their long-polls. A
        replica just asked is left alone until its stats can show the effect (two ticks)."""
        ms = self.settings.migration
        if ms is None or not self.policy_on:
            return []
        now = time.time()
        fresh = {rid: s["gauges"] for rid, (t, s) in self.replica_stats.items()
                 if now - t <= ms.stats_max_age_s and "gauges" in s}
        sent = []
        for relief in self._throttle.admit(plan_relief(fresh, self._targets(), ms), time.monotonic()):
            self._orders.setdefault(relief.source, []).append(
                RelieveOrder(relief.target, self.ports[relief.target], relief.rate, relief.max_streams, relief.reason,
                             ms.move_waiting))
            wake = self._wake.get(relief.source)
            if wake is not None:
                wake.set()
            sent.append(relief)
        return sent

    async def _migration_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.migration.interval_s)
            self.relieve_now()

    def _targets(self) -> set[str]:
        """Replicas that take migrated streams: those with a port that Serve is not stopping."""
        return set(self.ports) - self.draining

    async def drain(self, replica_id: str) -> list[tuple[str, str]]:
        """Move every stream of `replica_id` (Serve is stopping it) to the other replicas, balanced by declared
        rate (plan_drain); it takes no more streams from here on. The moves run in the background (reason
        "drain", in `recent_moves`); a stream whose move is under way is not asked again. Returns the plan."""
        self.draining.add(replica_id)
        view = self.table.view()
        streams = {sid: e["rate"] or 0.0 for sid, e in view.items()
                   if e["replica_id"] == replica_id and sid not in self._move_waiters}
        plan = plan_drain(streams, self.table.summary(self.ports), self._targets() - {replica_id})
        for sid, target in plan:
            asyncio.get_running_loop().create_task(self.migrate(sid, target, reason="drain"))
        return plan

    async def _drain_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.drain_poll_s)
            try:
                stopping = await stopping_replicas()
            except Exception:  # noqa: BLE001 - Serve's controller restarting: look again next time
                continue
            self.draining &= stopping | set(self.heard)  # forget replicas that are gone
            for rid in stopping & set(self.ports):
                await self.drain(rid)

    async def set_migration(self, on: bool) -> None:
        """Switch the automatic moves on or off (manual `migrate` works either way)."""
        self.policy_on = bool(on)

    async def port_count(self) -> int:
        return len(self.ports)

    async def recent_moves(self) -> list[dict]:
        return list(self.moves)

    # ---- dead replicas ------------------------------------------------------------------------------------------
    async def drop_replica(self, replica_id: str) -> int:
        """Forget a (dead) replica: its stream entries, pending reports and stats. Returns the entries dropped."""
        self.ports.pop(replica_id, None)
        self.draining.discard(replica_id)
        self._orders.pop(replica_id, None)
        self.replica_stats.pop(replica_id, None)
        self.heard.pop(replica_id, None)
        self._wake.pop(replica_id, None)
        taken = self._taken.pop(replica_id, None)
        if taken is not None:  # its reports will never be taken: answer their senders now
            taken.set()
        return self.table.drop_replica(replica_id)

    async def sweep(self) -> list[str]:
        """Drop every replica not heard from for stale_after_s; the ids dropped."""
        now = time.monotonic()
        stale = [rid for rid, t in self.heard.items() if now - t > self.settings.stale_after_s]
        for rid in stale:
            await self.drop_replica(rid)
        return stale

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self.settings.poll_s, self.settings.stale_after_s / 4))
            await self.sweep()

    # ---- the global view ----------------------------------------------------------------------------------------
    async def stats(self, max_age_s: float = 10.0) -> dict[str, dict]:
        """Latest stats of each replica heard from within max_age_s (older ones are gone or stuck)."""
        now = time.time()
        return {rid: s for rid, (t, s) in self.replica_stats.items() if now - t <= max_age_s}

    async def summary(self) -> dict[str, dict[str, float]]:
        """Per replica: live streams, Σ declared rate, streams short of buffer (StreamTable.summary)."""
        return self.table.summary()

    async def view(self) -> dict[str, dict]:
        """stream id -> {replica_id, rate, buffer_s, last_report}: the cluster's table (and tests)."""
        return self.table.view()

    async def counters(self) -> dict[str, int]:
        return dict(self.counts, restarted=int(self.restarted))


def central_name(app_name: str) -> str:
    return f"tokenflow-central-{app_name}"


# max_task_retries=0: a call is not replayed into a restarted actor; replicas resend snapshots, callers of
# `report` retry (their report may then be applied twice: reports are idempotent, the newest value wins).
ACTOR_OPTIONS = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0}
_CentralActor = ray.remote(**ACTOR_OPTIONS)(CentralScheduler)


def get_central(settings: CentralSettings) -> ray.actor.ActorHandle:
    """The named actor, created by whichever deployment asks first (detached: it outlives its creator)."""
    return _CentralActor.options(name=settings.name, namespace=settings.namespace, lifetime="detached",
                                 get_if_exists=True).remote(settings)


def _restarted() -> bool:
    """Whether this process is the central actor restarted by Ray (False outside an actor: tests build the class)."""
    if not ray.is_initialized():  # not an actor; asking the runtime context would start a local Ray
        return False
    try:
        ctx = ray.get_runtime_context()
        return ctx.get_actor_id() is not None and bool(ctx.was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - no Ray, or the GCS unreachable: act as a first start
        return False


async def report_with_retry(central: ray.actor.ActorHandle, report: Report, deadline_s: float) -> bool:
    """`central.report`, retried while the actor restarts (a killed actor comes back in about a second)."""
    give_up = time.monotonic() + deadline_s
    while True:
        try:
            return await central.report.remote(report)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            if time.monotonic() >= give_up:
                raise
            await asyncio.sleep(0.1)


def kill_central(name: str, namespace: str) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except ValueError:  # not there
        pass
