"""The Serve hook (serve/control/autoscaling_policy.py) on Serve's own AutoscalingContext, and the autoscaling config fields.

No Ray instance: the policy is resolved the way the controller resolves it (cloudpickled by value, built once with
policy_kwargs) and called with contexts shaped like the controller's.
"""

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from tokenflow_ray.cluster.autoscaling import ReplicaLoad
from tokenflow_ray.serve.app import replica_count_options
from tokenflow_ray.serve.config import ServeConfig
from tokenflow_ray.serve.control.autoscaling_policy import (
    POLICY_PATH,
    STATE_KEY,
    AutoscalingSettings,
    ServingSignalsPolicy,
)

DEP = DeploymentID(name="LLMServer", app_name="tokenflow")

# A drain hook for the seam test: it holds scale-downs until told otherwise (module state only in this test).
DRAIN_READY: list[bool] = [False]


def hold_until_ready(decision, replica_ids) -> bool:
    return DRAIN_READY[0]


def rid(i: int) -> ReplicaID:
    return ReplicaID(unique_id=f"r{i}", deployment_id=DEP)


def ctx(loads: dict[int, ReplicaLoad | None], target: int | None = None, last_up: float | None = None,
        now: float = 1000.0, config: AutoscalingConfig | None = None) -> AutoscalingContext:
    metrics: dict[str, dict[ReplicaID, float]] = {}
    for i, x in loads.items():
        for name, v in (x.to_metrics() if x is not None else {}).items():
            metrics.setdefault(name, {})[rid(i)] = v
    running = [rid(i) for i in loads]
    return AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name, current_num_replicas=len(running),
        target_num_replicas=len(running) if target is None else target, running_replicas=running,
        total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics=lambda: metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state={},
        last_scale_up_time=last_up, last_scale_down_time=None, current_time=now, config=config)


def load(demand=0.0, live=0, waiting=0, critical=0) -> ReplicaLoad:
    return ReplicaLoad(demand_rate=demand, capacity_tok_s=100.0, num_live=live, batch_capacity=16,
                       num_waiting=waiting, num_critical=critical)


def test_policy_reads_serve_metrics_and_returns_a_target_with_its_reasons():
    policy = ServingSignalsPolicy()
    target, state = policy(ctx({0: load(demand=150.0, live=6)}))
    assert target == 2  # 150 tok/s over Γ = 100 at 80%
    assert state[STATE_KEY]["reason"] == "rate" and state[STATE_KEY]["replicas_reporting"] == 1
    assert policy(ctx({0: load(), 1: load()}))[0] == 1  # idle: down to one


def test_a_replica_without_metrics_yet_and_a_starting_one_hold_the_fleet():
    policy = ServingSignalsPolicy()
    # Replica 1 is running but has not reported: no scale-down on the one that has.
    target, state = policy(ctx({0: load(), 1: None}))
    assert (target, state[STATE_KEY]["reason"]) == (2, "hold")
    # A scale-up in flight (target 2, one running): holding means 2, not a scale-down to the running count.
    target, state = policy(ctx({0: load(demand=10.0, waiting=3)}, target=2))
    assert (target, state[STATE_KEY]["reason"]) == (2, "pending")


def test_drain_hook_is_the_seam_before_a_scale_down():
    DRAIN_READY[0] = False
    policy = ServingSignalsPolicy(drain_hook=f"{__name__}:hold_until_ready")
    target, state = policy(ctx({0: load(), 1: load()}))
    assert (target, state[STATE_KEY]["reason"]) == (2, "draining")
    DRAIN_READY[0] = True
    assert policy(ctx({0: load(), 1: load()}))[0] == 1


def test_serve_resolves_the_class_with_policy_kwargs_and_applies_delays_and_bounds():
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    settings = AutoscalingSettings(min_replicas=1, max_replicas=3, upscale_delay_s=0.0, downscale_delay_s=5.0,
                                   target_utilization=0.5, downscale_utilization=0.25)
    cfg = AutoscalingConfig(**settings.serve_autoscaling_config(initial_replicas=1))
    assert cfg.policy.policy_function == POLICY_PATH
    policy = _apply_autoscaling_config(_resolve_policy_callable(cfg.policy))  # what the controller runs
    target, _ = policy(ctx({0: load(demand=90.0)}, config=cfg))
    assert target == 2  # 90 / (0.5 * 100): the kwargs reached the instance
    # A scale-down is wanted but downscale_delay_s has not passed: Serve holds the target.
    target, state = policy(ctx({0: load(), 1: load()}, config=cfg))
    assert target == 2 and state[STATE_KEY]["reason"] == "down"


def test_serve_config_autoscaling_fields():
    cfg = ServeConfig(images=False, autoscaling={"min_replicas": 1, "max_replicas": 3, "downscale_delay_s": 10})
    assert isinstance(cfg.autoscaling, AutoscalingSettings) and cfg.autoscaling.downscale_delay_s == 10
    opts = replica_count_options(cfg)
    assert "num_replicas" not in opts and opts["graceful_shutdown_timeout_s"] == 600.0
    assert opts["graceful_shutdown_wait_loop_s"] == 0.5  # a drained replica leaves soon after its streams moved
    assert opts["autoscaling_config"]["policy"]["policy_kwargs"]["target_utilization"] == 0.8
    AutoscalingConfig(**opts["autoscaling_config"])  # Serve accepts it
    assert replica_count_options(ServeConfig(images=False, replicas=2)) == {"num_replicas": 2}
    with pytest.raises(AttributeError):
        cfg.autoscaling.max_replicas = 9  # frozen


@pytest.mark.parametrize("bad, match", [
    ({"min_replicas": 0}, "min_replicas"),
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
    ({"metrics_interval_s": 0}, "metrics_interval_s"),
    ({"look_back_period_s": 0.5, "metrics_interval_s": 0.5}, "look_back_period_s"),
    ({"downscale_delay_s": -1}, "downscale_delay_s"),
    ({"drain_timeout_s": 0}, "drain_timeout_s"),
    ({"target_utilization": 0.3}, "utilization"),
    ({"drain_hook": "no_such_module_xyz:f"}, "no_such_module_xyz"),
    ({"drain_hook": "nocolon"}, "drain_hook"),
    ({"max_replica": 2}, "unknown autoscaling keys"),
])
def test_bad_autoscaling_settings_raise(bad, match):
    with pytest.raises((ValueError, ImportError), match=match):
        ServeConfig(images=False, autoscaling=bad)


def test_initial_replicas_must_lie_within_the_bounds():
    with pytest.raises(ValueError, match="initial count"):
        ServeConfig(images=False, replicas=4, autoscaling={"min_replicas": 1, "max_replicas": 3})
    with pytest.raises(ValueError, match="mapping"):
        ServeConfig(images=False, autoscaling=3)
