"""`tokenflow simulate validate --real PATH...`: real GPU serving runs replayed in the simulator.

The runs (real_runs.py's format) calibrate a profile of the engine as measured (calibrate_gpu.py: the step law,
what new attention shapes cost, the policy's own per-step terms, the copy bandwidth); then each run's exact
requests replay on that profile with the run's engine config, after the warm-up the run had, at the pace the run
kept over time (`calibrate_gpu.speed_trace`: its warm steps' time against the law, per second; the H200 runs'
steps switch between a ~17 ms and a ~29 ms pace in stretches of seconds, which the law can only average).

Per run: the relative error |sim − real| / real of TTFT p50/p99, raw and effective throughput and stall
(`errors: {run: {<metric>_err}}`, and the worst over runs as top-level `<metric>_err`, as `validate` writes them),
where each sim figure is the median over replays whose law's per-step and per-decode costs are scaled by
`LAW_FACTORS` (within its fit's uncertainty). One replay is one draw of a controller that decides on a capacity it
learns from step times: the tokenflow of commit 5e9bf8e on this setup admits past its 200th stream before its first
freeze or not, its TTFT p50 is then ~5 s or ~20 s, and its P99 moves by ±5% with a 2% change of the law. Beside
them: `errors_single` (the law as fitted), `errors_mean_pace` (at the law's mean pace instead of the run's),
`sensitivity` (each figure's min, median and max over the ensemble, and how many members land within 15% of the
real figure), and the real run's slow steps beside the replay's cold steps. With `grid`, the law is checked
against a step grid at batch sizes the serving runs did not visit.

A run without `warmup_samples` replays after the standard warm-up, its first step's cost from the grid; where the
policy's first admission depends on what that warm-up taught (tokenflow's cap 2Γ/r), the first-step cost is the one
whose replay admits at t = 0 what the run did (`warmup_first_step_s`, `warmup_matched_to_first_step`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from tokenflow_ray.engine.step_time_model import StepTimeFit
from tokenflow_ray.sim.calibrate_gpu import (
    COLD_THRESHOLD_S,
    MeasuredProfile,
    fit_measured,
    grid_check,
    replay,
    speed_trace,
    warmup_matching_first_step,
)
from tokenflow_ray.sim.cost import CalibratedStepCost
from tokenflow_ray.sim.experiments import summarize_outcome
from tokenflow_ray.sim.real_runs import RealRun, read_real_run

METRICS = {"ttft_p50": "ttft_p50_s", "ttft_p99": "ttft_p99_s", "raw_tput": "raw_tput",
           "effective_tput": "effective_tput", "stall": "stall_s"}
LAW_FACTORS = (0.98, 1.0, 1.02)


def _err(sim: object, real: object) -> float | None:
    if not isinstance(sim, (int, float)) or not isinstance(real, (int, float)) or real == 0:
        return None
    return abs(sim - real) / abs(real)


def _errors(sim: dict, real: dict) -> dict:
    return {f"{m}_err": _err(sim.get(k), real.get(k)) for m, k in METRICS.items()}


def scaled(profile: MeasuredProfile, law: float) -> MeasuredProfile:
    """The profile with every law's per-step and per-decode costs times `law`."""
    laws = {p: CalibratedStepCost(StepTimeFit(c.fit.fixed_s * law, c.fit.decode_s * law, c.fit.prefill_s),
                                  c.context_s) for p, c in profile.laws.items()}
    return replace(profile, laws=laws)


def _ensemble(members: list[dict], real: dict) -> tuple[dict, dict]:
    """(the members' per-metric median summary, the sensitivity record)."""
    median = dict(members[len(members) // 2])
    sens: dict = {"law_factors": list(LAW_FACTORS)}
    for m, k in METRICS.items():
        values = sorted(r[k] for r in members)
        median[k] = values[len(values) // 2]
        sens[m] = {"min": values[0], "median": median[k], "max": values[-1],
                   "within_15pct": sum(1 for v in values if (_err(v, real[k]) or 0) <= 0.15), "members": len(values)}
    return median, sens


def replay_summary(run: RealRun, profile: MeasuredProfile, run_pace: bool = True, checks: bool = True) -> dict:
    """The simulator's summary of `run` replayed on `profile` (times relative to the run's start). `run_pace`: at
    the pace the run kept over time, else at the law's mean pace."""
    if run_pace:
        pace = speed_trace(run, profile.law(run.policy), profile.cold)
        profile = replace(profile, cold=replace(profile.cold, speed=pace))
    outcome, sim, start = replay(run, profile.replica(run.engine, run.info), checks=checks)
    summary = summarize_outcome(outcome)
    summary["completion_s"] -= start
    totals = sim.replicas[0].runner.totals
    summary.update(cold_steps=totals.cold_steps, cold_s=totals.cold_s, pace_s=totals.speed_s)
    return summary


def validate_real(paths: Sequence[str], grid: dict | None = None, checks: bool = True,
                  progress=print) -> dict:
    wall = time.perf_counter()
    runs = [read_real_run(p) for p in paths]
    fit = fit_measured(runs, grid=grid)
    profile = fit.profile
    progress(f"fitted on {fit.steps_fitted} steps ({fit.method}, {fit.dropped} left out, rms "
             f"{fit.rms_s * 1e3:.1f} ms): {profile.to_dict()}")
    results: dict[str, dict] = {}
    for i, run in enumerate(runs):
        key = run.policy if run.policy not in results else f"{run.policy}:{i}"
        # The warm-up is not in these files: where the policy's first admission depends on what the warm-up taught
        # (tokenflow's cap 2Γ/r), its first-step cost is the one that admits what the run admitted at t = 0.
        matched = warmup_matching_first_step(run, profile.replica(run.engine, run.info))
        run_profile = profile if matched is None else replace(profile, cold=matched)
        members = [replay_summary(run, scaled(run_profile, f), checks=checks) for f in LAW_FACTORS]
        single = members[LAW_FACTORS.index(1.0)]
        mean_pace = replay_summary(run, run_profile, run_pace=False, checks=checks)
        real = dict(run.summary)
        law = profile.law(run.policy)
        slow = [t - law.step_s(s) for s, t in run.samples if t - law.step_s(s) > COLD_THRESHOLD_S]
        real.update(slow_steps=len(slow), slow_s=sum(slow))
        sim, sensitivity = _ensemble(members, real)
        results[key] = {
            "path": run.path, "real": real, "sim": sim, "errors": _errors(sim, real),
            "sim_single": single, "errors_single": _errors(single, real),
            "sim_mean_pace": mean_pace, "errors_mean_pace": _errors(mean_pace, real),
            "warmup_first_step_s": run_profile.cold.first_step_s, "warmup_matched_to_first_step": matched is not None,
            "sensitivity": sensitivity}
        progress(f"{key}: " + ", ".join(f"{m} real {real[k]:.3f} sim {sim[k]:.3f}" for m, k in METRICS.items()))
    worst = {f"{m}_err": max((r["errors"][f"{m}_err"] for r in results.values()
                              if r["errors"][f"{m}_err"] is not None), default=None) for m in METRICS}
    out = {"runs": results, **worst, "errors": {k: r["errors"] for k, r in results.items()},
           "errors_single": {k: r["errors_single"] for k, r in results.items()},
           "errors_mean_pace": {k: r["errors_mean_pace"] for k, r in results.items()},
           "profile": profile.to_dict(), "fit": {"method": fit.method, "steps": fit.steps_fitted,
                                                 "left_out": fit.dropped, "rms_s": fit.rms_s},
           "wall_s": time.perf_counter() - wall}
    if grid is not None:
        out["step_grid"] = grid_check(grid, profile)
    return out


def print_validate_real(out: dict) -> None:
    print(f"{'run':>18} " + " ".join(f"{m + ' err':>18}" for m in METRICS))
    for key, r in out["runs"].items():
        for label, errors in ((key, r["errors"]), (f"{key} (law as fit)", r["errors_single"]),
                              (f"{key} (mean pace)", r["errors_mean_pace"])):
            print(f"{label:>18} " + " ".join(f"{(errors[m + '_err'] or 0) * 100:17.1f}%" for m in METRICS))
        sens = r["sensitivity"]
        print(f"{'':>18} ensemble (law x{sens['law_factors']}): " + ", ".join(
            f"{m} {sens[m]['min']:.1f}/{sens[m]['median']:.1f}/{sens[m]['max']:.1f} ({sens[m]['within_15pct']} of "
            f"{sens[m]['members']} within 15% of {r['real'][k]:.1f})" for m, k in METRICS.items()))
        print(f"{'':>18} slow steps real {r['real']['slow_steps']} ({r['real']['slow_s']:.1f} s), cold steps sim "
              f"{r['sim']['cold_steps']} ({r['sim']['cold_s']:.1f} s)")
    for name, g in out.get("step_grid", {}).items():
        print(f"step grid {name}: real {g['real_s'] * 1e3:.1f} ms, law {g['law_s'] * 1e3:.1f} ms "
              f"({g['err'] * 100:+.0f}%)")
