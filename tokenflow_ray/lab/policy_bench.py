"""`tokenflow bench policies`: one seeded workload through the real engine under each policy, on the wall clock.

The regime is the paper's (serving-paper.md §5, Table 1 scaled down): the device KV pool holds only `kv_fraction`
of the burst's streams at full length (SGLang's mem-frac 0.3 pressure) while Σ declared rates stay within decode
capacity, so the contest is over who runs when. Requests arrive at their workload times; readers are the engine's
own reader model at each stream's declared rate; every figure comes from `tokenflow_ray.metrics.summarize` over
the engine's stream records, the same definitions the server and the simulator use.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from tokenflow_ray.engine.config import (
    DEFAULT_PREFIX_CACHE,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    prefix_cache_overrides,
)
from tokenflow_ray.engine.policies import POLICY_NAMES, TokenFlowConfig
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.metrics import summarize
from tokenflow_ray.metrics.guards import describe as describe_guards
from tokenflow_ray.metrics.guards import guards
from tokenflow_ray.metrics.summary import policy_ratios
from tokenflow_ray.runner.factory import build_engine
from tokenflow_ray.workloads.ablations import ABLATIONS
from tokenflow_ray.workloads.generators import (
    LengthDist,
    RequestSpec,
    WorkloadSpec,
    make_requests,
    table1_lengths,
)


@dataclass(frozen=True)
class PolicyBenchConfig:
    workload: str = "burst"  # burst | poisson | gamma | mixed
    num_requests: int = 48  # x 20 tok/s = 960 tok/s; --sweep sets rates from the measured capacity (sweep.py)
    rate: float = 20.0  # tokens/s per reader (mixed: 40% at mix_low x rate, 60% at rate)
    mix_low: float = 0.75  # mixed: the slower readers' share of `rate` (0.75 x 20 = the paper's 15 tok/s)
    arrival_rate: float = 4.0  # poisson / gamma: requests per second
    length_scale: float = 1 / 8  # Table 1 SL (512 in / 2048 out) scaled: 64 in / 256 out on average
    kv_fraction: float = 0.3  # device pool = this share of the workload's full-length KV
    host_factor: float = 4.0  # host spill store = this many times the device pool
    # An explicit pool (blocks) instead of the kv_fraction/host_factor sizing: the sweep keeps one memory regime
    # across workloads of different request counts.
    pool_blocks: tuple[int, int] | None = None  # (device, host)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    policies: tuple[str, ...] = POLICY_NAMES
    tokenflow: TokenFlowConfig = field(default_factory=lambda: TokenFlowConfig(delta_t=0.2, mu=2.0, t_critical=1.0))
    model: str = "embedded"
    seed: int = 0
    sample_every_s: float = 0.1
    max_run_s: float = 600.0  # a run still going after this long is stopped with an error
    num_threads: int = 1  # torch intra-op threads: the copy thread needs the other core (see ModelConfig)
    repeats: int = 3  # each figure is the median over this many runs (policies take turns within a repeat)
    prefix_cache: str = DEFAULT_PREFIX_CACHE  # the prefix cache's tiers: the engine's default

    def __post_init__(self) -> None:
        if self.workload not in ("burst", "poisson", "gamma", "mixed"):
            raise ValueError(f"workload: expected burst, poisson, gamma or mixed, got {self.workload!r}")
        if unknown := set(self.policies) - set(POLICY_NAMES):
            raise ValueError(f"policies: unknown {sorted(unknown)}; choose from {', '.join(POLICY_NAMES)}")
        prefix_cache_overrides(self.prefix_cache)  # a bad mode is refused here
        if not 0 < self.kv_fraction <= 1 or self.host_factor < 0 or self.num_requests <= 0:
            raise ValueError("kv_fraction must be in (0, 1], host_factor >= 0, num_requests > 0")
        if not 0 < self.mix_low <= 1:
            raise ValueError(f"mix_low: must be in (0, 1], got {self.mix_low!r}")

    def workload_spec(self) -> WorkloadSpec:
        prompt, output = table1_lengths("SL")
        # The mix follows `rate` so a load sweep can scale it (at the default rate it is the paper's 15/20 mix).
        return WorkloadSpec(self.workload, self.num_requests, seed=self.seed, rate=self.rate,
                            rate_mix=((self.mix_low * self.rate, 0.4), (self.rate, 0.6)),
                            arrival_rate=self.arrival_rate, length_scale=self.length_scale,
                            prompt=replace(prompt, min_len=8), output=LengthDist(output.mean, output.std, min_len=16))


@dataclass
class RunTrace:
    """Counts over time, for the plots."""

    t: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)


def pool_sizes(cfg: PolicyBenchConfig, requests: list[RequestSpec]) -> tuple[int, int]:
    if cfg.pool_blocks is not None:
        return cfg.pool_blocks
    full = sum(-(-(r.prompt_len + r.output_len) // cfg.block_size) for r in requests)
    device = max(int(cfg.kv_fraction * full), max(-(-(r.prompt_len + 1) // cfg.block_size) for r in requests) + 1)
    return device, int(cfg.host_factor * device)


def bench_engine_config(cfg: PolicyBenchConfig, policy: str, requests: list[RequestSpec],
                        cache_overrides: dict | None = None) -> EngineConfig:
    """The engine the bench runs `requests` on under `policy` (also what `simulate validate --trace` replays)."""
    device_blocks, host_blocks = pool_sizes(cfg, requests)
    cache = CacheConfig(block_size=cfg.block_size, num_device_blocks=device_blocks, num_host_blocks=host_blocks,
                        **prefix_cache_overrides(cfg.prefix_cache))
    return EngineConfig(
        model=ModelConfig(model=cfg.model, dtype="float32", num_threads=cfg.num_threads),
        cache=replace(cache, **(cache_overrides or {})),
        scheduler=SchedulerConfig(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                  policy=policy, tokenflow=cfg.tokenflow),
        record_history=len(requests))


def run_policy(cfg: PolicyBenchConfig, policy: str, requests: list[RequestSpec],
               cache_overrides: dict | None = None) -> tuple[dict, RunTrace, list]:
    config = bench_engine_config(cfg, policy, requests, cache_overrides)
    cache = config.cache
    device_blocks = cache.num_device_blocks
    engine = build_engine(config)
    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(256) for _ in range(r.prompt_len)] for r in requests]
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up, not recorded
    engine.finished_records.clear()
    trace = RunTrace()
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    start = engine.clock.now()
    next_sample = 0.0
    while pending or engine.has_unfinished():
        now = engine.clock.now() - start
        while pending and requests[pending[0]].arrival_s <= now:
            r = requests[pending.pop(0)]
            engine.add_request(prompts[r.index], SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                               stream_id=f"req-{r.index}", arrival_time=start + r.arrival_s, rate=r.rate)
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.05, requests[pending[0]].arrival_s - now)))
            continue
        if now > cfg.max_run_s:
            raise RuntimeError(f"{policy}: run exceeded max_run_s={cfg.max_run_s}; {len(pending)} requests not "
                               f"yet arrived, {engine.scheduler.num_unfinished} unfinished")
        engine.step()
        if engine.idle:  # every live stream paced for now
            time.sleep(0.002)
        if now >= next_sample:
            st = engine.stats()
            trace.t.append(now)
            trace.running.append(st.num_running)
            trace.preempted.append(st.num_preempted)
            trace.waiting.append(st.num_waiting)
            next_sample = now + cfg.sample_every_s
    records = list(engine.finished_records)
    sched = engine.scheduler
    summary = summarize(records, bytes_to_host=sched.bytes_to_host, bytes_from_host=sched.bytes_from_host).to_dict()
    costs, tails = sched.preempt_costs_s, sched.preempt_tail_s
    summary.update(completion_s=max(max(r.token_times) for r in records if r.token_times) - start,
                   preempt_cost_mean_s=statistics.mean(costs) if costs else 0.0, swap_preemptions=len(costs),
                   preempt_tail_mean_s=statistics.mean(tails) if tails else 0.0,
                   device_blocks=device_blocks, host_blocks=cache.num_host_blocks)
    if engine.runner.transfer is not None:
        engine.runner.transfer.close()
    return summary, trace, records


TRACE_POOL_BLOCKS = (512, 2048)  # a replayed trace's pools (device, host): what the CPU runs of issue 41 used


def run_policy_bench(cfg: PolicyBenchConfig, ablation: bool = False,
                     progress: Callable[[str], None] = print, replay=None) -> tuple[dict, dict]:
    """Each policy on the config's workload, or on a replayed trace (`replay`: workloads/traces.Trace) when given;
    the JSON's `workload` then describes the trace."""
    requests = make_requests(cfg.workload_spec()) if replay is None else replay.requests
    device_blocks, host_blocks = pool_sizes(cfg, requests)
    name = cfg.workload if replay is None else f"trace {replay.path}"
    progress(f"{name}: {len(requests)} requests, Σrate {sum(r.rate for r in requests):.0f} tok/s, "
             f"KV pool {device_blocks} blocks of {cfg.block_size} (host {host_blocks})")
    runs: dict[str, list[dict]] = {p: [] for p in cfg.policies}
    artifacts: dict[str, tuple[RunTrace, list]] = {}
    for repeat in range(cfg.repeats):
        for policy in cfg.policies:
            summary, trace, records = run_policy(cfg, policy, requests)
            runs[policy].append(summary)
            artifacts[policy] = (trace, records)  # plots show the last repeat
            progress(f"[{repeat + 1}/{cfg.repeats}] " + _row(policy, summary))
    results = {p: _median(r) for p, r in runs.items()}
    workload = replay.describe() if replay is not None else {**asdict(cfg.workload_spec()), "num_requests": len(requests)}
    out: dict = {"workload": workload, "config": asdict(cfg), "policies": results, "runs": runs}
    if "tokenflow" in results and "fcfs" in results:
        out["tokenflow_vs_fcfs"] = policy_ratios(results["tokenflow"], results["fcfs"])
        out["guards"] = {"tokenflow_vs_fcfs": guards(results["tokenflow"], results["fcfs"])}
        progress(f"guards tokenflow vs fcfs: {describe_guards(out['guards']['tokenflow_vs_fcfs'])}")
        if "andes" in results:
            out["tokenflow_vs_andes"] = {"effective_tput": policy_ratios(results["tokenflow"],
                                                                         results["andes"])["effective_tput"]}
    if ablation:
        table = {}
        for name, overrides in ABLATIONS.items():
            if name == "tokenflow" and "tokenflow" in results:
                table[name] = results["tokenflow"]
            else:
                table[name] = _median([run_policy(cfg, "tokenflow", requests, overrides)[0]
                                       for _ in range(cfg.repeats)])
            progress(_row(name, table[name]) + f" | preempt cost {table[name]['preempt_cost_mean_s'] * 1e3:.3f} ms")
        out["ablation"] = table
        wt, wop = table["tokenflow"]["preempt_cost_mean_s"], table["no_write_through"]["preempt_cost_mean_s"]
        out["write_through_preempt_cost_ratio"] = wop / wt if wt > 0 else None
    return out, artifacts




def _median(runs: list[dict]) -> dict:
    """Per-metric median over repeated runs (numbers only; None where a metric is undefined)."""
    keys = runs[0].keys()
    out = {}
    for k in keys:
        values = [r[k] for r in runs if isinstance(r.get(k), (int, float))]
        out[k] = statistics.median(values) if values else None
    return out


def _row(name: str, s: dict) -> str:
    def f(key: str, fmt: str) -> str:
        v = s.get(key)
        return "—" if v is None else format(v, fmt)

    return (f"{name:>17}: TTFT mean {f('ttft_mean_s', '6.2f')}s p99 {f('ttft_p99_s', '6.2f')}s | QoE "
            f"{f('qoe_mean', '.3f')} | stall/stream {f('stall_per_stream_mean_s', '.2f')}s p99 "
            f"{f('stall_per_stream_p99_s', '.2f')}s | raw {f('raw_tput', '7.1f')} effective "
            f"{f('effective_tput', '7.1f')} tok/s | preemptions {f('preemptions', '4.0f')} | done "
            f"{f('completion_s', '5.1f')}s")
