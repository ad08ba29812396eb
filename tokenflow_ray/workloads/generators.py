"""Seeded request workloads: burst, Poisson, gamma-bursty, mixed rates, rate sweep (serving-paper.md §5).

Lengths are normal like the paper's Table 1 (S/L input 512/1024, S/L output 1024/2048 on the RTX 4090),
multiplied by `length_scale` so a CPU run takes minutes. The paper gives no standard deviation; we use a
quarter of the mean [interpretation]. Pure Python: `random.Random` with one sub-stream per concern, so changing
e.g. the rate mix does not reshuffle arrivals or lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from tokenflow_ray.checks import check_count, check_positive, check_rate

WORKLOAD_NAMES = ("burst", "poisson", "gamma", "mixed", "sweep")
TABLE1_INPUT = MappingProxyType({"S": 512, "L": 1024})  # mean prompt tokens (RTX 4090 column)
TABLE1_OUTPUT = MappingProxyType({"S": 1024, "L": 2048})  # mean output tokens
STD_FRACTION = 0.25  # [interpretation] std / mean; the paper only says "normally distributed"


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float  # seconds after the first arrival (the first request arrives at 0)
    prompt_len: int
    output_len: int
    rate: float  # declared consumption rate, tokens/s
    # Which prompt prefixes repeat (Mooncake: one id per 512 prompt tokens, equal ids equal content; workloads/
    # prompts.py); (): a prompt of its own.
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LengthDist:
    """Normal length distribution in paper tokens; scaled, rounded, then clamped to [min_len, max_len]."""

    mean: float
    std: float
    min_len: int = 1  # clamps are in scaled tokens (what the engine sees)
    max_len: int | None = None  # None: no upper clamp

    def __post_init__(self) -> None:
        check_positive(self.mean, "mean")
        check_rate(self.std, "std")  # finite, >= 0
        check_count(self.min_len, "min_len", minimum=1)
        if self.max_len is not None and check_count(self.max_len, "max_len", minimum=1) < self.min_len:
            raise ValueError(f"max_len={self.max_len} < min_len={self.min_len}")

    def sample(self, rng: random.Random, scale: float) -> int:
        value = round(rng.gauss(self.mean * scale, self.std * scale))
        value = max(self.min_len, value)
        return value if self.max_len is None else min(self.max_len, value)


def table1_lengths(code: str) -> tuple[LengthDist, LengthDist]:
    """(prompt, output) distributions for a Table 1 class: 'SL' = short input, long output, etc."""
    if len(code) != 2 or code[0] not in TABLE1_INPUT or code[1] not in TABLE1_OUTPUT:
        raise ValueError(f"length class must be two of S/L like 'SL', got {code!r}")
    prompt, output = TABLE1_INPUT[code[0]], TABLE1_OUTPUT[code[1]]
    return LengthDist(prompt, STD_FRACTION * prompt), LengthDist(output, STD_FRACTION * output)


_SL_PROMPT, _SL_OUTPUT = table1_lengths("SL")


@dataclass(frozen=True)
class WorkloadSpec:
    name: str  # burst | poisson | gamma | mixed | sweep
    num_requests: int
    seed: int = 0
    # Arrivals. burst/mixed/sweep: groups of burst_size every burst_interval_s (None: all at t=0).
    burst_size: int | None = None
    burst_interval_s: float = 0.0
    arrival_rate: float = 2.0  # poisson/gamma: mean requests/s (the paper's lambda)
    gamma_shape: float = 0.5  # gamma inter-arrivals: CV = 1/sqrt(shape); < 1 is burstier than Poisson
    # Consumption rates (tokens/s). mixed uses rate_mix, sweep one workload per sweep_rates entry.
    rate: float = 20.0
    rate_mix: tuple[tuple[float, float], ...] = ((15.0, 0.4), (20.0, 0.6))  # (rate, fraction)
    sweep_rates: tuple[float, ...] = (20.0, 25.0, 30.0)
    # Lengths.
    prompt: LengthDist = field(default=_SL_PROMPT)
    output: LengthDist = field(default=_SL_OUTPUT)
    length_scale: float = 1.0 / 8  # multiplies means and stds so a CPU run takes minutes

    def __post_init__(self) -> None:
        if self.name not in WORKLOAD_NAMES:
            raise ValueError(f"name must be one of {WORKLOAD_NAMES}, got {self.name!r}")
        check_count(self.num_requests, "num_requests", minimum=1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.burst_size is not None:
            check_count(self.burst_size, "burst_size", minimum=1)
        check_rate(self.burst_interval_s, "burst_interval_s")
        check_positive(self.arrival_rate, "arrival_rate")
        check_positive(self.gamma_shape, "gamma_shape")
        check_rate(self.rate)
        if not self.rate_mix:
            raise ValueError("rate_mix must not be empty")
        for rate, fraction in self.rate_mix:
            check_rate(rate, "rate_mix rate")
            check_positive(fraction, "rate_mix fraction")
        if abs(sum(f for _, f in self.rate_mix) - 1.0) > 1e-9:
            raise ValueError(f"rate_mix fractions must sum to 1, got {self.rate_mix}")
        if not self.sweep_rates:
            raise ValueError("sweep_rates must not be empty")
        for rate in self.sweep_rates:
            check_rate(rate, "sweep_rates")
        if not isinstance(self.prompt, LengthDist) or not isinstance(self.output, LengthDist):
            raise ValueError("prompt and output must be LengthDist")
        check_positive(self.length_scale, "length_scale")


def sweep_workloads(spec: WorkloadSpec) -> list[WorkloadSpec]:
    """A sweep is one burst workload per rate; other workloads are returned as they are."""
    if spec.name != "sweep":
        return [spec]
    return [replace(spec, name="burst", rate=rate) for rate in spec.sweep_rates]


def make_requests(spec: WorkloadSpec) -> list[RequestSpec]:
    """The workload's requests, sorted by arrival; the same spec always gives the same list."""
    if spec.name == "sweep":
        raise ValueError("a sweep is several workloads: expand it with sweep_workloads(spec)")
    arrivals = _arrivals(spec, random.Random(f"{spec.seed}:arrivals"))
    rates = _rates(spec, random.Random(f"{spec.seed}:rates"))
    lengths_rng = random.Random(f"{spec.seed}:lengths")
    requests = []
    for index, (arrival, rate) in enumerate(zip(arrivals, rates)):
        prompt_len = spec.prompt.sample(lengths_rng, spec.length_scale)
        output_len = spec.output.sample(lengths_rng, spec.length_scale)
        requests.append(RequestSpec(index, arrival, prompt_len, output_len, rate))
    return requests


def _arrivals(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    n = spec.num_requests
    if spec.name in ("burst", "mixed"):
        size = spec.burst_size or n
        return [(i // size) * spec.burst_interval_s for i in range(n)]
    if spec.name == "poisson":
        gaps = [rng.expovariate(spec.arrival_rate) for _ in range(n - 1)]
    else:  # gamma: mean gap 1/arrival_rate, shape sets the burstiness
        scale = 1.0 / (spec.gamma_shape * spec.arrival_rate)
        gaps = [rng.gammavariate(spec.gamma_shape, scale) for _ in range(n - 1)]
    times = [0.0]  # time origin = first arrival, so makespans start at 0
    for gap in gaps:
        times.append(times[-1] + gap)
    return times


def _rates(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    if spec.name != "mixed":
        return [spec.rate] * spec.num_requests
    return assign_rates(spec.num_requests, spec.rate_mix, rng)


def assign_rates(n: int, rate_mix: tuple[tuple[float, float], ...], rng: random.Random) -> list[float]:
    """n reader rates in exact proportions (largest remainder), then a seeded shuffle: a 40/60 mix is 40/60, not
    "about"."""
    quotas = [fraction * n for _, fraction in rate_mix]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: quotas[i] - counts[i], reverse=True)
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    rates = [rate for (rate, _), count in zip(rate_mix, counts) for _ in range(count)]
    rng.shuffle(rates)
    return rates


# ---- presets: Table 1 setups (RTX 4090 column), counts scaled for a CPU run ------------------------


def _scaled_count(paper_count: int, count_scale: float) -> int:
    return max(1, round(paper_count * check_positive(count_scale, "count_scale")))


def setup_a(count_scale: float = 0.25, **overrides) -> WorkloadSpec:
    """(a) burst of 60, short input / long output."""
    prompt, output = table1_lengths("SL")
    spec = WorkloadSpec("burst", _scaled_count(60, count_scale), prompt=prompt, output=output)
    return replace(spec, **overrides)


def setup_b(count_scale: float = 0.25, **overrides) -> WorkloadSpec:
    """(b) burst of 80, long input / long output."""
    prompt, output = table1_lengths("LL")
    spec = WorkloadSpec("burst", _scaled_count(80, count_scale), prompt=prompt, output=output)
    return replace(spec, **overrides)


def setup_c(count_scale: float = 0.25, **overrides) -> WorkloadSpec:
    """(c) Poisson, low lambda = 2 req/s, SL; 60 requests at count_scale 1 (the paper gives no count)."""
    prompt, output = table1_lengths("SL")
    spec = WorkloadSpec(
        "poisson", _scaled_count(60, count_scale), arrival_rate=2.0, prompt=prompt, output=output
    )
    return replace(spec, **overrides)


def setup_d(count_scale: float = 0.25, **overrides) -> WorkloadSpec:
    """(d) Poisson, high lambda = 4 req/s, SL."""
    prompt, output = table1_lengths("SL")
    spec = WorkloadSpec(
        "poisson", _scaled_count(60, count_scale), arrival_rate=4.0, prompt=prompt, output=output
    )
    return replace(spec, **overrides)


def preset(setup: str, **overrides) -> WorkloadSpec:
    """setup_a..setup_d by letter ('a'..'d'), with keyword overrides of any WorkloadSpec field."""
    builders = {"a": setup_a, "b": setup_b, "c": setup_c, "d": setup_d}
    if setup not in builders:
        raise ValueError(f"setup must be one of {sorted(builders)}, got {setup!r}")
    return builders[setup](**overrides)
