"""ReplicaStats: the one definition of what a replica tells the router and /metrics about itself.

Built on the engine thread from the engine's own accounting (`LLMEngine.stats()`, the scheduler's view, the cost
model), so routing and Prometheus read the same numbers. A replica refreshes it on a short timer and hands the
cached copy to Serve's `record_routing_stats`, which therefore never waits behind a busy engine.

Pure Python (no torch, no ray): the router, the replica and tests share it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from tokenflow_ray.engine.stream import StreamStatus


@dataclass(frozen=True)
class ReplicaStats:
    computed_at: float  # wall time (time.time()) of the snapshot
    # Memory.
    block_size: int
    device_blocks_total: int
    device_blocks_free: int
    host_blocks_total: int
    host_blocks_free: int
    waiting_prompt_blocks: int  # device blocks the waiting streams need to start (their uncomputed tokens)
    # Demand against decode capacity.
    sum_rate: float  # Σ declared rate of the working set (running, loading, paused): Eq. 6's admitted demand
    waiting_rate: float  # Σ declared rate of streams waiting to start: demand about to join
    capacity_tok_s: float  # Γ: decode tokens/s at the batch the device holds (cost model)
    # Urgency: seconds of reading buffered by the least-buffered running paced stream that has started reading;
    # None when there is none (an idle or unpaced replica has no slack to protect, which is not zero slack). A
    # stream before its first token has no buffer to drain yet: its urgency is its TTFT, priced apart.
    min_buffer_s: float | None
    # Time to first token: what a newcomer queues behind, and the prefill cost model to price its own prefill.
    queued_prefill_s: float  # prefill work of the streams waiting to start
    decode_step_s: float  # a step at the current running batch: what a newcomer waits out before its prefill
    prefill_fixed_s: float  # per chunk (the step's fixed cost)
    prefill_s_per_token: float
    prefill_chunk_tokens: int
    # Steps with prefill the cost model learned from: 0 means the prefill and step costs above are the prior's (a
    # replica that has run no prompt yet), which the router must not compare with measured ones.
    prefill_samples: int
    # Streams.
    num_running: int
    num_paused: int  # preempted to the host store, or loading back
    num_waiting: int
    num_live: int
    # Streams ever added to / retired from the engine: the router reconciles its own bookings with them.
    admitted_total: int
    finished_total: int

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "min_buffer_s":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{f.name}: must be a finite number >= 0, got {v!r}")
        if self.block_size < 1 or self.prefill_chunk_tokens < 1:
            raise ValueError("block_size and prefill_chunk_tokens: must be >= 1")
        if self.capacity_tok_s <= 0:
            raise ValueError("capacity_tok_s: must be > 0 (the cost model's Γ always is)")
        if self.num_live != self.num_running + self.num_paused + self.num_waiting:
            raise ValueError("num_live: must be num_running + num_paused + num_waiting")
        if self.admitted_total != self.finished_total + self.num_live:
            raise ValueError("admitted_total: must be finished_total + num_live")

    # ---- derived ----------------------------------------------------------------------------------------------
    @property
    def demand_rate(self) -> float:
        return self.sum_rate + self.waiting_rate

    def prefill_s(self, num_tokens: int) -> float:
        """Estimated prefill time of `num_tokens` on this replica (the cost model's recompute form)."""
        chunks = math.ceil(num_tokens / self.prefill_chunk_tokens) if num_tokens > 0 else 0
        return chunks * self.prefill_fixed_s + num_tokens * self.prefill_s_per_token

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- wire format ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaStats:
        """Strict: unknown or missing keys raise (a replica on another version must not be misread)."""
        known = {f.name for f in fields(cls)}
        if set(data) != known:
            raise ValueError(f"ReplicaStats keys: missing {sorted(known - set(data))}, "
                             f"unknown {sorted(set(data) - known)}")
        return cls(**data)

    def gauges(self) -> dict[str, float]:
        """The numeric fields for Prometheus, less the timestamp (min_buffer_s is left out while there is no paced
        stream: no slack to protect is not zero slack)."""
        return {k: float(v) for k, v in self.to_dict().items() if v is not None and k != "computed_at"}


def replica_stats_from_engine(engine: Any, stats: Any = None, wall_time: float | None = None) -> ReplicaStats:
    """Engine thread only. `stats`: an `EngineStats` already taken from this engine (so /metrics and routing share
    one snapshot); None takes a fresh one."""
    stats = engine.stats() if stats is None else stats
    sched = engine.scheduler
    now = engine.clock.now()
    view = sched.view(now)
    live = list(sched.streams.values())
    waiting = [s for s in live if s.status == StreamStatus.WAITING]
    reading = [s for s in live if s.status == StreamStatus.RUNNING and s.rate > 0 and s.first_token_time is not None]
    uncomputed = [s.num_uncomputed_tokens for s in waiting]
    cost = sched.cost
    fit = cost.fit
    return ReplicaStats(
        computed_at=time.time() if wall_time is None else wall_time,
        block_size=engine.pool.block_size,
        device_blocks_total=stats.device_blocks_total, device_blocks_free=stats.device_blocks_free,
        host_blocks_total=stats.host_blocks_total, host_blocks_free=stats.host_blocks_free,
        waiting_prompt_blocks=sum(engine.pool.blocks_for_tokens(n) for n in uncomputed),
        # The view's working set counts a recompute-preempted stream (status WAITING, preempted before) as
        # working, so waiting_rate is the rest of the live demand, not a sum over `waiting`.
        sum_rate=view.sum_rate, waiting_rate=max(0.0, stats.sum_rate - view.sum_rate),
        capacity_tok_s=cost.decode_capacity_tok_s(view.max_device_batch),
        min_buffer_s=min((s.buffer_s(now) for s in reading), default=None),
        queued_prefill_s=sum(cost.t_recompute(n) for n in uncomputed),
        decode_step_s=fit.predict(stats.num_running),
        prefill_fixed_s=fit.fixed_s, prefill_s_per_token=fit.prefill_s,
        prefill_chunk_tokens=cost.prefill_chunk_tokens, prefill_samples=cost.steps.prefill_samples,
        num_running=stats.num_running, num_paused=stats.num_preempted, num_waiting=stats.num_waiting,
        num_live=stats.num_running + stats.num_preempted + stats.num_waiting,
        admitted_total=stats.streams_finished + len(live), finished_total=stats.streams_finished)
