"""`tokenflow simulate validate --trace PATH --window S:M ...`: a replayed trace on the real CPU engine and on the
simulator calibrated on held-out traffic, before any policy figure from the simulator counts (issue 41).

The engine is the one `tokenflow bench policies --trace` runs (the embedded model, device pool 512 blocks, host
2,048, 64 sequences and 256 tokens a step), with PolicyBenchConfig's tokenflow knobs (trace_engine_config).
Calibration is held out: the window right after the compared one, the same length, at the same speed (its own requests, the same regime),
run once under each policy with every step timed whole on the wall clock; fcfs's steps fit the full law
(`CalibratedStepCost.from_samples`: per step, decode, prefill token, decode context token and prefill attention
pair), the other policies refit their per-step and per-decode terms on it (`for_policy`, as `validate` does).
Then the compared window runs `repeats` times under each policy for real (figures are medians, the runs' range
kept as `real_spread`) and once in the simulator on the same requests. Errors are |sim - real| / real, as
`validate` writes them, with TTFT mean and QoE beside its four.

Why calibrate in the run, not from docs/results/runs/sim_validate_cpu.json: that law was measured on another
day's box, where a decode cost 78 us and a prefill token 99 us; this box's engine runs the same short-prompt
calibration at 214 us and 192 us, so every replay on the stored law read the engine twice as fast as it is
(fcfs at 4x: TTFT mean 0.17 s simulated against 8.2 s real).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace

from tokenflow_ray.engine.config import EngineConfig
from tokenflow_ray.lab.policy_bench import TRACE_POOL_BLOCKS, PolicyBenchConfig, bench_engine_config
from tokenflow_ray.lab.sim_validate import METRICS, _err, _median, _ranking, run_real, sim_setup
from tokenflow_ray.metrics.guards import describe, guards
from tokenflow_ray.sim.cost import CalibratedStepCost
from tokenflow_ray.sim.experiments import summarize_outcome
from tokenflow_ray.sim.simulator import Simulation
from tokenflow_ray.workloads.generators import RequestSpec
from tokenflow_ray.workloads.traces import Trace, load_trace

TRACE_METRICS = {**METRICS, "ttft_mean": "ttft_mean_s", "qoe": "qoe_mean"}
SHOWN = ("ttft_mean_s", "ttft_p99_s", "qoe_mean", "stall_per_stream_mean_s", "raw_tput", "effective_tput",
         "preemptions")


def trace_engine_config(policy: str, requests: list[RequestSpec]) -> EngineConfig:
    """The bench's engine for a trace (policy_bench.bench_engine_config at TRACE_POOL_BLOCKS), with
    PolicyBenchConfig's tokenflow: the knobs `tokenflow bench policies --trace` runs by default (pacing on)."""
    return bench_engine_config(replace(PolicyBenchConfig(), pool_blocks=TRACE_POOL_BLOCKS), policy, requests)


def held_out(trace: Trace) -> Trace:
    """The window right after the trace's, the same length, replayed with the same options."""
    if trace.options.window is None:
        raise ValueError("validate --trace: needs --window START_MIN:MINUTES (the window after it calibrates)")
    start, minutes = trace.options.window
    cal = load_trace(trace.path, replace(trace.options, window=(start + minutes, minutes)))
    if not cal.requests:
        raise ValueError(f"{trace.path}: no requests in minutes {start + minutes:g}-{start + 2 * minutes:g} to "
                         "calibrate on; choose an earlier --window")
    return cal


def validate_trace(trace: Trace, policies: tuple[str, ...] = ("fcfs", "tokenflow"), repeats: int = 3,
                   progress: Callable[[str], None] = print) -> dict:
    if "fcfs" not in policies:
        raise ValueError("validate --trace: fcfs calibrates the law; include it in --policy")
    if repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {repeats!r}")
    wall = time.perf_counter()
    cal_trace = held_out(trace)
    policies = ("fcfs", *[p for p in policies if p != "fcfs"])
    calib: dict[str, CalibratedStepCost] = {}
    bandwidth: list[float] = []
    run_real(trace_engine_config("fcfs", cal_trace.requests[:8]), cal_trace.requests[:8])  # warm-up, not recorded: new step shapes
    for policy in policies:
        cal = run_real(trace_engine_config(policy, cal_trace.requests), cal_trace.requests)
        calib[policy] = (CalibratedStepCost.from_samples(cal.samples) if policy == "fcfs"
                         else calib["fcfs"].for_policy(cal.samples))
        bandwidth += cal.copy_bytes_s
        progress(f"calibrated {policy} on {len(cal.samples)} steps of minutes {cal_trace.options.window}: "
                 f"{calib[policy]}")
    info = cal.info
    copy_bw = statistics.median(bandwidth) if bandwidth else 2e9
    real, sim, errors, spread = {}, {}, {}, {}
    for policy in policies:
        config = trace_engine_config(policy, trace.requests)
        runs = [run_real(config, trace.requests).summary for _ in range(repeats)]
        real[policy] = _median(runs)
        spread[policy] = {m: [min(r[k] for r in runs), max(r[k] for r in runs)] for m, k in TRACE_METRICS.items()}
        sim[policy] = summarize_outcome(Simulation(sim_setup(config, info, calib[policy], copy_bw),
                                                   checks=True).run(trace.requests))
        errors[policy] = {f"{m}_err": _err(sim[policy][k], real[policy][k]) for m, k in TRACE_METRICS.items()}
        progress(f"{policy}: " + ", ".join(f"{m} real {real[policy][k]:.3f} sim {sim[policy][k]:.3f}"
                                           for m, k in TRACE_METRICS.items()))
    worst = {f"{m}_err": max((e[f"{m}_err"] for e in errors.values() if e[f"{m}_err"] is not None), default=None)
             for m in TRACE_METRICS}
    rank = {k: (_ranking(real, key, hb), _ranking(sim, key, hb))
            for k, key, hb in (("effective_tput", "effective_tput", True), ("ttft_mean", "ttft_mean_s", False))}
    return {"trace": trace.describe(), "calibration_trace": cal_trace.describe(), "policies": list(policies),
            "repeats": repeats, "engine": asdict(trace_engine_config("fcfs", trace.requests).cache),
            "copy_bytes_s": copy_bw,
            "calibration": {p: {"fixed_s": c.fit.fixed_s, "decode_s": c.fit.decode_s, "prefill_s": c.fit.prefill_s,
                                "context_s": c.context_s, "pair_s": c.pair_s} for p, c in calib.items()},
            **worst, "max_err": max((v for v in worst.values() if v is not None), default=None),
            "errors": errors, "real": real, "sim": sim, "real_spread": spread,
            "ranking_real": rank["effective_tput"][0], "ranking_sim": rank["effective_tput"][1],
            "same_ranking": rank["effective_tput"][0] == rank["effective_tput"][1],
            "same_ranking_ttft_mean": rank["ttft_mean"][0] == rank["ttft_mean"][1],
            "guards": ({side: guards(out["tokenflow"], out["fcfs"]) for side, out in (("real", real), ("sim", sim))}
                       if "tokenflow" in real else {}),
            "wall_s": time.perf_counter() - wall}


def print_trace_validation(out: dict) -> None:
    t = out["trace"]
    print(f"{t['trace']} minutes {t['window']} at {t['speed']:g}x: {t['num_requests']} streams, real runs "
          f"x{out['repeats']} (medians) against the simulator calibrated on minutes {out['calibration_trace']['window']}")
    print(f"{'policy':>10} {'':>4} " + " ".join(f"{k:>12}" for k in ("TTFT mean", "P99", "QoE", "stall", "raw",
                                                                       "effective", "preempt")))
    for policy in out["policies"]:
        for side in ("real", "sim"):
            s = out[side][policy]
            print(f"{policy:>10} {side:>4} " + " ".join(f"{s[k]:12.3f}" for k in SHOWN))
    print(f"{'error':>15} " + " ".join(f"{m} {out[m + '_err'] * 100:.1f}%" for m in TRACE_METRICS
                                       if out[m + "_err"] is not None))
    for side, report in out.get("guards", {}).items():
        print(f"guards tokenflow vs fcfs, {side}: {'ok' if report['ok'] else 'FAILED'} {describe(report)}")
    print(f"ranking by effective: real {out['ranking_real']} sim {out['ranking_sim']} same={out['same_ranking']}; "
          f"by TTFT mean same={out['same_ranking_ttft_mean']}")
