"""The central scheduling actor: the global view of live streams, and the path of consumption reports to replicas.

Serve replicas cannot be called by method from outside the app, so delivery is a long-poll: each replica keeps one
`wait_reports(replica_id, stats)` call open; it returns as soon as reports for that replica are pending (an
asyncio.Event) or after `poll_s`. The same call carries the replica's stats back, which /metrics and routing read.
The actor never sits on the token path: replicas register a stream without waiting for the answer, so a client's
first report may arrive before the registration does; `report` then waits for it up to `register_grace_s`. It is
named, detached and restartable: after a restart its tables are empty, and replicas re-register their live streams
when their poll fails.

A dead replica never deregisters its streams. The ingress deregisters each stream it saw fail with the replica
(ingress.py); what is left (entries, pending reports, stats) goes when the replica has not been heard from (a poll or
a registration) for `stale_after_s`: a sweep task, started by the first call, drops it (`drop_replica`). A replica
that was only slow and polls again is told to re-register (its poll fails with ReplicaDropped), so its live streams
come back.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

import ray

from tokenflow_ray.serve.messages import Report


@dataclass
class StreamEntry:
    replica_id: str
    rate: float | None
    last_report: Report | None = None
    last_report_t: float | None = None


@dataclass(frozen=True)
class CentralSettings:
    """Where the actor lives and how it behaves; whichever deployment creates it first passes these."""

    name: str
    namespace: str
    poll_s: float = 1.0  # a replica's report long-poll returns after this long without reports
    register_grace_s: float = 2.0  # a report for an unregistered id waits this long for its registration
    finished_memory: int = 4096  # recently finished ids kept, so reports for them are 404 at once
    stale_after_s: float = 10.0  # a replica silent this long (10 polls) is taken for dead and dropped


class ReplicaDropped(RuntimeError):
    """Raised to a replica's poll after its entries were dropped: its poll loop then re-registers its streams."""


class CentralScheduler:
    """The actor's class (created with ACTOR_OPTIONS by get_central; tests subclass it)."""

    def __init__(self, poll_s: float = 1.0, register_grace_s: float = 2.0, finished_memory: int = 4096,
                 stale_after_s: float = 10.0) -> None:
        self.poll_s = poll_s
        self.register_grace_s = register_grace_s
        self.finished_memory = finished_memory
        self.stale_after_s = stale_after_s
        self.heard: dict[str, float] = {}  # replica id -> monotonic time of its last poll or registration
        self.dropped: OrderedDict[str, None] = OrderedDict()  # replicas dropped lately (bounded, oldest first)
        self._sweeper: asyncio.Task | None = None
        self.streams: dict[str, StreamEntry] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()  # bounded, oldest first
        self.arrivals: dict[str, asyncio.Event] = {}  # ids that reports are waiting on
        self.pending: dict[str, list[Report]] = {}
        self.events: dict[str, asyncio.Event] = {}
        self.replica_stats: dict[str, tuple[float, dict]] = {}

    def _event(self, replica_id: str) -> asyncio.Event:
        return self.events.setdefault(replica_id, asyncio.Event())

    def _arrived(self, stream_id: str) -> None:
        event = self.arrivals.pop(stream_id, None)
        if event is not None:
            event.set()

    def _heard_from(self, replica_id: str) -> None:
        self.heard[replica_id] = time.monotonic()
        self.dropped.pop(replica_id, None)
        if self._sweeper is None or self._sweeper.done():  # lazily: __init__ may run outside the actor's loop
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def register(self, stream_id: str, replica_id: str, rate: float | None) -> None:
        self._heard_from(replica_id)
        if stream_id in self.finished:  # a registration that lost the race with its stream's end
            return
        self.streams[stream_id] = StreamEntry(replica_id, rate)
        self._arrived(stream_id)

    async def deregister(self, stream_id: str) -> None:
        self.streams.pop(stream_id, None)
        self.finished[stream_id] = None
        self.finished.move_to_end(stream_id)
        while len(self.finished) > self.finished_memory:
            self.finished.popitem(last=False)
        self._arrived(stream_id)  # a report waiting on it answers "finished" now, not after the grace

    async def _entry(self, stream_id: str) -> StreamEntry | None:
        entry = self.streams.get(stream_id)
        if entry is not None or stream_id in self.finished or self.register_grace_s <= 0:
            return entry
        # Not registered yet (registration is off the token path, so a report right after the first token can
        # get here first), or never existed: wait for it, bounded.
        event = self.arrivals.setdefault(stream_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), self.register_grace_s)
        except asyncio.TimeoutError:
            if self.arrivals.get(stream_id) is event:
                del self.arrivals[stream_id]
        return self.streams.get(stream_id)

    async def report(self, report: Report) -> bool:
        """Queue a client's report for the owning replica; False if the stream is unknown or finished."""
        entry = await self._entry(report.stream_id)
        if entry is None:
            return False
        entry.last_report, entry.last_report_t = report, time.time()
        if report.rate is not None:
            entry.rate = report.rate
        self.pending.setdefault(entry.replica_id, []).append(report)
        self._event(entry.replica_id).set()
        return True

    async def wait_reports(self, replica_id: str, stats: dict | None = None) -> list[Report]:
        if replica_id in self.dropped:  # taken for dead but alive: have it re-register its live streams
            self._heard_from(replica_id)
            raise ReplicaDropped(f"replica {replica_id} was silent for over {self.stale_after_s}s; re-register")
        self._heard_from(replica_id)
        if stats is not None:
            self.replica_stats[replica_id] = (time.time(), stats)
        event = self._event(replica_id)
        if not self.pending.get(replica_id):
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), self.poll_s)
            except asyncio.TimeoutError:
                pass
        return self.pending.pop(replica_id, [])

    async def drop_replica(self, replica_id: str) -> int:
        """Forget a (dead) replica: its stream entries, pending reports and stats. Returns the entries dropped."""
        sids = [sid for sid, e in self.streams.items() if e.replica_id == replica_id]
        for sid in sids:  # not marked finished: if the replica was alive after all, its streams re-register
            del self.streams[sid]
        self.pending.pop(replica_id, None)
        self.events.pop(replica_id, None)
        self.replica_stats.pop(replica_id, None)
        self.heard.pop(replica_id, None)
        self.dropped[replica_id] = None
        while len(self.dropped) > 1024:
            self.dropped.popitem(last=False)
        return len(sids)

    async def sweep(self) -> list[str]:
        """Drop every replica not heard from for stale_after_s; the ids dropped."""
        now = time.monotonic()
        stale = [rid for rid, t in self.heard.items() if now - t > self.stale_after_s]
        for rid in stale:
            await self.drop_replica(rid)
        return stale

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self.poll_s, self.stale_after_s / 4))
            await self.sweep()

    async def stats(self, max_age_s: float = 10.0) -> dict[str, dict]:
        """Latest stats of each replica heard from within max_age_s (older ones are gone or stuck)."""
        now = time.time()
        return {rid: s for rid, (t, s) in self.replica_stats.items() if now - t <= max_age_s}

    async def view(self) -> dict[str, dict]:
        """stream id -> {replica_id, rate, last_report}: the routing/autoscaling view (and tests)."""
        return {sid: {"replica_id": e.replica_id, "rate": e.rate,
                      "last_report": None if e.last_report is None else vars(e.last_report)}
                for sid, e in self.streams.items()}


def central_name(app_name: str) -> str:
    return f"tokenflow-central-{app_name}"


# max_task_retries=0: a report or registration is not replayed into a restarted actor; replicas re-register.
ACTOR_OPTIONS = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0}
_CentralActor = ray.remote(**ACTOR_OPTIONS)(CentralScheduler)


def get_central(settings: CentralSettings) -> ray.actor.ActorHandle:
    """The named actor, created by whichever deployment asks first (detached: it outlives its creator)."""
    return _CentralActor.options(name=settings.name, namespace=settings.namespace, lifetime="detached",
                                 get_if_exists=True).remote(settings.poll_s, settings.register_grace_s,
                                                            settings.finished_memory, settings.stale_after_s)


def kill_central(name: str, namespace: str) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except ValueError:  # not there
        pass
