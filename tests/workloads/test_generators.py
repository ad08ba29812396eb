from __future__ import annotations

import dataclasses
import math
import statistics

import pytest

from tokenflow_ray.workloads.generators import (
    LengthDist,
    RequestSpec,
    WorkloadSpec,
    make_requests,
    preset,
    setup_a,
    setup_b,
    setup_c,
    setup_d,
    sweep_workloads,
    table1_lengths,
)


@pytest.mark.parametrize("name", ["burst", "poisson", "gamma", "mixed"])
def test_same_seed_same_requests(name):
    spec = WorkloadSpec(name, 50, seed=7)
    assert make_requests(spec) == make_requests(WorkloadSpec(name, 50, seed=7))
    assert make_requests(spec) != make_requests(WorkloadSpec(name, 50, seed=8))


@pytest.mark.parametrize("name", ["burst", "poisson", "gamma", "mixed"])
def test_counts_indices_and_monotone_arrivals(name):
    requests = make_requests(WorkloadSpec(name, 37, seed=1))
    assert len(requests) == 37
    assert [r.index for r in requests] == list(range(37))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    assert all(isinstance(r, RequestSpec) and r.prompt_len >= 1 and r.output_len >= 1 for r in requests)


def test_burst_all_at_zero_and_grouped_bursts():
    assert {r.arrival_s for r in make_requests(WorkloadSpec("burst", 10))} == {0.0}
    grouped = make_requests(WorkloadSpec("burst", 7, burst_size=3, burst_interval_s=2.0))
    assert [r.arrival_s for r in grouped] == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 4.0]


def test_poisson_and_gamma_mean_rate():
    for name in ("poisson", "gamma"):
        requests = make_requests(WorkloadSpec(name, 2001, seed=3, arrival_rate=5.0))
        mean_gap = requests[-1].arrival_s / 2000
        assert mean_gap == pytest.approx(0.2, rel=0.15)


def test_gamma_shape_sets_burstiness():
    def cv(shape):
        arrivals = [r.arrival_s for r in make_requests(WorkloadSpec("gamma", 2001, gamma_shape=shape))]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        return statistics.pstdev(gaps) / statistics.mean(gaps)

    assert cv(0.25) == pytest.approx(2.0, rel=0.25)  # CV = 1/sqrt(shape)
    assert cv(4.0) == pytest.approx(0.5, rel=0.25)


@pytest.mark.parametrize("n", [1, 5, 10, 33, 100])
def test_mixed_rates_exact_proportions(n):
    rates = [r.rate for r in make_requests(WorkloadSpec("mixed", n, seed=2))]
    assert set(rates) <= {15.0, 20.0}
    assert len(rates) == n
    assert abs(rates.count(15.0) - 0.4 * n) < 1 and abs(rates.count(20.0) - 0.6 * n) < 1


def test_mixed_rates_are_shuffled_and_single_rate_elsewhere():
    rates = [r.rate for r in make_requests(WorkloadSpec("mixed", 100, seed=2))]
    assert rates.count(15.0) == 40 and rates != sorted(rates)
    assert {r.rate for r in make_requests(WorkloadSpec("poisson", 20, rate=12.5))} == {12.5}


def test_sweep_expands_to_one_burst_per_rate():
    spec = WorkloadSpec("sweep", 8, seed=4)
    parts = sweep_workloads(spec)
    assert [p.rate for p in parts] == [20.0, 25.0, 30.0]
    assert all(p.name == "burst" and p.num_requests == 8 for p in parts)
    assert {r.rate for r in make_requests(parts[2])} == {30.0}
    with pytest.raises(ValueError, match="sweep_workloads"):
        make_requests(spec)
    plain = WorkloadSpec("poisson", 3)
    assert sweep_workloads(plain) == [plain]


def test_lengths_scaled_and_clamped():
    prompt, output = table1_lengths("SL")
    assert (prompt.mean, output.mean) == (512, 2048)
    spec = WorkloadSpec("burst", 2000, length_scale=1 / 8, prompt=prompt, output=output)
    requests = make_requests(spec)
    assert statistics.mean(r.prompt_len for r in requests) == pytest.approx(64, rel=0.05)
    assert statistics.mean(r.output_len for r in requests) == pytest.approx(256, rel=0.05)
    clamped = dataclasses.replace(spec, output=LengthDist(2048, 1024, min_len=200, max_len=300))
    lengths = [r.output_len for r in make_requests(clamped)]
    assert min(lengths) == 200 and max(lengths) == 300


def test_presets_match_table1_setups():
    a, b, c, d = setup_a(), setup_b(), setup_c(), setup_d()
    assert (a.name, a.num_requests, a.prompt.mean, a.output.mean) == ("burst", 15, 512, 2048)
    assert (b.name, b.num_requests, b.prompt.mean, b.output.mean) == ("burst", 20, 1024, 2048)
    assert (c.name, c.arrival_rate, d.name, d.arrival_rate) == ("poisson", 2.0, "poisson", 4.0)
    assert setup_a(count_scale=1.0).num_requests == 60
    assert preset("b", num_requests=3, rate=15.0) == dataclasses.replace(b, num_requests=3, rate=15.0)
    with pytest.raises(ValueError, match="setup"):
        preset("e")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "trace"}, "name"),
        ({"num_requests": 0}, "num_requests"),
        ({"num_requests": True}, "num_requests"),
        ({"seed": 1.5}, "seed"),
        ({"burst_size": 0}, "burst_size"),
        ({"burst_interval_s": -1.0}, "burst_interval_s"),
        ({"arrival_rate": 0.0}, "arrival_rate"),
        ({"arrival_rate": math.inf}, "arrival_rate"),
        ({"gamma_shape": -1.0}, "gamma_shape"),
        ({"rate": math.nan}, "rate"),
        ({"rate": -1.0}, "rate"),
        ({"rate_mix": ((15.0, 0.5), (20.0, 0.6))}, "sum to 1"),
        ({"rate_mix": ()}, "rate_mix"),
        ({"sweep_rates": (20.0, math.inf)}, "sweep_rates"),
        ({"length_scale": 0.0}, "length_scale"),
        ({"prompt": 512}, "LengthDist"),
    ],
)
def test_workload_validation(kwargs, field):
    base = {"name": "burst", "num_requests": 4}
    with pytest.raises(ValueError, match=field):
        WorkloadSpec(**{**base, **kwargs})


def test_length_and_table_validation():
    with pytest.raises(ValueError, match="max_len"):
        LengthDist(100, 10, min_len=50, max_len=10)
    with pytest.raises(ValueError, match="mean"):
        LengthDist(0, 10)
    with pytest.raises(ValueError, match="std"):
        LengthDist(10, -1)
    with pytest.raises(ValueError, match="length class"):
        table1_lengths("SM")
