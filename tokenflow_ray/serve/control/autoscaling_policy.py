"""Serve autoscaling of the LLMServer deployment on serving signals (cluster/autoscaling.py decides).

`ServingSignalsPolicy` is a class-callable Serve policy (`AutoscalingPolicy(policy_function=..., policy_kwargs=...)`):
Serve builds it once on the controller with the JSON `policy_kwargs` and calls it every control-loop tick (0.1 s)
with an `AutoscalingContext`. Its input is the replicas' `record_autoscaling_stats` (serve/replica/server.py), recorded and
pushed every `metrics_interval_s` and time-averaged over `look_back_period_s` (cluster-notes §2.2: at Serve's default
10 s push the first metric took 13.3 s to arrive; at 0.5 s, 2.4 s). It returns the raw target; Serve applies the
delays, min/max and picks the replica to stop.

Scale-down never cuts a stream: the victim's graceful shutdown waits for its streams (`drain_timeout_s` is
Serve's graceful_shutdown_timeout_s), and with migration on the central actor moves them off it as soon as Serve
marks it STOPPING (serve/control/central.py `drain`), so in the ingress placement it stops without waiting for them.
`drain_hook` is a further seam: an import path of a callable `hook(decision, replica_ids) -> bool` the policy asks
before each scale-down; False holds the current target this tick (reason "draining"). It runs on Serve's control
loop, so it must not block: read what an actor answered on an earlier tick.

Serve cloudpickles this module by value; what it imports (tokenflow_ray.cluster.autoscaling) must be installed
where the controller runs, which cluster.yaml's setup commands and the RayService image see to.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from tokenflow_ray.cluster.autoscaling import (
    CRITICAL_BUFFER_S,
    METRIC_NAMES,
    ReplicaLoad,
    ScaleDecision,
    ScalingRules,
    decide,
)

log = logging.getLogger("ray.serve")

POLICY_PATH = "tokenflow_ray.serve.control.autoscaling_policy:ServingSignalsPolicy"
STATE_KEY = "tokenflow"


def _import(path: str) -> Callable:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"drain_hook: expected 'module:attr', got {path!r}")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class AutoscalingSettings:
    """ServeConfig.autoscaling: Serve's knobs for the LLMServer deployment plus the decision's rules."""

    min_replicas: int = 1
    max_replicas: int = 4
    upscale_delay_s: float = 2.0  # a scale-up must be wanted this long
    downscale_delay_s: float = 30.0  # a scale-down likewise
    metrics_interval_s: float = 0.5  # replicas record and push their metrics this often (Serve's default: 10 s)
    look_back_period_s: float = 2.0  # Serve averages each metric over this window (> metrics_interval_s)
    drain_timeout_s: float = 600.0  # a replica chosen for scale-down serves its streams to the end, this long at most
    drain_hook: str | None = None  # "module:callable", see the module docstring
    # ScalingRules (cluster/autoscaling.py).
    target_utilization: float = 0.8
    downscale_utilization: float = 0.5
    waiting_per_replica: float = 1.0
    critical_per_replica: float = 0.5
    pressure_cooldown_s: float = 5.0
    critical_buffer_s: float = CRITICAL_BUFFER_S  # replicas count readers under this much buffer as critical

    def __post_init__(self) -> None:
        if not (isinstance(self.min_replicas, int) and isinstance(self.max_replicas, int)
                and 1 <= self.min_replicas <= self.max_replicas):
            raise ValueError(f"autoscaling: need integers 1 <= min_replicas <= max_replicas, got "
                             f"{self.min_replicas!r} and {self.max_replicas!r}")
        for name in ("upscale_delay_s", "downscale_delay_s", "metrics_interval_s", "look_back_period_s",
                     "drain_timeout_s", "critical_buffer_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"autoscaling.{name}: must be a finite number >= 0, got {v!r}")
        if self.metrics_interval_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("autoscaling.metrics_interval_s and drain_timeout_s: must be > 0")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError("autoscaling.look_back_period_s: must be > metrics_interval_s (Serve averages over it)")
        if self.drain_hook is not None:
            _import(self.drain_hook)  # fails here, not on the controller
        self.rules()

    @classmethod
    def from_value(cls, value: AutoscalingSettings | dict[str, Any]) -> AutoscalingSettings:
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"autoscaling: expected a mapping, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown autoscaling keys: {unknown}; known: {sorted(known)}")
        return cls(**value)

    def rules(self) -> ScalingRules:
        return ScalingRules(target_utilization=self.target_utilization,
                            downscale_utilization=self.downscale_utilization,
                            waiting_per_replica=self.waiting_per_replica,
                            critical_per_replica=self.critical_per_replica,
                            pressure_cooldown_s=self.pressure_cooldown_s)

    def policy_kwargs(self) -> dict[str, Any]:
        return {**self.rules().to_kwargs(), "drain_hook": self.drain_hook}

    def serve_autoscaling_config(self, initial_replicas: int) -> dict[str, Any]:
        """The deployment's `autoscaling_config` (a dict: Serve validates it, and a YAML override has the same
        shape)."""
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": initial_replicas,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                "metrics_interval_s": self.metrics_interval_s, "look_back_period_s": self.look_back_period_s,
                "policy": {"policy_function": POLICY_PATH, "policy_kwargs": self.policy_kwargs()}}


class ServingSignalsPolicy:
    """Serve's class-callable policy: `(AutoscalingContext) -> (raw target, policy state)`."""

    def __init__(self, drain_hook: str | None = None, **rules: float) -> None:
        self.rules = ScalingRules(**rules)
        self.drain_hook = _import(drain_hook) if drain_hook else None

    @staticmethod
    def loads(ctx: Any) -> dict[str, ReplicaLoad]:
        """Running replicas that reported every metric (a new one has not yet; a bad report is skipped)."""
        metrics = ctx.aggregated_metrics or {}
        out: dict[str, ReplicaLoad] = {}
        for rid in ctx.running_replicas:
            values = {name: metrics.get(name, {}).get(rid) for name in METRIC_NAMES}
            if any(v is None for v in values.values()):
                continue
            try:
                out[rid.unique_id] = ReplicaLoad(**values)
            except ValueError as exc:
                log.warning("autoscaling metrics of replica %s skipped: %s", rid.unique_id, exc)
        return out

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        loads = self.loads(ctx)
        now = ctx.current_time if ctx.current_time is not None else time.time()
        # Replicas still starting count as the fleet: holding at the running count would read to Serve as a
        # scale-down of the target it just raised.
        fleet = max(ctx.current_num_replicas, ctx.target_num_replicas)
        d = decide(loads, fleet, self.rules, now, ctx.last_scale_up_time)
        if d.target < fleet and self.drain_hook is not None and not self.drain_hook(d, list(loads)):
            d = ScaleDecision(fleet, "draining", d.demand_rate, d.capacity_tok_s, d.num_live, d.num_waiting,
                              d.num_critical)
        return d.target, {STATE_KEY: {**d.to_state(), "replicas_reporting": len(loads)}}
