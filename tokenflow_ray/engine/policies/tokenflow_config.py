"""tokenflow's knobs (module docstring of tokenflow.py for what each does, pacing.py for pace_*)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TokenFlowConfig:
    delta_t: float = 0.5  # Δt: seconds between working-set decisions
    mu: float = 2.0  # buffer conservativeness: a victim's buffer must cover μ × the switch cost
    lam: float = 0.5  # λ: working-set adjustment rate (0: jump to W_static; towards 1: grow ever slower)
    gamma: float = 1.0  # γ: weight of the buffer penalty against time kept waiting
    t_critical: float = 1.0  # seconds of buffer under which a stream is critical (stress trigger, penalty scale)
    overload_margin: float = 2.0  # fall back to FCFS when the working set's Σ rates > margin × Γ (docstring)
    pace: bool = True  # [extension] deadline-aware pacing (pacing.py)
    pace_slack: float = 0.05  # paced generation may end this fraction of the time to D after D
    pace_buffer: float = 0.3  # a paced stream is held only while its reader holds this share of its length
    pace_min_read_share: float = 0.5  # ... and only if its reader could read this share of it by D (pacing.py)
    capacity_from: str = "decode_steps"  # Γ from: decode steps' own clipped model | all steps (cost_model.py)
    overload_hysteresis: float = 0.1  # leave the FCFS fallback at Σ rates < (1 - this) x margin x Γ
    growth_reserve: bool = True  # in the FCFS fallback, admissions leave room for the running set's growth until Δt
    ranking: str = "tiers"  # utility: by utility alone | tiers: due, then full-value running, then ... (rank())
    switch_link_share: float | None = 0.25  # reloads a rebalance starts: at most this share of the link for Δt
    recompute_weight: str = "batch"  # resume_by_load: t_recompute counts once ("one") or for the batch it delays
    patience_s: float = 2.0  # a rebalance pauses nobody for what running streams free by finishing within this
    pace_while_waiting: bool = False  # pacing holds streams also while others wait for the device
    # A rebalance pauses nobody for a new stream while a paused stream's reader holds under this many of its leads
    # (μ·(resume + Δt)): its memory is needed back first (resumes_behind). 0: newcomers may always displace.
    behind_leads: float = 2.0

    def __post_init__(self) -> None:
        for name in ("delta_t", "mu", "t_critical", "overload_margin"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"tokenflow.{name}: must be a finite number > 0, got {value!r}")
        if not 0.0 <= self.lam < 1.0:  # λ = 1 would freeze the working set at its current size forever
            raise ValueError(f"tokenflow.lam: must be in [0, 1), got {self.lam!r}")
        if not (isinstance(self.pace_slack, (int, float)) and 0 <= self.pace_slack <= 1):
            raise ValueError(f"tokenflow.pace_slack: must be in [0, 1], got {self.pace_slack!r}")
        for name in ("pace_buffer", "pace_min_read_share"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 1):
                raise ValueError(f"tokenflow.{name}: must be in [0, 1], got {value!r}")
        if not (math.isfinite(self.gamma) and self.gamma >= 0):
            raise ValueError(f"tokenflow.gamma: must be >= 0, got {self.gamma!r}")
        if self.capacity_from not in ("decode_steps", "all_steps"):
            raise ValueError(f"tokenflow.capacity_from: decode_steps or all_steps, got {self.capacity_from!r}")
        if self.switch_link_share is not None and not (math.isfinite(self.switch_link_share)
                                                       and self.switch_link_share > 0):
            raise ValueError(f"tokenflow.switch_link_share: None or > 0, got {self.switch_link_share!r}")
        if self.recompute_weight not in ("one", "batch"):
            raise ValueError(f"tokenflow.recompute_weight: one or batch, got {self.recompute_weight!r}")
        for name in ("patience_s", "behind_leads"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"tokenflow.{name}: must be a finite number >= 0, got {value!r}")
        if self.ranking not in ("utility", "tiers"):
            raise ValueError(f"tokenflow.ranking: utility or tiers, got {self.ranking!r}")
        if not 0 <= self.overload_hysteresis < 1:
            raise ValueError(f"tokenflow.overload_hysteresis: must be in [0, 1), got {self.overload_hysteresis!r}")

    @classmethod
    def as_run(cls, given: Mapping[str, object]) -> TokenFlowConfig:
        """The config a recorded run used, from the fields it recorded: a field it does not name did not exist
        when it ran and takes the value that behaves as before it existed (`AS_BEFORE`), so the simulator
        replays an old run with the code that made it."""
        known = {f.name for f in fields(cls)}
        if unknown := set(given) - known:
            raise ValueError(f"tokenflow config: unknown fields {sorted(unknown)}")
        return cls(**{**AS_BEFORE, **given})


# Fields added after the first GPU runs (commit 5e9bf8e), with the value that behaves as the code did before them.
# `pace` existed then, off by default (its D and hold rule were older; `pace` is off in every replay of those runs).
AS_BEFORE: dict[str, object] = {"pace": False, "capacity_from": "all_steps", "overload_hysteresis": 0.0,
                                "growth_reserve": False, "ranking": "utility", "switch_link_share": None,
                                "recompute_weight": "one", "patience_s": 0.0, "pace_while_waiting": True,
                                "behind_leads": 0.0}
