"""How many LLMServer replicas the serving signals call for: the pure decision behind the Serve autoscaling policy.

Each replica reports a `ReplicaLoad` (built from its ReplicaStats, serve/replica/server.py `record_autoscaling_stats`);
Serve time-averages it over its look-back window and hands the policy one value per replica and metric
(serve/control/autoscaling_policy.py turns that into the mapping `decide` takes). Three signals:

- **Σ declared rate against Σ Γ** (Eq. 6 across replicas): readers' demand over the decode capacity the cost model
  predicts, kept at `target_utilization`; live streams against the engine batch likewise, for unpaced streams,
  whose declared rate is 0.
- **Waiting streams**: streams that have not started (their TTFT is growing).
- **Buffer-critical streams**: paced readers about to stall: under `CRITICAL_BUFFER_S` of buffer. Not the tokenflow
  policy's T_critical (1 s): that policy holds buffers at min(10% of the length, T_critical) on purpose, so "under
  T_critical" is its steady state, not a shortage.

The rate and batch terms size the fleet proportionally. Waiting and critical streams are pressure that no rate
explains (long prompts, a mispredicted Γ): they add one replica at a time, and only when every replica reports and
the last scale-up has had `pressure_cooldown_s` to take effect, since a stream waiting on one replica does not move
to a new one by itself (migration moves paused streams, not waiting ones, by default) and would otherwise keep asking. Scale-down needs the demand to fit the smaller fleet
at `downscale_utilization` (< target: hysteresis) and no pressure at all. Serve then applies the delays and bounds and
picks the replica to stop; its graceful shutdown waits for that replica's streams (graceful_shutdown_timeout_s)
while the central actor moves them to the others (migration_policy.plan_drain).

Pure Python (no torch, no ray).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from tokenflow_ray.cluster.replica_stats import ReplicaStats
from tokenflow_ray.engine.stream import StreamStatus


def _finite_nonneg(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's autoscaling metrics (Serve's custom metrics: names are the field names, values floats)."""

    demand_rate: float  # Σ declared rate of live streams: working set + waiting (tokens/s)
    capacity_tok_s: float  # Γ at the batch the device holds (cost model)
    num_live: float  # streams on the replica: running, paused, waiting
    batch_capacity: float  # the engine's batch cap (max_num_seqs)
    num_waiting: float  # streams not started yet
    num_critical: float  # paced readers under the critical buffer (CRITICAL_BUFFER_S by default)

    def __post_init__(self) -> None:
        for f in fields(self):
            _finite_nonneg(f.name, getattr(self, f.name))
        if self.capacity_tok_s <= 0 or self.batch_capacity <= 0:
            raise ValueError("capacity_tok_s and batch_capacity: must be > 0")

    def to_metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_replica_stats(cls, rs: ReplicaStats, batch_capacity: int, num_critical: int) -> ReplicaLoad:
        return cls(demand_rate=rs.demand_rate, capacity_tok_s=rs.capacity_tok_s, num_live=rs.num_live,
                   batch_capacity=batch_capacity, num_waiting=rs.num_waiting, num_critical=num_critical)


METRIC_NAMES = tuple(f.name for f in fields(ReplicaLoad))
CRITICAL_BUFFER_S = 0.25  # a reader with less buffered is a few decode steps from a stall


def count_buffer_critical(engine: Any, t_critical_s: float = CRITICAL_BUFFER_S) -> int:
    """Engine thread only: live paced streams that started reading and hold under `t_critical_s` of buffer (a
    paused one counts: it is the one about to stall)."""
    now = engine.clock.now()
    return sum(1 for s in engine.scheduler.streams.values()
               if s.rate > 0 and s.first_token_time is not None and s.status < StreamStatus.FINISHED_STOPPED
               and s.buffer_s(now) < t_critical_s)


@dataclass(frozen=True)
class ScalingRules:
    """The decision's knobs (the Serve policy's `policy_kwargs`: JSON-serializable by construction)."""

    target_utilization: float = 0.8  # Σ rate kept at this share of Σ Γ (and live streams of the batch)
    downscale_utilization: float = 0.5  # the smaller fleet must carry the demand at this share to scale down
    # Pressure: mean waiting / buffer-critical streams per replica above these (Serve averages the counts over its
    # look-back window; a newcomer waits a step or two before its prefill, which is no shortage).
    waiting_per_replica: float = 1.0
    critical_per_replica: float = 0.5
    pressure_cooldown_s: float = 5.0  # after a scale-up, pressure waits this long before asking again

    def __post_init__(self) -> None:
        for f in fields(self):
            _finite_nonneg(f.name, getattr(self, f.name))
        if not 0 < self.downscale_utilization < self.target_utilization <= 1:
            raise ValueError("utilization: need 0 < downscale_utilization < target_utilization <= 1, got "
                             f"{self.downscale_utilization} and {self.target_utilization}")

    def to_kwargs(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class ScaleDecision:
    target: int  # replicas wanted (Serve applies delays and min/max after)
    reason: str  # "rate", "pressure", "down"; or no change: "hold", "pending" (a scale-up settling), "no-metrics"
    demand_rate: float
    capacity_tok_s: float  # Σ Γ over the current fleet (a replica not reporting yet counts at the mean)
    num_live: float
    num_waiting: float
    num_critical: float

    def to_state(self) -> dict[str, Any]:
        return asdict(self)


def decide(loads: Mapping[str, ReplicaLoad], current: int, rules: ScalingRules, now: float,
           last_scale_up: float | None = None) -> ScaleDecision:
    """`loads`: the replicas that have reported (a new one counts in `current` before its first metric arrives).
    `now`/`last_scale_up`: seconds on one clock (Serve's wall time)."""
    if current < 0:
        raise ValueError(f"current: must be >= 0, got {current}")
    demand = sum(x.demand_rate for x in loads.values())
    live = sum(x.num_live for x in loads.values())
    waiting = sum(x.num_waiting for x in loads.values())
    critical = sum(x.num_critical for x in loads.values())

    def out(target: int, reason: str, gamma_total: float = 0.0) -> ScaleDecision:
        return ScaleDecision(target, reason, demand, gamma_total, live, waiting, critical)

    if current == 0 or not loads:
        return out(current, "no-metrics")
    n = len(loads)
    gamma = sum(x.capacity_tok_s for x in loads.values()) / n  # one replica's Γ
    batch = sum(x.batch_capacity for x in loads.values()) / n

    def fleet_for(utilization: float) -> int:  # replicas that carry the demand at this utilization
        return max(1, math.ceil(max(demand / (utilization * gamma), live / (utilization * batch)) - 1e-9))

    gamma_total = gamma * current
    pressure = waiting > rules.waiting_per_replica * current or critical > rules.critical_per_replica * current
    need = fleet_for(rules.target_utilization)
    if need > current:
        return out(need, "rate", gamma_total)
    if pressure:
        settled = last_scale_up is None or now - last_scale_up >= rules.pressure_cooldown_s
        if n < current or not settled:  # the last scale-up has not taken effect yet
            return out(current, "pending", gamma_total)
        return out(current + 1, "pressure", gamma_total)
    down = fleet_for(rules.downscale_utilization)
    if down < current and n == current:  # a replica not heard from may be the loaded one
        return out(down, "down", gamma_total)
    return out(current, "hold", gamma_total)
