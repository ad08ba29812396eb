"""`tokenflow bench host`: the engine's host time per step, with a device that does nothing (NullRunner).

Host time is everything `LLMEngine.step()` does but the runner: `begin_step` (arrivals, the policy, the plan)
and `finish_step` (the result applied, readers and records, outputs built), each timed with `time.perf_counter`,
and on this thread's CPU clock too (`cpu_ms_median`: on a shared box, wall time also counts waits for a core).

Regime: the H200 serving run's (../shared/data/h200/README.md, setup (a) at 1/8 length): block 16, 1,734
device blocks, 6,936 host blocks, max_num_seqs 256, 8192 tokens a step, default policy configs; N streams of
setup (a)'s lengths x 1/8 (prompts ~64, outputs ~512) all arriving at t=0, readers at 20 tok/s. The clock is
virtual and moves a fixed `step_s` (20 ms, an H200 step) per step, which the runner reports as its compute time,
so the policies see time pass as in serving: readers drain, buffers run low, streams are paused, resumed and
written through. The first `warmup` steps (the prefill burst) are not measured; then `steps` are, or fewer if
the work runs out.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace

from tokenflow_ray.engine.config import DEFAULT_PREFIX_CACHE
from tokenflow_ray.engine.policies import POLICY_NAMES
from tokenflow_ray.workloads.prompts import distinct_prompt

H200_DEVICE_BLOCKS = 1734  # the H200 mem-frac-0.3 pool of 222k tokens x 1/8, in 16-token blocks
H200_HOST_BLOCKS = 6936


@dataclass(frozen=True)
class HostBenchConfig:
    streams: tuple[int, ...] = (100, 400, 1000)
    policies: tuple[str, ...] = ("fcfs", "tokenflow", "andes")
    steps: int = 200  # measured steps per run
    warmup: int = 50  # steps run first and not measured
    repeats: int = 3  # runs per (policy, streams); medians over them are reported
    step_s: float = 0.02  # virtual time a step takes (the runner's reported compute time)
    rate: float = 20.0  # readers' tokens/s
    length_scale: float = 1 / 8  # on setup (a)'s prompt and output lengths
    seed: int = 0
    block_size: int = 16
    device_blocks: int = H200_DEVICE_BLOCKS
    host_blocks: int = H200_HOST_BLOCKS
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefix_cache: str = DEFAULT_PREFIX_CACHE  # the engine's default

    def __post_init__(self) -> None:
        from tokenflow_ray.engine.config import prefix_cache_overrides

        prefix_cache_overrides(self.prefix_cache)  # a bad mode is refused here
        streams = self.streams
        if not streams or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in streams):
            raise ValueError(f"streams: expected positive integers, got {self.streams!r}")
        unknown = [p for p in self.policies if p not in POLICY_NAMES]
        if not self.policies or unknown:
            raise ValueError(f"policies: expected some of {', '.join(POLICY_NAMES)}, got {self.policies!r}")
        for name in ("steps", "repeats", "block_size", "device_blocks", "max_num_seqs",
                     "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)!r}")
        if self.warmup < 0 or self.host_blocks < 0:
            raise ValueError("warmup and host_blocks: must be >= 0")
        for name in ("step_s", "rate", "length_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class RunTimes:
    """One run's measured steps: host milliseconds per step, split into its two halves."""

    total_ms: list[float]
    cpu_ms: list[float]  # the same steps on this thread's CPU clock: what a shared box's waits do not inflate
    schedule_ms: list[float]  # begin_step
    update_ms: list[float]  # finish_step
    live: list[int]  # live streams at each measured step
    batch: list[int]  # streams scheduled in each measured step
    idle_steps: int  # measured steps with nothing to run (every stream held): begin_step only


def host_requests(cfg: HostBenchConfig, n: int) -> list[tuple[int, int]]:
    """(prompt_len, output_len) of setup (a)'s first n requests at the length scale (min 8 / 16 tokens)."""
    from tokenflow_ray.sim.setups import paper_setup, setup_requests

    reqs = setup_requests(paper_setup("h200", "a"), seed=cfg.seed, num_requests=n)
    return [(max(8, round(r.prompt_len * cfg.length_scale)), max(16, round(r.output_len * cfg.length_scale)))
            for r in reqs]


def build_engine(cfg: HostBenchConfig, policy: str, n: int):
    """An engine on a NullRunner and a virtual clock with n streams queued at t=0 (also used by the tests)."""
    from tokenflow_ray.engine.clock import VirtualClock
    from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig, prefix_cache_overrides
    from tokenflow_ray.engine.llm_engine import LLMEngine
    from tokenflow_ray.engine.null_runner import NullRunner
    from tokenflow_ray.engine.sampling import SamplingParams
    from tokenflow_ray.sim.hardware import deployment
    from tokenflow_ray.sim.setups import model_info

    info = model_info(deployment("h200", "llama3-8b"))
    config = EngineConfig(
        cache=CacheConfig(block_size=cfg.block_size, num_device_blocks=cfg.device_blocks,
                          num_host_blocks=cfg.host_blocks, **prefix_cache_overrides(cfg.prefix_cache)),
        scheduler=SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                                  max_num_batched_tokens=cfg.max_num_batched_tokens, policy=policy),
        record_history=n)
    runner = NullRunner(info, cfg.block_size, compute_s=cfg.step_s)
    engine = LLMEngine(config, runner, tokenizer=None, clock=VirtualClock())
    for i, (prompt, output) in enumerate(host_requests(cfg, n)):
        ids = distinct_prompt(i, prompt, vocab=1000)
        engine.add_request(ids, SamplingParams(max_tokens=output, ignore_eos=True), stream_id=f"s{i:05d}",
                           arrival_time=0.0, rate=cfg.rate)
    return engine


def run_once(cfg: HostBenchConfig, policy: str, n: int) -> RunTimes:
    engine = build_engine(cfg, policy, n)
    runner, clock, perf = engine.runner, engine.clock, time.perf_counter
    cpu = time.thread_time
    times = RunTimes([], [], [], [], [], [], 0)
    gc.collect()
    for step in range(cfg.warmup + cfg.steps):
        if not engine.has_unfinished():
            break
        c0, t0 = cpu(), perf()
        begun = engine.begin_step()
        t1, c1 = perf(), cpu()
        measured = step >= cfg.warmup
        if begun.plan is None:
            clock.advance(cfg.step_s)
            if measured:
                times.idle_steps += 1
            continue
        live = engine.scheduler.num_unfinished
        result = runner.execute(begun.plan)
        clock.advance(cfg.step_s)
        c2, t2 = cpu(), perf()
        engine.finish_step(begun, result)
        t3, c3 = perf(), cpu()
        if measured:
            times.schedule_ms.append((t1 - t0) * 1e3)
            times.update_ms.append((t3 - t2) * 1e3)
            times.total_ms.append((t1 - t0 + t3 - t2) * 1e3)
            times.cpu_ms.append((c1 - c0 + c3 - c2) * 1e3)
            times.live.append(live)
            times.batch.append(len(begun.plan.decodes) + len(begun.plan.prefills))
    return times


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]


def measure(cfg: HostBenchConfig, policy: str, n: int) -> dict:
    """One (policy, streams) cell: each statistic per run, then the median over the runs."""
    runs = [run_once(cfg, policy, n) for _ in range(cfg.repeats)]
    if not runs[0].total_ms:
        raise ValueError(f"{policy} at {n} streams: no step was measured (the work ran out in {cfg.warmup} "
                         f"warm-up steps)")

    def med(f) -> float:
        return round(statistics.median(f(r) for r in runs), 4)

    return {"policy": policy, "streams": n,
            "ms_median": med(lambda r: statistics.median(r.total_ms)),
            "ms_mean": med(lambda r: statistics.fmean(r.total_ms)),
            "ms_p90": med(lambda r: _p90(r.total_ms)),
            "cpu_ms_median": med(lambda r: statistics.median(r.cpu_ms)),
            "schedule_ms_median": med(lambda r: statistics.median(r.schedule_ms)),
            "update_ms_median": med(lambda r: statistics.median(r.update_ms)),
            "steps": min(len(r.total_ms) for r in runs),
            "idle_steps": max(r.idle_steps for r in runs),
            "live_mean": round(statistics.fmean(runs[0].live), 1),
            "batch_mean": round(statistics.fmean(runs[0].batch), 1),
            "runs_ms_median": [round(statistics.median(r.total_ms), 4) for r in runs]}


def run_host_bench(cfg: HostBenchConfig, progress=print) -> dict:
    rows = []
    for n in cfg.streams:
        for policy in cfg.policies:
            row = measure(cfg, policy, n)
            rows.append(row)
            if progress is not None:
                progress(f"{policy:>9} {n:>5} streams: {row['ms_median']:.3f} ms/step median "
                         f"(schedule {row['schedule_ms_median']:.3f}, update {row['update_ms_median']:.3f}, "
                         f"CPU {row['cpu_ms_median']:.3f}; "
                         f"mean {row['ms_mean']:.3f}, p90 {row['ms_p90']:.3f}; {row['steps']} steps, "
                         f"batch {row['batch_mean']:.0f}, live {row['live_mean']:.0f})")
    return {"bench": "host", "config": asdict(cfg), "host": rows,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "load_avg_1m": round(os.getloadavg()[0], 2)}}


def config_from_args(args) -> HostBenchConfig:
    cfg = HostBenchConfig(streams=args.streams, policies=args.policies, steps=args.steps, warmup=args.warmup,
                          repeats=args.repeats, seed=args.seed, prefix_cache=args.prefix_cache)
    return replace(cfg, step_s=args.step_ms / 1e3)
