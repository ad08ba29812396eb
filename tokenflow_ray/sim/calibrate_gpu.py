"""A profile of the real engine on a GPU, fitted on its serving runs (real_runs.py), and the replay of a run.

The fit (`fit_measured`):
1. **The step law and what new shapes cost**, on a run whose plans the simulator replays step for step (fcfs at a
   burst decides nothing from the clock: `aligned_keys` checks every step's decodes, prefill tokens and context
   against the run's). Each step's attention shapes are then known (cold_start.py), and one least-squares fit
   gives t = a + b_d·decodes + b_p·prefill tokens + b_c·context + c_d·(new decode shapes) + c_p·(new prefill
   shapes), the costs held >= 0. Without such a run, the law is fitted on the steps it predicts within
   `COLD_THRESHOLD_S` (the slow ones are left out) and a new shape costs the median excess of the slow decode steps.
2. **Per policy** (`CalibratedStepCost.for_policy`, as `validate` does): another policy's per-step and per-decode
   terms are refitted on its own warm steps (those within `COLD_THRESHOLD_S` of the law plus half a cold shape):
   its planning work, its copies' launches.
3. **Copies** at the runs' measured median bandwidth, loads after evictions (the CUDA copier's load stream waits
   for its evict stream), and beside the step.

The replay (`replay`): the run's engine config and exact requests on that profile, after the warm-up the run had
(its `warmup_samples`, else the project's standard warm-up request replayed on the profile): the engine's cost model
then starts from what the real one had learnt, which sets how many streams tokenflow admits at first.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tokenflow_ray.engine.step_time_model import StepTimeFit
from tokenflow_ray.sim.cold_start import ColdStart, new_shape_counts
from tokenflow_ray.sim.cost import CalibratedStepCost, HostLink, StepShape
from tokenflow_ray.sim.real_runs import STANDARD_WARMUP, RealRun, Sample
from tokenflow_ray.sim.simulator import ReplicaSetup, SimOutcome, Simulation

COLD_THRESHOLD_S = 0.03  # a step this much slower than the law paid for something the law does not price
DEFAULT_BANDWIDTH = 27e9  # the H200 run's median copy bandwidth, when no run measured one


@dataclass(frozen=True)
class MeasuredProfile:
    """An engine on a device as measured: its step law per policy, new-shape costs and copy link."""

    laws: dict[str, CalibratedStepCost]
    cold: ColdStart
    link: HostLink
    source: str = ""

    def law(self, policy: str) -> CalibratedStepCost:
        """The policy's own law; a policy with no run takes tokenflow's (andes ranks and rebalances every Δt too,
        as SCHEDULER_OVERHEAD_S assumes), else fcfs's."""
        return self.laws.get(policy) or self.laws.get("tokenflow") or self.laws["fcfs"]

    def replica(self, engine, info) -> ReplicaSetup:
        policy = engine.scheduler.policy
        return ReplicaSetup(engine=engine, info=info, cost=self.law(policy), link=self.link, cpu_overhead_s=0.0,
                            cold=self.cold)

    def to_dict(self) -> dict:
        return {"laws": {p: {"fixed_s": c.fit.fixed_s, "decode_s": c.fit.decode_s, "prefill_s": c.fit.prefill_s,
                             "context_s": c.context_s} for p, c in self.laws.items()},
                "cold": self.cold.to_dict(),
                "link": {"bytes_s": self.link.bytes_s, "duplex": self.link.duplex}, "source": self.source}


@dataclass(frozen=True)
class MeasuredFit:
    profile: MeasuredProfile
    method: str  # "aligned replay" | "threshold"
    steps_fitted: int
    rms_s: float  # of the base law (with cold shapes) on the steps it was fitted on
    dropped: int  # steps left out as outliers


# ---- the replay -----------------------------------------------------------------------------------------------
def replay(run: RealRun, setup: ReplicaSetup, checks: bool = True,
           log_steps: bool = False) -> tuple[SimOutcome, Simulation, float]:
    """The run's requests on `setup`, after the run's warm-up; returns (outcome, simulation, warm-up end time).
    Records keep the clock's times; every summary figure is a difference of times, so the offset cancels."""
    sim = Simulation(setup, checks=checks)
    replica = sim.replicas[0]
    if run.warmup is not None:  # what the real engine's cost model learnt before the run
        cost = replica.engine.scheduler.cost
        for shape, t in run.warmup:
            cost.observe_step(t, shape.decodes, shape.prefill_tokens, 0.0, 0, step_s=t)
        start = 0.0
    else:
        start = sim.warm_up(*STANDARD_WARMUP)
    if log_steps:
        replica.runner.step_log = []
    requests = [replace(r, arrival_s=r.arrival_s + start) for r in run.requests]
    return sim.run(requests), sim, start


def first_prefill_tokens(run: RealRun, setup: ReplicaSetup) -> int:
    """How many prompt tokens the replay's first step (after the warm-up) prefills: what the policy admitted at
    t = 0. Plans that one step only."""
    sim = Simulation(setup, checks=False)
    start = sim.warm_up(*STANDARD_WARMUP)
    engine = sim.replicas[0].engine
    for r in run.requests:
        if r.arrival_s == 0.0:
            sim._add(sim.replicas[0], replace(r, arrival_s=start))
    plan = engine.begin_step().plan
    return 0 if plan is None else sum(len(c.token_ids) for c in plan.prefills)


def warmup_matching_first_step(run: RealRun, setup: ReplicaSetup, rounds: int = 20) -> ColdStart | None:
    """For a run without `warmup_samples`: the warm-up's first-step cost (not recorded) that makes the replay's
    first step admit what the run's did, when the policy's first admission depends on it (tokenflow's: the
    working-set cap 2Γ/r, Γ learnt from the warm-up's steps); None when it does not (fcfs) or when no cost in
    [0, 4] s matches. A bisection: a dearer first step teaches a larger per-step cost, a smaller Γ, fewer streams."""
    if run.warmup is not None or setup.cold is None:
        return None
    want = run.samples[0][0].prefill_tokens

    def admitted(first_step_s: float) -> int:
        return first_prefill_tokens(run, replace(setup, cold=replace(setup.cold, first_step_s=first_step_s)))

    lo, hi = 0.0, 4.0
    at_lo, at_hi = admitted(lo), admitted(hi)
    if at_lo == at_hi or not at_hi <= want <= at_lo:
        return None
    for _ in range(rounds):  # admitted(lo) >= want >= admitted(hi)
        mid = (lo + hi) / 2
        if admitted(mid) > want:
            lo = mid
        else:
            hi = mid
    return replace(setup.cold, first_step_s=hi if admitted(hi) == want else (lo + hi) / 2)


def aligned_keys(run: RealRun, setup: ReplicaSetup) -> list[list[tuple[int, ...]]] | None:
    """Each real step's attention-shape keys, if the replay plans the run's steps exactly (else None)."""
    _, sim, _ = replay(run, setup, checks=False, log_steps=True)
    log = sim.replicas[0].runner.step_log
    if len(log) < len(run.samples):
        return None
    for step, (real, _) in zip(log, run.samples):
        if (step.shape.decodes, step.shape.prefill_tokens, step.shape.decode_context) != \
                (real.decodes, real.prefill_tokens, real.decode_context):
            return None
    return [step.keys for step in log[:len(run.samples)]]


# ---- the fit --------------------------------------------------------------------------------------------------
def fit_measured(runs: Sequence[RealRun], bandwidth: float | None = None, grid: dict | None = None) -> MeasuredFit:
    """`grid`: a step grid run in a fresh process (step_grid.json): its first step, less what the law and one new
    prefill shape price, is the process's first-step cost (kernels loaded on first use), which the warm-up pays."""
    if not runs:
        raise ValueError("calibration: no runs")
    base = next((r for r in runs if r.policy == "fcfs"), runs[0])
    bws = [r.copy_bytes_s for r in runs if r.copy_bytes_s]
    link = HostLink(bandwidth or (statistics.median(bws) if bws else DEFAULT_BANDWIDTH), duplex=False)
    law0 = _threshold_law(base.samples)
    keys = aligned_keys(base, ReplicaSetup(base.engine, base.info, law0, link))
    if keys is not None:
        counts = new_shape_counts(keys)
        law, cold, rms, dropped = _joint_fit(base.samples, counts)
        if grid is not None and (prefill_s := _grid_prefill_s(grid, law.fit.fixed_s)) is not None:
            law, cold, rms, dropped = _joint_fit(base.samples, counts, prefill_s=prefill_s)
        method = "aligned replay"
    else:
        law = law0
        excess = [t - law.step_s(s) for s, t in base.samples if s.prefill_tokens == 0 and s.decodes
                  and t - law.step_s(s) > COLD_THRESHOLD_S]
        cold_s = statistics.median(excess) if excess else 0.0
        cold = ColdStart(cold_s, cold_s)
        warm = _warm(base.samples, law, cold)
        rms = _rms(warm, law)
        dropped, method = len(base.samples) - len(warm), "threshold"
    if grid is not None and (first := _first_grid_step(grid)) is not None:
        shape, t = first
        cold = replace(cold, first_step_s=max(0.0, t - law.step_s(shape) - cold.prefill_shape_s))
    laws = {base.policy: law}
    for r in runs:
        if r.policy not in laws:
            laws[r.policy] = _policy_law(r.samples, law, cold)
    profile = MeasuredProfile(laws, cold, link, source=", ".join(r.path for r in runs))
    return MeasuredFit(profile, method, len(base.samples) - dropped, rms, dropped)


def _first_grid_step(grid: dict) -> Sample | None:
    runs = list(grid.get("runs", {}).values())
    steps = runs[0].get("steps") if runs else None
    if not steps:
        return None
    s = steps[0]
    shape = StepShape(s["decodes"], s["prefill_tokens"], s["decode_context"], s.get("prefill_pairs", 0.0),
                      s.get("sampled", s["decodes"]))
    return shape, float(s["s"])


def _threshold_law(samples: Sequence[Sample], rounds: int = 5) -> CalibratedStepCost:
    """The law on the steps it predicts within COLD_THRESHOLD_S, refitted until that set stops changing."""
    law = CalibratedStepCost.from_samples(samples)
    kept = list(samples)
    for _ in range(rounds):
        new = [(s, t) for s, t in samples if t - law.step_s(s) <= COLD_THRESHOLD_S]
        if len(new) == len(kept) or len(new) < 8:
            break
        kept = new
        law = CalibratedStepCost.from_samples(kept)
    return law


def _policy_law(samples: Sequence[Sample], law: CalibratedStepCost, cold: ColdStart,
                rounds: int = 5) -> CalibratedStepCost:
    """`law.for_policy` on the policy's warm steps, judged against its own law as it is refitted (a policy whose
    steps carry more per-step work would otherwise lose its slower warm steps to the cold ones)."""
    own = law
    for _ in range(rounds):
        refit = law.for_policy(_warm(samples, own, cold))
        if refit == own:
            break
        own = refit
    return own


def _warm(samples: Sequence[Sample], law: CalibratedStepCost, cold: ColdStart) -> list[Sample]:
    """Steps that paid for no new shape, as far as the law can tell: within half a cold shape of it."""
    margin = max(COLD_THRESHOLD_S, 0.5 * min(cold.decode_shape_s, cold.prefill_shape_s or cold.decode_shape_s))
    return [(s, t) for s, t in samples if t - law.step_s(s) <= margin]


def _rms(samples: Sequence[Sample], law: CalibratedStepCost) -> float:
    return statistics.fmean((t - law.step_s(s)) ** 2 for s, t in samples) ** 0.5 if samples else 0.0


def _joint_fit(samples: Sequence[Sample], counts: Sequence[tuple[int, int]], outlier_s: float = 0.5,
               prefill_s: float | None = None) -> tuple[CalibratedStepCost, ColdStart, float, int]:
    """Least squares with every cost >= 0 over the replayed steps (`counts`: each step's new decode and prefill
    shapes). A step off the fit by more than `outlier_s` (a one-off the law cannot know) is left out and the fit
    repeated once. `prefill_s`: the cost per prefill token, when known from elsewhere (a serving run's prefill
    steps nearly all carry new shapes, so the two costs are hardly separable there: `_grid_prefill_s`)."""
    x = np.array([(1.0, s.decodes, s.prefill_tokens, s.decode_context, d, p)
                  for (s, _), (d, p) in zip(samples, counts)], dtype=float)
    y = np.array([t for _, t in samples], dtype=float)
    if prefill_s is not None:
        y = y - prefill_s * x[:, 2]
        x[:, 2] = 0.0
    work = (x[:, 1] + x[:, 2]) > 0  # a step that ran no tokens (copies, a stream's end) is no step of the law
    keep = work.copy()
    for _ in range(2):
        theta = _nnls(x[keep], y[keep])
        new_keep = work & (np.abs(y - x @ theta) <= outlier_s)
        if (new_keep == keep).all():
            break
        keep = new_keep
    rms = float(np.sqrt(np.mean((y - x @ theta)[keep] ** 2)))
    a, b_d, b_p, b_c, c_d, c_p = (float(v) for v in theta)
    law = CalibratedStepCost(StepTimeFit(a, b_d, max(b_p if prefill_s is None else prefill_s, 1e-9)), b_c)
    return law, ColdStart(c_d, c_p), rms, int((work & ~keep).sum())


def _grid_prefill_s(grid: dict, fixed_s: float) -> float | None:
    """Seconds per prefill token from a step grid: the first step of each grid run whose prompt length an earlier
    run of the same process had already prefilled (no new shape: B prompts of P tokens, one chunk of the step
    budget), less the law's per-step cost, per token; the median over such runs."""
    seen: set[int] = set()
    rates = []
    for run in grid.get("runs", {}).values():
        steps, prompt = run.get("steps") or [], run.get("prompt")
        if steps and prompt in seen and steps[0].get("decodes") == 0 and steps[0].get("prefill_tokens"):
            rates.append((steps[0]["s"] - fixed_s) / steps[0]["prefill_tokens"])
        seen.add(prompt)
    return statistics.median(rates) if rates else None


def speed_trace(run: RealRun, law: CalibratedStepCost, cold: ColdStart, window_s: float = 1.0,
                min_steps: int = 3) -> tuple[tuple[float, float], ...]:
    """The run's pace over time (cold_start.ColdStart.speed): per `window_s` of the run, the ratio of its warm
    decode steps' time to the law's; a window with fewer than `min_steps` of them keeps the previous pace. A step
    is warm when it is within 3/4 of a new decode shape's cost of the law: a slow stretch (+12 ms) and a step's
    copies stay in, new shapes stay out (a tighter cut would take a slow window's slower steps out with them)."""
    margin = max(COLD_THRESHOLD_S, 0.75 * cold.decode_shape_s)
    windows: list[tuple[float, list[float], list[float]]] = []  # (start, real, law) of each window's warm steps
    t = 0.0
    for shape, step in run.samples:
        start = (t // window_s) * window_s
        if not windows or windows[-1][0] != start:
            windows.append((start, [], []))
        pred = law.step_s(shape)
        if shape.prefill_tokens == 0 and shape.decodes and pred > 0 and step - pred <= margin:
            windows[-1][1].append(step)
            windows[-1][2].append(pred)
        t += step
    return tuple((start, sum(real) / sum(pred)) for start, real, pred in windows if len(real) >= min_steps)


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (Lawson-Hanson active set, for a handful of columns)."""
    n = x.shape[1]
    passive = np.zeros(n, dtype=bool)
    theta = np.zeros(n)
    for _ in range(3 * n):
        grad = x.T @ (y - x @ theta)
        free = ~passive & (grad > 1e-12 * max(1.0, float(np.abs(grad).max())))
        if not free.any():
            break
        passive[int(np.argmax(np.where(free, grad, -np.inf)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(x[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                theta = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(theta[neg] / (theta[neg] - z[neg]))
            theta = theta + alpha * (z - theta)
            passive &= theta > 1e-15
    return theta


def grid_check(grid: dict, profile: MeasuredProfile, policy: str = "fcfs") -> dict:
    """The fitted law against a step grid (`step_grid.json`: B streams of P prompt tokens, every step timed), per
    grid run: the median decode step with all B streams decoding against the law at that step's median context
    (`err`: (law − real) / real)."""
    law = profile.law(policy)
    out = {}
    for name, run in grid.get("runs", {}).items():
        steps = run.get("steps", [])
        decodes = [s for s in steps if s.get("prefill_tokens") == 0 and s.get("decodes")]
        if not decodes:
            continue
        full = max(s["decodes"] for s in decodes)  # the grid point's batch: every stream decoding
        decodes = [s for s in decodes if s["decodes"] == full]
        mid = sorted(decodes, key=lambda s: s["decode_context"])[len(decodes) // 2]
        shape = StepShape(full, 0, mid["decode_context"], 0.0, full)
        real, pred = statistics.median(s["s"] for s in decodes), law.step_s(shape)
        out[name] = {"batch": full, "context": mid["decode_context"], "real_s": real, "law_s": pred,
                     "err": (pred - real) / real}
    return out
