"""Load points: a workload whose Σ declared reader rates is `load` x the measured decode capacity Γ.

Pure arithmetic over workload specs (no engine), shared by `bench policies --sweep` and `bench peer --load`.

- **Burst** (all streams at once): Σ rates is linear in the per-reader rate, so r = load·Γ / Σ(rates at r = 1)
  (= load·Γ / N for a single-rate burst). The number of requests, their lengths and so the KV pool stay those of
  the base workload: only how fast readers read changes, so the memory regime is the same at every load point.
- **Mixed** (a burst with 40% of readers at mix_low x r, 60% at r): the same rule, with Σ(rates at r = 1) counted
  over the exact mix (0.75·n_low + n_high at the default mix_low), so Σ rates = load·Γ exactly.
- **Poisson / gamma** (arrivals over time): by Little's law the concurrent streams are λ x lifetime, and a paced
  stream lives about mean_output / r seconds, so about λ·mean_output / r streams read at once, each at r: the
  concurrent Σ rate is ≈ λ x mean_output whatever r is; hence λ = load·Γ / mean_output_tokens. Readers keep the
  burst's rate at the same load, so only the arrival process differs from that burst, and in steady state as many
  streams read at once as the burst has requests. N requests arrive over N / λ = (N / N_burst) stream lifetimes,
  so with the burst's N the demand only ramps up to load·Γ by the last arrival (measured: 0.43x Γ on average at
  "1.0x"). The presets therefore run STEADY_STATE_LIFETIMES x the burst's requests, on the burst's KV pool (the
  memory regime stays the same): the demand holds near load·Γ for most of the run. Each point records the
  demand it really carried (`demand`: peak and mean Σ rates of the streams being read, x Γ), so a label can be
  checked against it.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import replace

from tokenflow_ray.lab.policy_bench import PolicyBenchConfig, pool_sizes
from tokenflow_ray.workloads.generators import RequestSpec, make_requests

STEADY_STATE_LIFETIMES = 3  # arrivals over timed presets last this many stream lifetimes


def _check(load: float, gamma: float) -> None:
    for name, value in (("load", load), ("gamma", gamma)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}: must be a positive finite number, got {value!r}")


def rate_for_load(load: float, gamma: float, unit_sum_rates: float) -> float:
    """Per-reader rate r with Σ rates = load·Γ, for a workload whose Σ rates is unit_sum_rates x r."""
    _check(load, gamma)
    if unit_sum_rates <= 0:
        raise ValueError(f"unit_sum_rates: must be positive, got {unit_sum_rates!r}")
    return load * gamma / unit_sum_rates


def arrival_rate_for_load(load: float, gamma: float, mean_output_tokens: float) -> float:
    """Little's law: requests/s whose concurrent Σ rate is ≈ load·Γ (λ x mean_output)."""
    _check(load, gamma)
    if mean_output_tokens <= 0:
        raise ValueError(f"mean_output_tokens: must be positive, got {mean_output_tokens!r}")
    return load * gamma / mean_output_tokens


def streams_for_load(load: float, gamma: float, mean_rate: float) -> int:
    """Streams of mean declared rate `mean_rate` whose Σ rates is ≈ load·Γ (at least one)."""
    _check(load, gamma)
    if mean_rate <= 0:
        raise ValueError(f"mean_rate: must be positive, got {mean_rate!r}")
    return max(1, round(load * gamma / mean_rate))


# ---- the policy bench's workloads ----------------------------------------------------------------------------


def policy_config_for_load(base: PolicyBenchConfig, workload: str, load: float, gamma: float) -> PolicyBenchConfig:
    """`base` (its lengths, pool and policies) as `workload` at `load` x Γ (module docstring): the burst's
    request count, except timed presets, which get STEADY_STATE_LIFETIMES times as many on the same pool."""
    burst = replace(base, workload="burst")
    pinned = replace(base, pool_blocks=pool_sizes(burst, make_requests(burst.workload_spec())))
    # Readers read at the burst's rate for this load; the timed presets then size their arrivals by Little's law.
    unit_burst = make_requests(replace(pinned, workload="mixed" if workload == "mixed" else "burst",
                                       rate=1.0).workload_spec())
    cfg = replace(pinned, workload=workload, rate=rate_for_load(load, gamma, sum(r.rate for r in unit_burst)))
    if workload in ("poisson", "gamma"):
        cfg = replace(cfg, num_requests=STEADY_STATE_LIFETIMES * base.num_requests)
        mean_output = statistics.mean(r.output_len for r in make_requests(cfg.workload_spec()))
        cfg = replace(cfg, arrival_rate=arrival_rate_for_load(load, gamma, mean_output))
    return cfg


def demand(requests: list[RequestSpec], gamma: float) -> dict[str, float]:
    """Σ rates of the streams a reader would be reading (from arrival, output_len / rate long), x Γ: the peak,
    and the mean from the first arrival to the last reader's end."""
    events = sorted([(r.arrival_s, r.rate) for r in requests] +
                    [(r.arrival_s + r.output_len / r.rate, -r.rate) for r in requests])
    now, current, area, peak = events[0][0], 0.0, 0.0, 0.0
    for t, change in events:
        area += current * (t - now)
        now, current = t, current + change
        peak = max(peak, current)
    span = events[-1][0] - events[0][0]
    return {"peak": peak / gamma, "mean": area / span / gamma if span > 0 else 0.0}


def describe_point(cfg: PolicyBenchConfig, load: float, gamma: float, requests: list[RequestSpec]) -> dict:
    """What the JSON records per sweep point: how the load was set, and what the workload then asks for."""
    timed = cfg.workload in ("poisson", "gamma")
    mean_output = statistics.mean(r.output_len for r in requests)
    sum_rates = sum(r.rate for r in requests)
    return {
        "load": load, "workload": cfg.workload, "gamma_tok_s": gamma, "num_requests": len(requests),
        "rate": cfg.rate,  # the per-reader rate (mixed: the faster readers')
        "rates": {str(k): v for k, v in sorted(Counter(r.rate for r in requests).items())},
        "sum_rates": sum_rates,  # Σ declared rates over all requests (= load·Γ for burst and mixed)
        "arrival_rate": cfg.arrival_rate if timed else None,
        # Little's-law concurrent Σ rate for arrivals over time; the burst's Σ rates otherwise.
        "concurrent_sum_rates": cfg.arrival_rate * mean_output if timed else sum_rates,
        "mean_output_tokens": mean_output,
        "last_arrival_s": max(r.arrival_s for r in requests),
        "demand": demand(requests, gamma),  # what the point really asked for, x Γ
    }
