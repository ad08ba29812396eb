"""`tokenflow simulate validate`: the same seeded workloads on the real CPU engine and in the simulator with the
calibrated cost model, at low load, ~85% of capacity and overload.

1. Calibrate, on runs held out from the comparison (another seed, another load): the real engine runs a burst
   and every step is timed whole on the wall clock (planning, the model, the update: what the engine delivers a
   step). The fcfs calibration burst is unpaced, so every step decodes what fits; `CalibratedStepCost.from_samples`
   fits the engine's step-time law on its steps (cost.py), which gives the decode capacity Γ at the batch the
   pool holds, and the regimes are set from it. The other policies run a calibration burst at 0.6 Γ, and only
   their per-step and per-decode terms are refitted (`for_policy`: the model's costs per prefill and context
   token do not depend on the policy, its planning time does; fitting every coefficient per policy let
   tokenflow's rebalance steps, which coincide with admissions, inflate its prefill cost by half). Copy
   bandwidth is the median of the runner's measured copies.
   A warm-up run comes first and is not recorded: a process's first run is slower on every new step shape.
   Real runs are repeated (`repeats`) and each figure is the median: this box is shared, and the same fcfs
   workload (whose work does not depend on the readers' rates) was seen to vary by 15% between regimes. The
   real runs' range of each figure is kept (`real_spread`); two policies whose real ranges of effective
   throughput overlap are tied within noise (`real_ties_effective`), and `same_ranking_beyond_noise` compares
   the order of every other pair.
2. Compare: each regime's burst (`num_streams` streams, Σ rates = load × Γ) under each policy on the real engine
   and in the simulator (the same EngineConfig, the same requests). Errors are |sim − real| / real of TTFT
   p50/p99, raw and effective throughput; `same_ranking`: the policies in the same order by effective throughput
   (and, separately, by P99 TTFT) in both.

Real runs use the embedded model on the CPU; the whole command takes a few minutes on 2 cores.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenflow_ray.engine.policies import TokenFlowConfig
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.step_time_model import StepTimeFit
from tokenflow_ray.metrics import summarize
from tokenflow_ray.sim.cost import CalibratedStepCost, HostLink, StepShape
from tokenflow_ray.sim.experiments import summarize_outcome
from tokenflow_ray.sim.simulator import ReplicaSetup, Simulation
from tokenflow_ray.workloads.generators import (
    LengthDist,
    RequestSpec,
    WorkloadSpec,
    make_requests,
    table1_lengths,
)
from tokenflow_ray.workloads.prompts import distinct_prompt

METRICS = {"ttft_p50": "ttft_p50_s", "ttft_p99": "ttft_p99_s", "raw_tput": "raw_tput",
           "effective_tput": "effective_tput"}


@dataclass(frozen=True)
class ValidateConfig:
    num_streams: int = 40
    loads: tuple[tuple[str, float], ...] = (("low", 0.4), ("near_capacity", 0.85), ("overload", 1.5))
    policies: tuple[str, ...] = ("fcfs", "andes", "tokenflow")
    length_scale: float = 1 / 8  # Table 1 SL scaled: ~64-token prompts, ~256-token outputs
    kv_fraction: float = 0.3  # device pool: this share of the burst at full length (the paper's pressure)
    host_factor: float = 4.0
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    calibration_load: float = 0.6
    repeats: int = 3  # real runs per (regime, policy); figures are medians, the spread is kept beside them
    tokenflow: TokenFlowConfig = field(default_factory=lambda: TokenFlowConfig(delta_t=0.2))
    seed: int = 0
    num_threads: int = 1

    def __post_init__(self) -> None:
        if self.num_streams < 2:
            raise ValueError(f"streams: must be >= 2, got {self.num_streams!r}")


def workload(cfg: ValidateConfig, seed: int, rate: float) -> list[RequestSpec]:
    prompt, output = table1_lengths("SL")
    spec = WorkloadSpec("burst", cfg.num_streams, seed=seed, rate=rate, length_scale=1.0,
                        prompt=LengthDist(prompt.mean * cfg.length_scale, prompt.std * cfg.length_scale, min_len=8),
                        output=LengthDist(output.mean * cfg.length_scale, output.std * cfg.length_scale,
                                          min_len=16))
    return make_requests(spec)


def engine_config(cfg: ValidateConfig, policy: str) -> EngineConfig:
    reqs = workload(cfg, cfg.seed, 1.0)  # the pool is sized on the comparison workload's lengths
    full = sum(-(-(r.prompt_len + r.output_len) // cfg.block_size) for r in reqs)
    device = max(int(cfg.kv_fraction * full), max(-(-(r.prompt_len + 1) // cfg.block_size) for r in reqs) + 1)
    return EngineConfig(
        model=ModelConfig(model="embedded", dtype="float32", num_threads=cfg.num_threads),
        cache=CacheConfig(block_size=cfg.block_size, num_device_blocks=device,
                          num_host_blocks=int(cfg.host_factor * device)),
        scheduler=SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                  policy=policy, tokenflow=cfg.tokenflow),
        record_history=cfg.num_streams + 8)


@dataclass
class RealRun:
    summary: dict
    samples: list[tuple[StepShape, float]]
    copy_bytes_s: list[float]
    info: ModelInfo


def run_real(config: EngineConfig, requests: Sequence[RequestSpec]) -> RealRun:
    """The real engine (wall clock), requests added at their arrival times, every step timed whole."""
    from tokenflow_ray.runner.factory import build_engine  # the real engine: torch loads here

    engine = build_engine(config)
    try:
        engine.generate([[1] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up, not recorded
        engine.finished_records.clear()
        samples: list[tuple[StepShape, float]] = []
        copies: list[float] = []
        pending = sorted(requests, key=lambda r: r.arrival_s)
        start = engine.clock.now()
        i = 0
        while i < len(pending) or engine.has_unfinished():
            now = engine.clock.now() - start
            while i < len(pending) and pending[i].arrival_s <= now:
                r = pending[i]
                engine.add_request(distinct_prompt(r.index, r.prompt_len),
                                   SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                   stream_id=f"req-{r.index}", arrival_time=start + r.arrival_s, rate=r.rate)
                i += 1
            if not engine.has_unfinished():
                time.sleep(min(0.01, max(0.0, pending[i].arrival_s - now)))
                continue
            t0 = engine.clock.now()
            begun = engine.begin_step()
            if begun.plan is None:
                time.sleep(0.001)
                continue
            result = engine.runner.execute(begun.plan)
            engine.finish_step(begun, result)
            samples.append((StepShape.of(begun.plan), engine.clock.now() - t0))
            if result.copy_bytes and result.copy_s > 0:
                copies.append(result.copy_bytes / result.copy_s)
        records = list(engine.finished_records)
        for r in records:  # the simulator's clock starts at 0: shift the records' times the same way
            r.arrival_s -= start
            r.token_times[:] = [t - start for t in r.token_times]
        s = engine.scheduler
        summary = summarize(records, bytes_to_host=s.bytes_to_host, bytes_from_host=s.bytes_from_host).to_dict()
        return RealRun(summary, samples, copies, engine.runner.info)
    finally:
        if getattr(engine.runner, "transfer", None) is not None:
            engine.runner.transfer.close()


def sim_setup(config: EngineConfig, info: ModelInfo, cost: CalibratedStepCost, copy_bytes_s: float) -> ReplicaSetup:
    # The calibrated law prices the whole step (planning included), so no separate scheduler overhead.
    return ReplicaSetup(engine=config, info=info, cost=cost, link=HostLink(copy_bytes_s), cpu_overhead_s=0.0)


def _err(sim: object, real: object) -> float | None:
    if not isinstance(sim, (int, float)) or not isinstance(real, (int, float)) or real == 0:
        return None
    return abs(sim - real) / abs(real)


def _ranking(results: dict, key: str, higher_better: bool) -> list[str]:
    return sorted(results, key=lambda p: (-results[p][key] if higher_better else results[p][key], p))


def run_validation(cfg: ValidateConfig, progress: Callable[[str], None] = print) -> dict:
    wall = time.perf_counter()
    # 1. Calibration (held-out seed; fcfs unpaced gives Γ, the others at calibration_load × Γ).
    cal_seed = cfg.seed + 1000
    calib: dict[str, CalibratedStepCost] = {}
    bandwidth: list[float] = []
    fcfs_cfg = engine_config(cfg, "fcfs")
    # A warm-up run, not recorded. A process's first run pays for creating kernels for each new step shape
    # (oneDNN's primitive cache): its first full-budget prefill steps took 39-55 ms against 25 ms warm, and a
    # calibration on it priced a prefill token 13% high, which put every simulated TTFT p50 5-16% high.
    run_real(fcfs_cfg, workload(cfg, cal_seed + 1, 0.0))
    # Calibration runs are repeated too: one run disturbed by another job once fitted Γ 16% low and put every
    # simulated figure 20% off. The unpaced fcfs burst plans the same steps every run (nothing in it depends on
    # the clock), so each step's time is its median over the runs; the paced policies' runs differ step by
    # step, so each run is fitted and the coefficients' medians taken.
    cal_runs = [run_real(fcfs_cfg, workload(cfg, cal_seed, 0.0)) for _ in range(cfg.repeats)]
    info = cal_runs[0].info
    samples = _median_steps([r.samples for r in cal_runs])
    calib["fcfs"] = CalibratedStepCost.from_samples(samples)
    bandwidth += [b for r in cal_runs for b in r.copy_bytes_s]
    capacity = _capacity(calib["fcfs"], fcfs_cfg, workload(cfg, cfg.seed, 1.0))
    progress(f"calibrated fcfs on {len(samples)} steps x {len(cal_runs)} runs: {calib['fcfs']}; "
             f"Γ = {capacity:.0f} tok/s")
    for policy in cfg.policies:
        if policy in calib:
            continue
        rate = cfg.calibration_load * capacity / cfg.num_streams
        runs = [run_real(engine_config(cfg, policy), workload(cfg, cal_seed, rate)) for _ in range(cfg.repeats)]
        calib[policy] = _median_cost([calib["fcfs"].for_policy(r.samples) for r in runs])
        bandwidth += [b for r in runs for b in r.copy_bytes_s]
        progress(f"calibrated {policy} on {len(runs)} runs: {calib[policy]}")
    copy_bw = statistics.median(bandwidth) if bandwidth else 2e9
    # 2. The regimes.
    regimes = {}
    for name, load in cfg.loads:
        rate = load * capacity / cfg.num_streams
        requests = workload(cfg, cfg.seed, rate)
        real, sim, errors, spread = {}, {}, {}, {}
        for policy in cfg.policies:
            config = engine_config(cfg, policy)
            runs = [run_real(config, requests).summary for _ in range(cfg.repeats)]
            real[policy] = _median(runs)
            spread[policy] = {m: [min(r[k] for r in runs), max(r[k] for r in runs)] for m, k in METRICS.items()}
            outcome = Simulation(sim_setup(config, info, calib[policy], copy_bw), checks=True).run(requests)
            sim[policy] = summarize_outcome(outcome)
            errors[policy] = {f"{m}_err": _err(sim[policy][k], real[policy][k]) for m, k in METRICS.items()}
            progress(f"{name} (load {load}) {policy}: " + ", ".join(
                f"{m} real {real[policy][k]:.3f} sim {sim[policy][k]:.3f}" for m, k in METRICS.items()))
        rank = {k: (_ranking(real, key, hb), _ranking(sim, key, hb))
                for k, key, hb in (("effective_tput", "effective_tput", True), ("ttft_p99", "ttft_p99_s", False))}
        worst = {f"{m}_err": max((e[f"{m}_err"] for e in errors.values() if e[f"{m}_err"] is not None),
                                 default=None) for m in METRICS}
        ties = _ties(spread, "effective_tput")
        regimes[name] = {"load": load, "sum_rate": rate * cfg.num_streams, "streams": cfg.num_streams,
                         **worst, "errors": errors, "real": real, "sim": sim, "real_spread": spread,
                         "ranking_real": rank["effective_tput"][0], "ranking_sim": rank["effective_tput"][1],
                         "same_ranking": rank["effective_tput"][0] == rank["effective_tput"][1],
                         "real_ties_effective": ties,
                         "same_ranking_beyond_noise": _same_order_beyond_noise(real, sim, "effective_tput", ties),
                         "same_ranking_ttft_p99": rank["ttft_p99"][0] == rank["ttft_p99"][1]}
    return {"config": asdict(replace(cfg)), "capacity_tok_s": capacity, "copy_bytes_s": copy_bw,
            "calibration": {p: {"fixed_s": c.fit.fixed_s, "decode_s": c.fit.decode_s, "prefill_s": c.fit.prefill_s,
                                "context_s": c.context_s, "pair_s": c.pair_s} for p, c in calib.items()},
            "regimes": regimes, "wall_s": time.perf_counter() - wall}


def _median_steps(runs: list[list[tuple[StepShape, float]]]) -> list[tuple[StepShape, float]]:
    """Each step's median time over runs that planned the same steps; runs that did not are pooled."""
    shapes = [[shape for shape, _ in r] for r in runs]
    if any(s != shapes[0] for s in shapes[1:]):
        return [sample for r in runs for sample in r]
    return [(shape, statistics.median(r[i][1] for r in runs)) for i, shape in enumerate(shapes[0])]


def _median_cost(fits: list[CalibratedStepCost]) -> CalibratedStepCost:
    """Coefficient-wise medians of per-run refits (they share the prefill and context costs)."""
    f = fits[0]
    return CalibratedStepCost(StepTimeFit(statistics.median(c.fit.fixed_s for c in fits),
                                          statistics.median(c.fit.decode_s for c in fits), f.fit.prefill_s),
                              f.context_s, f.pair_s)


def _ties(spread: dict, metric: str) -> list[list[str]]:
    """Pairs of policies whose real runs' ranges of `metric` overlap: their real order is within the noise."""
    names = sorted(spread)
    return [[a, b] for i, a in enumerate(names) for b in names[i + 1:]
            if spread[a][metric][0] <= spread[b][metric][1] and spread[b][metric][0] <= spread[a][metric][1]]


def _same_order_beyond_noise(real: dict, sim: dict, key: str, ties: list[list[str]]) -> bool:
    """The simulator orders every pair of policies as the real engine does, except pairs tied within noise."""
    tied = {frozenset(t) for t in ties}
    names = sorted(real)
    return all((real[a][key] > real[b][key]) == (sim[a][key] > sim[b][key])
               for i, a in enumerate(names) for b in names[i + 1:] if frozenset((a, b)) not in tied)


def _median(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for k, v in runs[0].items():
        values = [r[k] for r in runs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and values:
            out[k] = statistics.median(values)
    return out


def _capacity(cost: CalibratedStepCost, config: EngineConfig, requests: Sequence[RequestSpec]) -> float:
    """Γ at the batch the pool holds at mean mid-life length (as the scheduler's view computes it)."""
    bs = config.cache.block_size
    life = statistics.mean(r.prompt_len + r.output_len / 2 for r in requests)
    batch = max(1, min(config.scheduler.max_num_seqs, int(config.cache.num_device_blocks / -(-life // bs))))
    shape = StepShape(batch, 0, int(batch * life), 0.0, batch)
    return batch / cost.step_s(shape)


def print_validation(out: dict) -> None:
    print(f"Γ = {out['capacity_tok_s']:.0f} tok/s; wall {out['wall_s']:.0f} s")
    print(f"{'regime':>14} {'policy':>10} " + " ".join(f"{m + ' err':>18}" for m in METRICS))
    for name, reg in out["regimes"].items():
        for policy, e in reg["errors"].items():
            cells = " ".join(f"{(e[m + '_err'] or 0) * 100:17.1f}%" for m in METRICS)
            print(f"{name:>14} {policy:>10} {cells}")
        print(f"{name:>14} ranking real {reg['ranking_real']} sim {reg['ranking_sim']} same={reg['same_ranking']}"
              f" (beyond the real runs' noise: {reg['same_ranking_beyond_noise']}; tied in the real runs: "
              f"{reg['real_ties_effective'] or 'none'}; P99 TTFT same={reg['same_ranking_ttft_p99']})")
