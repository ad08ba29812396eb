"""Admission: a replica's Serve concurrency from its working set, Serve's bounded queue (no Ray instance needed)."""

from __future__ import annotations

import math

import pytest

from tokenflow_ray.serve.config import ServeConfig, serve_engine
from tokenflow_ray.serve.replica.admission import (
    Admission,
    KVClaims,
    direct_kv_budget,
    direct_stream_limit,
    stream_claim,
    working_set_streams,
)

pytestmark = pytest.mark.timeout(60)


def test_default_config_takes_its_working_set_and_queues_a_quarter_of_it():
    cfg = ServeConfig(images=False)
    # (1024 device + 4096 host blocks) / (512 tokens / 16 per block) = 160 streams, above the batch of 64.
    assert cfg.admission() == Admission(max_ongoing_requests=160, max_queued_requests=40)


def test_each_knob_moves_the_derived_concurrency():
    pool = dict(num_device_blocks=256, num_host_blocks=768, max_num_seqs=8)
    base = ServeConfig(images=False, engine=serve_engine(**pool))
    assert base.admission().max_ongoing_requests == 1024 // 32
    assert ServeConfig(images=False, expected_stream_tokens=128, engine=serve_engine(**pool)
                       ).admission().max_ongoing_requests == 1024 // 8
    assert ServeConfig(images=False, engine=serve_engine(**{**pool, "num_host_blocks": 1792})
                       ).admission().max_ongoing_requests == 2048 // 32
    assert ServeConfig(images=False, engine=serve_engine(**pool, block_size=32)
                       ).admission().max_ongoing_requests == 1024 // 16
    # A partial block is a whole block: 513 tokens take 33 blocks of 16.
    assert working_set_streams(1024, 4096, 16, 513) == 5120 // 33


def test_never_below_the_batch_and_explicit_values_win():
    small = ServeConfig(images=False, engine=serve_engine(num_device_blocks=64, num_host_blocks=0,
                                                          max_num_seqs=16))
    assert small.admission().max_ongoing_requests == 16  # 2 streams' worth of memory; the batch must be fillable
    cfg = ServeConfig(images=False, max_ongoing_requests=70, max_queued_requests=5)
    assert cfg.admission() == Admission(70, 5)
    assert ServeConfig(images=False, max_queued_requests=-1).admission().max_queued_requests == -1
    # The derived queue grows with the replicas a caller's router spreads over.
    assert ServeConfig(images=False, replicas=3).admission().max_queued_requests == 3 * 160 // 4


@pytest.mark.parametrize("bad, message", [
    ({"expected_stream_tokens": 0}, "expected_stream_tokens"),
    ({"max_ongoing_requests": 63}, "max_ongoing_requests: must be >= max_num_seqs"),
    ({"max_queued_requests": 0}, "max_queued_requests"),
    ({"max_queued_requests": -2}, "max_queued_requests"),
    ({"retry_after_s": -1}, "retry_after_s"),
    ({"register_grace_s": math.nan}, "register_grace_s"),
    ({"register_grace_s": -1.0}, "register_grace_s"),
    ({"http": "ingress", "max_ongoing_requests": 2000}, "ingress_max_ongoing"),
    ({"http": "ingress", "ingress_max_ongoing": 199}, "ingress_max_ongoing"),  # 160 + 40 must get through it
    ({"http": "sideways"}, "http: must be one of direct, ingress"),
])
def test_admission_fields_are_validated(bad, message):
    with pytest.raises(ValueError, match=message) as err:
        ServeConfig(images=False, **bad)
    assert "\n" not in str(err.value)
    assert ServeConfig(images=False, ingress_max_ongoing=200).ingress_max_ongoing == 200


def test_demo_runs_at_default_admission_and_144_streams_overflow_it():
    from tokenflow_ray.lab.demo import QUICK, DemoConfig

    cfg = DemoConfig()
    sc = cfg.serve_config("tokenflow")
    assert (sc.engine.scheduler.max_num_seqs, sc.max_ongoing_requests, sc.max_queued_requests) == (64, None, None)
    assert sc.expected_stream_tokens == len(cfg.prompt(0)) + 2 + cfg.max_tokens
    adm = sc.admission()
    # The burst fits the replica (no 429s at the default 48); three times it overflows replica + queue.
    assert cfg.streams <= adm.max_ongoing_requests < 3 * cfg.streams
    assert adm.max_ongoing_requests + adm.max_queued_requests < 3 * cfg.streams
    cache = sc.engine.cache
    assert adm.max_ongoing_requests > cache.num_device_blocks // -(-sc.expected_stream_tokens // cache.block_size)
    quick = QUICK.serve_config("fcfs").admission()
    assert QUICK.streams <= quick.max_ongoing_requests and QUICK.streams < cfg.streams


def test_demo_quick_flag_and_rejected_column():
    from tokenflow_ray.cli import build_parser
    from tokenflow_ray.lab.demo import QUICK, demo_config, print_table

    args = build_parser().parse_args(["demo", "--quick"])
    assert args.quick is True and demo_config(quick=True) == QUICK
    assert demo_config(quick=True, policies="fcfs").policies == ("fcfs",)
    assert demo_config(streams=144).timeout_s > QUICK.timeout_s
    row = {"ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "effective_tput": 1.0, "raw_tput": 2.0, "stall_s": 0.0,
           "complete": 116, "admitted": 116, "rejected": 28}
    workload = {"streams": 144, "max_tokens": 128, "rate": 16.0, "num_device_blocks": 96,
                "max_ongoing_requests": 93, "max_queued_requests": 23}
    text = print_table({"policies": {"tokenflow": row}, "workload": workload})
    assert "116/116" in text and "429" in text and " 28 " in text


def test_direct_placement_admits_by_the_kv_each_stream_claims():
    adm = ServeConfig(images=False, engine=serve_engine(num_device_blocks=96, num_host_blocks=32, max_num_seqs=2),
                      expected_stream_tokens=256, max_queued_requests=2).admission()
    assert direct_stream_limit(adm, 1) == 10 and direct_kv_budget(adm, 1, 16, 256) == 160
    assert direct_kv_budget(Admission(8, -1), 1, 16, 256) == 0  # an unbounded queue: no limit here
    # Prompt + max_tokens in whole blocks, capped by the context limit and by the budget itself.
    assert stream_claim(8, 600, 1536, 16, 160) == 38
    assert stream_claim(8, 100_000, 1536, 16, 1000) == 96
    assert stream_claim(8, 100_000, 1536, 16, 50) == 50
    claims = KVClaims(160)
    assert [claims.try_claim(38) for _ in range(5)] == [True] * 4 + [False]  # 152 held: a fifth long one waits
    assert claims.try_claim(2) and claims.try_claim(2) and claims.try_claim(2)  # short ones still fit: 158
    assert not claims.try_claim(3) and claims.held == 158
    claims.release(38)
    assert claims.try_claim(38) and claims.held == 158
    for blocks in (38, 38, 38, 38, 2, 2, 2):
        claims.release(blocks)
    assert claims.held == 0
    assert KVClaims(160).try_claim(500)  # larger than the budget: taken when nothing else is held
    unlimited = KVClaims(0)
    assert all(unlimited.try_claim(10_000) for _ in range(3))
    with pytest.raises(AssertionError):
        KVClaims(10).release(1)
