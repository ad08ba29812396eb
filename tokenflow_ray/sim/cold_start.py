"""What a step of the measured engine pays beyond its step law because something is not yet warm.

Measured on the H200 runs of this engine (../shared/data/h200/, torch SDPA, no CUDA graphs):
- **New attention shapes.** A step whose attention shapes the process had not run before took ~56-61 ms more than
  the same step at a known shape. The fcfs run's plans replay exactly in the simulator (fcfs decides nothing from
  the clock), so every real step's shapes are known: of its 3,327 decode-only steps 411 were slow (> 45 ms against
  ~18 ms) and 410 were the first at their (batch, table width) pair; none of the first-seen ones was fast. A decode
  step's attention shape is its batch D and the width W of the gathered block tables (the longest context's
  blocks: runner/step_state.py pads every row to it); a prefill chunk's is its length (a whole prompt, causal) or
  its length and context (a later chunk or a recompute, against the pool). Which cache it is (a cuDNN SDPA graph
  per shape, or kernel re-selection) the run cannot tell. tokenflow's rotation paid it in 842 steps (65 s of its 144 s
  run) against fcfs's 526 (39 s).
- **The process's first step** (kernels loaded on first use): the step grid's first step, 0.56 s for a 512-token
  prompt, ~0.47 s more than the law and a new shape price. A run's standard warm-up pays it.
- **Pace over time.** Warm steps switch between two paces, ~17 ms and ~29 ms at the same batch (fcfs), in stretches
  of 0.5-10 s (both runs began with a slow stretch of ~11.5 s). Not a shape, not the batch: a host-side stall of
  ~12 ms a step (a thread contending for the GIL would look like this) the runs cannot name. `speed` replays such a
  pace (factor on every step, by time since the run began): the run's own, measured, when a run is replayed
  (calibrate_gpu.speed_trace), else none (the law's mean pace).

`ColdState` is one process's state: the simulator keeps one per replica (sim_runner.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from tokenflow_ray.engine.plan import StepPlan


@dataclass(frozen=True)
class ColdStart:
    decode_shape_s: float = 0.0  # extra seconds for a decode step at a (batch, table width) pair not run before
    prefill_shape_s: float = 0.0  # extra seconds per prefill chunk shape not run before
    first_step_s: float = 0.0  # extra seconds for the process's first step (kernels loaded on first use)
    # ((t, factor), ...): from t seconds after the run began, every step costs factor x (until the next entry)
    speed: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("decode_shape_s", "prefill_shape_s", "first_step_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"cold start: {name} must be a finite number >= 0, got {v!r}")
        times = [t for t, _ in self.speed]
        if times != sorted(times) or any(not (math.isfinite(f) and f > 0) for _, f in self.speed):
            raise ValueError("cold start: speed must be (time, factor > 0) pairs in time order")

    @property
    def active(self) -> bool:
        return bool(self.decode_shape_s or self.prefill_shape_s or self.first_step_s or self.speed)

    def to_dict(self) -> dict:
        return {"decode_shape_s": self.decode_shape_s, "prefill_shape_s": self.prefill_shape_s,
                "first_step_s": self.first_step_s, "speed_entries": len(self.speed)}


def shape_keys(plan: StepPlan, block_size: int) -> list[tuple[int, ...]]:
    """The step's attention shapes: (0, D, W) for its decodes, (1, n) for a whole prompt, (2, n, context) for a
    chunk after the first. O(batch): one pass over the decodes for the longest context."""
    keys: list[tuple[int, ...]] = []
    if plan.decodes:
        longest = max(c.start_pos for c in plan.decodes)
        keys.append((0, len(plan.decodes), longest // block_size + 1))
    for c in plan.prefills:
        n = len(c.token_ids)
        keys.append((1, n) if c.start_pos == 0 else (2, n, c.start_pos + n))
    return keys


def new_shape_counts(keys_per_step: list[list[tuple[int, ...]]]) -> list[tuple[int, int]]:
    """(new decode shapes, new prefill shapes) of each step of one process, in order (a shape twice in one step is
    new once)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for keys in keys_per_step:
        new = set(keys) - seen
        seen.update(new)
        decodes = sum(1 for k in new if k[0] == 0)
        out.append((decodes, len(new) - decodes))
    return out


class ColdState:
    """One engine process: the shapes it has run, its steps so far, and when its run began (for `speed`)."""

    def __init__(self, cold: ColdStart, block_size: int) -> None:
        self.cold = cold
        self.block_size = block_size
        self._seen: set[tuple[int, ...]] = set()
        self.steps = 0
        self.run_start: float | None = None  # set by the first timed step, or by `start_run`
        self.cold_steps = 0  # steps that paid for at least one new shape (or the first step)
        self.cold_s = 0.0  # what new shapes and the first step added
        self.speed_extra_s = 0.0  # what `speed` added (negative where the pace was faster than the law)
        self._times = [t for t, _ in cold.speed]

    def start_run(self, now: float) -> None:
        """A run begins now (after a warm-up): `speed` counts from here."""
        self.run_start = now

    def step_s(self, plan: StepPlan, compute_s: float, now: float | None) -> float:
        """The step's time: its law's `compute_s` plus what is cold (and marks its shapes run)."""
        c = self.cold
        extra = c.first_step_s if self.steps == 0 else 0.0
        self.steps += 1
        if c.decode_shape_s or c.prefill_shape_s:
            extra += self._new(shape_keys(plan, self.block_size))
        if extra:
            self.cold_steps += 1
            self.cold_s += extra
        t = compute_s + extra
        if now is not None and c.speed:
            if self.run_start is None:
                self.run_start = now
            i = bisect.bisect_right(self._times, now - self.run_start) - 1
            if i >= 0:  # the whole step: fcfs's new-shape steps took ~107 ms in its slow first stretch, ~70 after
                factor = c.speed[i][1]
                self.speed_extra_s += t * (factor - 1)
                t *= factor
        return t

    def _new(self, keys: list[tuple[int, ...]]) -> float:
        extra = 0.0
        seen = self._seen
        for k in keys:
            if k not in seen:
                seen.add(k)
                extra += self.cold.decode_shape_s if k[0] == 0 else self.cold.prefill_shape_s
        return extra
