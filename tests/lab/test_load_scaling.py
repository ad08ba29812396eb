"""Load-point arithmetic (Σ rates = load x Γ) for the policy sweep and the peer bench, without an engine."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace

import pytest

from tokenflow_ray.lab.load_scaling import (
    arrival_rate_for_load,
    describe_point,
    policy_config_for_load,
    rate_for_load,
    streams_for_load,
)
from tokenflow_ray.lab.peer.peer_bench import PeerBenchConfig
from tokenflow_ray.lab.peer.peer_sweep import peer_capacity_config, peer_config_for_load
from tokenflow_ray.lab.policy_bench import PolicyBenchConfig, pool_sizes
from tokenflow_ray.lab.sweep import SweepConfig, capacity_config
from tokenflow_ray.workloads.generators import make_requests

GAMMA = 2400.0


def test_formulas():
    assert rate_for_load(1.0, GAMMA, 48) == pytest.approx(50.0)
    assert rate_for_load(0.5, GAMMA, 48) == pytest.approx(25.0)
    assert arrival_rate_for_load(1.0, 1000.0, 250.0) == pytest.approx(4.0)  # λ = load·Γ / mean output
    assert arrival_rate_for_load(1.5, 1000.0, 250.0) == pytest.approx(6.0)
    assert streams_for_load(1.0, 4342.0, 20.0) == 217
    assert streams_for_load(0.001, 100.0, 20.0) == 1
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="load"):
            rate_for_load(bad, GAMMA, 48)
        with pytest.raises(ValueError, match="gamma"):
            streams_for_load(1.0, bad, 20.0)
    with pytest.raises(ValueError, match="mean_output"):
        arrival_rate_for_load(1.0, GAMMA, 0)


@pytest.mark.parametrize("load", [0.5, 1.0, 1.5])
def test_burst_points_keep_the_memory_regime(load):
    base = PolicyBenchConfig(num_requests=48)
    cfg = policy_config_for_load(base, "burst", load, GAMMA)
    requests = make_requests(cfg.workload_spec())
    base_requests = make_requests(base.workload_spec())
    assert sum(r.rate for r in requests) == pytest.approx(load * GAMMA)
    assert [r.rate for r in requests] == pytest.approx([load * GAMMA / 48] * 48)
    # Same requests (count, lengths, arrivals) and so the same pool at every load: only reader rates move.
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in requests] == \
        [(r.prompt_len, r.output_len, r.arrival_s) for r in base_requests]
    assert pool_sizes(cfg, requests) == pool_sizes(base, base_requests)


@pytest.mark.parametrize("n", [4, 12, 48])
def test_mixed_point_sums_exactly(n):
    cfg = policy_config_for_load(PolicyBenchConfig(num_requests=n), "mixed", 1.25, GAMMA)
    requests = make_requests(cfg.workload_spec())
    rates = Counter(r.rate for r in requests)
    assert sum(r.rate for r in requests) == pytest.approx(1.25 * GAMMA)
    low, high = sorted(rates)
    assert low == pytest.approx(0.75 * high) and high == pytest.approx(cfg.rate)
    assert abs(rates[low] - 0.4 * n) < 1  # the 40/60 mix is exact (largest remainder)


@pytest.mark.parametrize("workload", ["poisson", "gamma"])
def test_timed_arrivals_by_littles_law(workload):
    base = PolicyBenchConfig(num_requests=48)
    cfg = policy_config_for_load(base, workload, 1.0, GAMMA)
    requests = make_requests(cfg.workload_spec())
    mean_output = statistics.mean(r.output_len for r in requests)
    assert cfg.arrival_rate == pytest.approx(GAMMA / mean_output)
    assert cfg.rate == pytest.approx(policy_config_for_load(base, "burst", 1.0, GAMMA).rate)  # the burst's readers
    point = describe_point(cfg, 1.0, GAMMA, requests)
    assert point["concurrent_sum_rates"] == pytest.approx(GAMMA)
    assert point["arrival_rate"] == cfg.arrival_rate and point["workload"] == workload
    assert point["last_arrival_s"] > 0
    # Enough requests for a steady state, on the burst's pool: the demand really is about load x Γ.
    assert cfg.num_requests == 3 * base.num_requests
    assert cfg.pool_blocks == pool_sizes(base, make_requests(base.workload_spec()))
    assert 0.8 < point["demand"]["peak"] < 1.5 and 0.6 < point["demand"]["mean"] < 1.1


def test_describe_burst_point():
    cfg = policy_config_for_load(PolicyBenchConfig(num_requests=10), "burst", 0.75, 1000.0)
    point = describe_point(cfg, 0.75, 1000.0, make_requests(cfg.workload_spec()))
    assert point["arrival_rate"] is None and point["last_arrival_s"] == 0.0
    assert point["sum_rates"] == pytest.approx(750.0) and point["rates"] == {str(75.0): 10}
    assert (point["load"], point["gamma_tok_s"], point["num_requests"]) == (0.75, 1000.0, 10)


def test_sweep_config_points_and_calibration_config():
    cfg = SweepConfig(base=PolicyBenchConfig(num_requests=48), loads=(1.5, 0.5, 1.0))
    assert cfg.loads == (0.5, 1.0, 1.5)
    assert cfg.points() == [("burst", 0.5), ("burst", 1.0), ("burst", 1.5), ("poisson", 1.0), ("gamma", 1.0),
                            ("mixed", 1.0)]
    assert len(SweepConfig().points()) == 8  # 5 burst loads + 3 presets
    cap = capacity_config(cfg)
    base_requests = make_requests(cfg.base.workload_spec())
    assert (cap.num_device_blocks, cap.num_host_blocks) == pool_sizes(cfg.base, base_requests)
    assert cap.num_threads == cfg.base.num_threads and cap.max_num_seqs == cfg.base.max_num_seqs
    assert cap.batch < cap.max_num_seqs  # the pool limits the batch in this regime, not max_num_seqs
    for bad, match in (({"loads": (1.0, 1.0)}, "repeated"), ({"loads": (0.0,)}, "positive"),
                       ({"presets": ("trace",)}, "presets"), ({"loads": (), "presets": ()}, "at least one")):
        with pytest.raises(ValueError, match=match):
            SweepConfig(**bad)


def test_peer_load_sizing():
    cfg = PeerBenchConfig(systems=("fcfs", "tokenflow"))
    assert peer_config_for_load(cfg, 1.0, 1000.0).streams == 50  # round(1.0 x 1000 / 20)
    assert peer_config_for_load(cfg, 0.5, 1000.0).streams == 25
    mixed = replace(cfg, workload="mixed")
    assert peer_config_for_load(mixed, 1.0, 900.0).streams == 50  # mean rate 0.4 x 15 + 0.6 x 20 = 18
    poisson = replace(cfg, workload="poisson")
    point = peer_config_for_load(poisson, 1.0, 1024.0)
    assert point.streams == round(1024 / 20) and point.arrival_rate == pytest.approx(1024.0 / cfg.max_tokens)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        peer_config_for_load(cfg, 1.5, 8000.0)  # 600 streams > the 512-token step budget
    cap = peer_capacity_config(cfg)
    assert (cap.batch, cap.num_threads, cap.num_device_blocks) == (24, 2, 480)  # 480 blocks / 20 a stream
