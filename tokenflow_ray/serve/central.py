"""The central scheduling actor: the global view of live streams, and the path of consumption reports to replicas.

Serve replicas cannot be called by method from outside the app, so delivery is a long-poll: each replica keeps one
`wait_reports(replica_id, stats)` call open; it returns as soon as reports for that replica are pending (an
asyncio.Event) or after `poll_s`. The same call carries the replica's stats back, which /metrics and routing read.
The actor never sits on the token path. It is named, detached and restartable: after a restart its tables are
empty, and replicas re-register their live streams when their poll fails.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import ray

from tokenflow_ray.serve.messages import Report


@dataclass
class StreamEntry:
    replica_id: str
    rate: float | None
    last_report: Report | None = None
    last_report_t: float | None = None


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class CentralScheduler:
    def __init__(self, poll_s: float = 1.0) -> None:
        self.poll_s = poll_s
        self.streams: dict[str, StreamEntry] = {}
        self.pending: dict[str, list[Report]] = {}
        self.events: dict[str, asyncio.Event] = {}
        self.replica_stats: dict[str, tuple[float, dict]] = {}

    def _event(self, replica_id: str) -> asyncio.Event:
        return self.events.setdefault(replica_id, asyncio.Event())

    async def register(self, stream_id: str, replica_id: str, rate: float | None) -> None:
        self.streams[stream_id] = StreamEntry(replica_id, rate)

    async def deregister(self, stream_id: str) -> None:
        self.streams.pop(stream_id, None)

    async def report(self, report: Report) -> bool:
        """Queue a client's report for the owning replica; False if the stream is unknown or finished."""
        entry = self.streams.get(report.stream_id)
        if entry is None:
            return False
        entry.last_report, entry.last_report_t = report, time.time()
        if report.rate is not None:
            entry.rate = report.rate
        self.pending.setdefault(entry.replica_id, []).append(report)
        self._event(entry.replica_id).set()
        return True

    async def wait_reports(self, replica_id: str, stats: dict | None = None) -> list[Report]:
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


def get_central(name: str, namespace: str, poll_s: float = 1.0) -> ray.actor.ActorHandle:
    """The named actor, created by whichever deployment asks first (detached: it outlives its creator)."""
    return CentralScheduler.options(name=name, namespace=namespace, lifetime="detached",
                                    get_if_exists=True).remote(poll_s)


def kill_central(name: str, namespace: str) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except ValueError:  # not there
        pass
