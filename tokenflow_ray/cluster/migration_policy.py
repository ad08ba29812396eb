"""Where migrated streams go, and when to move them: pure decisions over the central table and replica stats.

Relief (`plan_relief`): a replica whose Σ declared rate exceeds its decode capacity Γ cannot feed every reader;
the streams it paused wait for room there while another replica may have capacity to spare. Moving paused
streams costs no recompute (their KV is in the host store and travels with them) and no running stream a stall,
so the central actor moves them to the replica with the most headroom. Which paused streams go is the source's
choice (it knows their buffers): the least buffered first, the ones that would stall soonest where they are.

Drain (`plan_drain`): a replica Serve is stopping (scale-down) moves every stream it holds to the others, so it
can stop without waiting for its streams to end.

Pure Python (no ray, no torch): the central actor (serve/control/central.py) and the simulator call the same functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tokenflow_ray.engine.stream import StreamStatus


def choose_target(summary: Mapping[str, Mapping[str, float]], source: str, candidates: Iterable[str]) -> str | None:
    """The candidate (not the source) with the least declared rate, then the fewest streams; ties by id, so the
    choice is deterministic. None when there is no other candidate."""
    others = sorted(c for c in candidates if c != source)
    if not others:
        return None

    def load(rid: str) -> tuple[float, float, str]:
        row = summary.get(rid, {})
        return (row.get("sum_rate", 0.0), row.get("streams", 0), rid)

    return min(others, key=load)


def plan_drain(streams: Mapping[str, float], summary: Mapping[str, Mapping[str, float]],
               targets: Iterable[str]) -> list[tuple[str, str]]:
    """(stream id, target) for every stream of a replica being drained (`streams`: id -> declared rate), spread
    so the targets' declared rates stay balanced: the fastest readers first, each to the target with the least
    declared rate so far (what it was given counted), then the fewest streams, then the smaller id. No targets:
    nothing to plan. Deterministic."""
    load = {rid: [summary.get(rid, {}).get("sum_rate", 0.0), summary.get(rid, {}).get("streams", 0)]
            for rid in sorted(set(targets))}
    if not load:
        return []
    plan = []
    for sid, rate in sorted(streams.items(), key=lambda kv: (-kv[1], kv[0])):
        target = min(load, key=lambda rid: (load[rid][0], load[rid][1], rid))
        plan.append((sid, target))
        load[target][0] += rate
        load[target][1] += 1
    return plan


@dataclass(frozen=True)
class MigrationSettings:
    """When the central actor moves paused streams off a replica (serve/control/central.py), and how far."""

    interval_s: float = 1.0  # how often the actor looks at the replicas' stats
    overload_ratio: float = 1.0  # hot: Σ declared rate above this × its decode capacity Γ, with streams paused
    target_headroom: float = 0.9  # a target takes streams while its Σ declared rate stays under this × its Γ
    max_moves_per_tick: int = 8  # streams moved per replica per tick at most: a move costs a pause and a copy
    full_fraction: float = 0.05  # a device pool with at most this share of its blocks free is full
    # Streams waiting to start move too, after the paused ones. Off: at 96 streams on a hot replica here it cost
    # effective throughput (800 against 863 tok/s paused-only) and raw (1291 against 1537), docs/results/cluster.md.
    move_waiting: bool = False
    stats_max_age_s: float = 3.0  # stats older than this are not acted on

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.overload_ratio > 0 and 0 < self.target_headroom <= 1):
            raise ValueError("migration: interval_s and overload_ratio must be > 0, target_headroom in (0, 1]")
        if self.max_moves_per_tick < 1 or not self.stats_max_age_s > 0 or not 0 <= self.full_fraction < 1:
            raise ValueError("migration: max_moves_per_tick >= 1, stats_max_age_s > 0, full_fraction in [0, 1)")


@dataclass(frozen=True)
class Relief:
    """Move paused streams worth `rate` tokens/s of declared demand (at most `max_streams`) from source to target."""

    source: str
    target: str
    rate: float
    max_streams: int
    reason: str = "overloaded"  # or "device_full"


def plan_relief(stats: Mapping[str, Mapping[str, float]], targets: Iterable[str],
                settings: MigrationSettings = MigrationSettings()) -> list[Relief]:
    """Reliefs for hot replicas toward replicas with headroom (those in `targets`: they can take streams).

    `stats`: replica id -> ReplicaStats gauges. A replica with streams paused or waiting is hot when
    - its declared demand (Σ rate of its working set and of the streams waiting to start) exceeds
      `overload_ratio` × its decode capacity Γ: it is asked to move the excess; or
    - its device pool is full (at most `full_fraction` free): its paused streams cannot come back soon, however
      fast it decodes: it is asked to move half the difference of Σ rate with the target (toward balance).
    A target takes streams while its Σ rate stays under `target_headroom` × its Γ, has free device and host
    blocks, and carries less declared rate than the source (so moves never go back and forth). Hottest source
    first, each to the target with the most headroom, whose headroom shrinks by what it was given. Deterministic.
    """
    headroom: dict[str, float] = {}
    for rid in sorted(set(targets)):
        row = stats.get(rid)
        if row is not None and row.get("host_blocks_free", 0) > 0 and not _device_full(row, settings):
            headroom[rid] = settings.target_headroom * row["capacity_tok_s"] - row["sum_rate"]
    hot = []
    for rid, row in stats.items():
        if row.get("num_paused", 0) + row.get("num_waiting", 0) <= 0:
            continue
        over = row["sum_rate"] + row.get("waiting_rate", 0.0) - settings.overload_ratio * row["capacity_tok_s"]
        if over > 0 or _device_full(row, settings):
            hot.append((max(over, 0.0), row["sum_rate"], rid))
    reliefs: list[Relief] = []
    for over, src_rate, source in sorted(hot, reverse=True):
        candidates = [(room, rid) for rid, room in headroom.items()
                      if rid != source and room > 0 and stats[rid]["sum_rate"] < src_rate]
        if not candidates:
            continue
        room, target = max(candidates)
        rate = min(over if over > 0 else (src_rate - stats[target]["sum_rate"]) / 2, room)
        movable = int(stats[source].get("num_paused", 0) + stats[source].get("num_waiting", 0))
        reliefs.append(Relief(source, target, rate, min(settings.max_moves_per_tick, movable),
                              "overloaded" if over > 0 else "device_full"))
        headroom[target] = room - rate
    return reliefs


class ReliefThrottle:
    """A source just asked to relieve itself is left alone until its stats can show the effect: two ticks. The
    central actor and the simulator filter plan_relief's output through one of these."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._asked: dict[str, float] = {}  # source -> when it was last asked

    def admit(self, reliefs: Iterable[Relief], now: float) -> list[Relief]:
        out = []
        for relief in reliefs:
            if now - self._asked.get(relief.source, float("-inf")) < 2 * self.interval_s:
                continue
            self._asked[relief.source] = now
            out.append(relief)
        return out


def _device_full(row: Mapping[str, float], settings: MigrationSettings) -> bool:
    total = row.get("device_blocks_total", 0)
    return total > 0 and row.get("device_blocks_free", 0) <= settings.full_fraction * total


def pick_streams(scheduler, now: float, rate: float, max_streams: int, include_waiting: bool = True) -> list[str]:
    """The source's side of a relief: streams worth `rate` tokens/s of declared demand, at most max_streams,
    that can leave now. Paused ones first, the least buffered first: they would stall soonest here. A stream
    paused to the host store takes its KV along; one paused by recompute (WAITING with output: fcfs and andes
    pause that way, and so does tokenflow when recompute is sooner) takes only its tokens and is recomputed where
    there is room, as it would have been here. Then, if `include_waiting`, streams still waiting to start, oldest
    first (nothing to copy: they start sooner where there is room)."""
    live = [s for s in scheduler.streams.values() if scheduler.exportable(s.stream_id)]
    paused = sorted((s for s in live if s.status == StreamStatus.PREEMPTED
                     or (s.status == StreamStatus.WAITING and s.num_output_tokens)),
                    key=lambda s: (s.buffer_s(now), s.stream_id))
    waiting = sorted((s for s in live if s.status == StreamStatus.WAITING and not s.num_output_tokens
                      and include_waiting), key=lambda s: (s.arrival_time, s.stream_id))
    chosen: list[str] = []
    total = 0.0
    for s in paused + waiting:
        if total >= rate or len(chosen) >= max_streams:
            break
        chosen.append(s.stream_id)
        total += s.rate
    return chosen
