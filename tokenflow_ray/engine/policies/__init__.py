"""Scheduling policies, selected by name."""

from __future__ import annotations

from tokenflow_ray.engine.policies.andes import AndesConfig, AndesPolicy
from tokenflow_ray.engine.policies.base import SchedulerView, SchedulingPolicy
from tokenflow_ray.engine.policies.fcfs import FCFSPolicy
from tokenflow_ray.engine.policies.tokenflow import TokenFlowPolicy
from tokenflow_ray.engine.policies.tokenflow_config import TokenFlowConfig

POLICY_NAMES = ("fcfs", "andes", "tokenflow")


def make_policy(name: str, tokenflow: TokenFlowConfig | None = None, andes: AndesConfig | None = None,
                fcfs_reserve_ratio: float = 0.3) -> SchedulingPolicy:
    if name == "fcfs":
        return FCFSPolicy(fcfs_reserve_ratio)
    if name == "andes":
        return AndesPolicy(andes)
    if name == "tokenflow":
        return TokenFlowPolicy(tokenflow)
    raise ValueError(f"policy: unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


__all__ = ["POLICY_NAMES", "AndesConfig", "AndesPolicy", "FCFSPolicy", "SchedulerView", "SchedulingPolicy",
           "TokenFlowConfig", "TokenFlowPolicy", "make_policy"]
