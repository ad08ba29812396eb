"""`tokenflow bench policies --sweep`: the policy bench across regimes, at loads relative to measured capacity.

1. Measure the decode capacity Γ once, with the real engine at the bench's own config (lab/capacity.py: the
   batch the device pool holds at the workload's mean full length, the same model, threads and pools).
2. The burst at each of `loads` x Γ (Σ declared rates), then each preset (poisson, gamma, mixed) at
   `preset_load` x Γ; how each load is set is in lab/load_scaling.py. Request count, lengths and KV pool are the
   base config's at every point, so the memory regime is fixed and only the rate regime moves.
3. Each point is one `run_policy_bench`: policies take turns within each repeat, medians over repeats, every run
   kept. Points run one after another (burst loads ascending, then the presets), so a slow drift of the machine
   shows up as a trend across points, never as a difference between policies at one point.

The JSON: `sweep: [{load, workload, rate, rates, arrival_rate, sum_rates, gamma_tok_s, policies: {name: medians},
runs, tokenflow_vs_fcfs: {effective_tput, ttft_p99, raw_tput, qoe, ...}, guards: {tokenflow_vs_fcfs}, ...}]`, plus
`capacity` (Γ and how it was measured) and `config`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from tokenflow_ray.lab.capacity import Capacity, CapacityConfig, measure_decode_capacity
from tokenflow_ray.lab.load_scaling import describe_point, policy_config_for_load
from tokenflow_ray.lab.policy_bench import PolicyBenchConfig, pool_sizes, run_policy_bench
from tokenflow_ray.workloads.generators import make_requests

DEFAULT_LOADS = (0.5, 0.75, 1.0, 1.25, 1.5)
PRESETS = ("poisson", "gamma", "mixed")


@dataclass(frozen=True)
class SweepConfig:
    base: PolicyBenchConfig = field(default_factory=PolicyBenchConfig)  # requests, lengths, pool, policies
    loads: tuple[float, ...] = DEFAULT_LOADS  # burst points, x Γ
    presets: tuple[str, ...] = PRESETS
    preset_load: float = 1.0  # the presets' load, x Γ
    calibration_steps: int = 96  # timed decode steps of the capacity calibration

    def __post_init__(self) -> None:
        if not self.loads and not self.presets:
            raise ValueError("loads and presets: the sweep needs at least one point")
        for load in (*self.loads, self.preset_load):
            if isinstance(load, bool) or not isinstance(load, (int, float)) or not math.isfinite(load) or load <= 0:
                raise ValueError(f"loads: must be positive finite numbers, got {load!r}")
        if len(set(self.loads)) != len(self.loads):
            raise ValueError(f"loads: repeated values in {self.loads}")
        object.__setattr__(self, "loads", tuple(sorted(self.loads)))
        if unknown := set(self.presets) - set(PRESETS):
            raise ValueError(f"presets: unknown {sorted(unknown)}; choose from {', '.join(PRESETS)}")
        if self.calibration_steps <= 0:
            raise ValueError("calibration_steps: must be positive")

    def points(self) -> list[tuple[str, float]]:
        return [("burst", load) for load in self.loads] + [(p, self.preset_load) for p in self.presets]


def capacity_config(cfg: SweepConfig) -> CapacityConfig:
    """The calibration at the bench's config: its pools (sized from the base burst, the same at every point),
    threads, step budget and the burst's mean lengths."""
    base = replace(cfg.base, workload="burst")
    requests = make_requests(base.workload_spec())
    device_blocks, host_blocks = pool_sizes(base, requests)
    return CapacityConfig(
        num_device_blocks=device_blocks, num_host_blocks=host_blocks, block_size=base.block_size,
        mean_prompt_len=round(statistics.mean(r.prompt_len for r in requests)),
        mean_output_len=round(statistics.mean(r.output_len for r in requests)),
        max_num_seqs=base.max_num_seqs, max_num_batched_tokens=base.max_num_batched_tokens, model=base.model,
        num_threads=base.num_threads, decode_steps=cfg.calibration_steps, seed=base.seed)


def run_sweep(cfg: SweepConfig, progress: Callable[[str], None] = print,
              capacity: Capacity | None = None) -> dict:
    """The sweep's JSON object (module docstring). `capacity`: a Γ measured already (else measured here)."""
    start = time.monotonic()
    capacity = capacity or measure_decode_capacity(capacity_config(cfg), progress=progress)
    gamma = capacity.tok_s
    points = cfg.points()
    sweep = []
    for i, (workload, load) in enumerate(points):
        point_cfg = policy_config_for_load(cfg.base, workload, load, gamma)
        requests = make_requests(point_cfg.workload_spec())
        entry = describe_point(point_cfg, load, gamma, requests)
        arrivals = f", λ {entry['arrival_rate']:.2f} req/s" if entry["arrival_rate"] is not None else ""
        progress(f"== point {i + 1}/{len(points)}: {workload} at {load:g}x Γ (Σrate {entry['sum_rates']:.0f} tok/s, "
                 f"reader {point_cfg.rate:.1f} tok/s{arrivals})")
        result, _ = run_policy_bench(point_cfg, progress=progress)
        entry.update(policies=result["policies"], runs=result["runs"], workload_spec=result["workload"])
        for key in ("tokenflow_vs_fcfs", "guards", "tokenflow_vs_andes"):
            if key in result:
                entry[key] = result[key]
        if ratios := entry.get("tokenflow_vs_fcfs"):
            progress(f"   tokenflow / fcfs: effective {_fmt(ratios['effective_tput'])}, "
                     f"P99 TTFT {_fmt(ratios['ttft_p99'])}, raw {_fmt(ratios['raw_tput'])}, QoE {_fmt(ratios['qoe'])}")
        sweep.append(entry)
    return {"sweep": sweep, "capacity": capacity.to_dict(), "config": asdict(cfg),
            "wall_s": time.monotonic() - start}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"
