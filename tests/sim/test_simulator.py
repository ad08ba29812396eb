"""The simulator drives the engine's own objects on a virtual clock, with conservation checks on every step."""

from __future__ import annotations

import json

import pytest

from tokenflow_ray.engine.block_pool import BlockPool
from tokenflow_ray.engine.kv_manager import KVManager
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.policies.tokenflow import TokenFlowPolicy
from tokenflow_ray.engine.scheduler import Scheduler
from tokenflow_ray.sim.conservation import ConservationChecker, ConservationError, LivelockError
from tokenflow_ray.sim.experiments import run_setup
from tokenflow_ray.sim.setups import gpu_replica_setup
from tokenflow_ray.sim.simulator import Simulation
from tokenflow_ray.workloads.generators import LengthDist, RequestSpec, WorkloadSpec, make_requests


def _requests(n: int = 30, workload: str = "burst", seed: int = 0, arrival_rate: float = 2.0) -> list[RequestSpec]:
    """Table 1's shape at 1/8 of its lengths (~64-token prompts, ~256-token outputs), to keep tests short."""
    spec = WorkloadSpec(workload, n, seed=seed, rate=20.0, arrival_rate=arrival_rate,
                        prompt=LengthDist(64, 16, min_len=8), output=LengthDist(256, 64, min_len=16),
                        length_scale=1.0)
    return make_requests(spec)


def _setup(policy: str, device_blocks: int = 160, host_blocks: int = 640):
    """The 4090 profile with a pool of ~1/3 of a 30-stream burst at full length (the paper's memory pressure)."""
    return gpu_replica_setup("4090", "llama3-8b", policy,
                             cache_overrides={"num_device_blocks": device_blocks, "num_host_blocks": host_blocks})


def test_the_simulator_drives_the_engines_own_scheduler_policy_and_block_pool(monkeypatch):
    calls = {"schedule": 0, "update": 0, "allocate": 0}
    for cls, name in ((Scheduler, "schedule"), (Scheduler, "update"), (BlockPool, "allocate")):
        original = getattr(cls, name)

        def counted(self, *a, _original=original, _name=name, **k):
            calls[_name] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(cls, name, counted)
    sim = Simulation(_setup("tokenflow"), checks=True, integrity=True)
    engine = sim.replicas[0].engine
    assert type(engine) is LLMEngine and type(engine.scheduler) is Scheduler
    assert type(engine.scheduler.policy) is TokenFlowPolicy and type(engine.scheduler.kv) is KVManager
    assert engine.scheduler.pool is engine.pool and type(engine.pool) is BlockPool
    outcome = sim.run(_requests())
    assert calls["update"] == outcome.steps == sim.replicas[0].runner.totals.steps
    assert calls["schedule"] >= outcome.steps and calls["allocate"] > 0
    assert engine.stats().preemptions > 0  # the pool is a fraction of the burst: the real policy pauses streams
    assert engine.scheduler.bytes_to_host > 0  # write-through and swap-outs went through the real KV manager
    assert len(outcome.records) == 30 and all(r.finished for r in outcome.records)


@pytest.mark.parametrize("policy", ["fcfs", "andes", "tokenflow"])
def test_every_policy_finishes_a_burst_with_the_checks_on(policy):
    requests = _requests(24)
    sim = Simulation(_setup(policy), checks=True, integrity=True)
    outcome = sim.run(requests)
    checker = sim.replicas[0].checker
    assert checker.tokens_out == sum(r.output_len for r in requests) <= checker.tokens_scheduled
    assert sum(len(r.token_times) for r in outcome.records) == checker.tokens_out


def test_poisson_arrivals_are_held_by_the_engine_until_they_arrive():
    requests = _requests(20, workload="poisson")
    outcome = Simulation(_setup("fcfs")).run(requests)
    by_id = {r.stream_id: r for r in outcome.records}
    for req in requests:
        rec = by_id[f"req-{req.index}"]
        assert rec.arrival_s == req.arrival_s and rec.token_times[0] > req.arrival_s


def test_checker_catches_a_runner_that_emits_more_than_it_was_fed():
    sim = Simulation(_setup("fcfs"), checks=True)
    runner = sim.replicas[0].runner
    execute = runner.execute

    def leaky(plan):  # a token for a stream the plan did not sample (the kind of bug that inflates throughput)
        result = execute(plan)
        result.sampled["ghost"] = 0
        return result

    runner.execute = leaky
    with pytest.raises(ConservationError, match="tokens out"):
        sim.run(_requests(8))


def test_livelock_guard_names_the_stuck_stream():
    sim = Simulation(_setup("fcfs"))
    engine = sim.replicas[0].engine
    engine.add_request([1] * 16, stream_id="stuck")
    engine.step()  # admitted, now live
    checker = ConservationChecker(engine, livelock_steps=50)
    for _ in range(49):
        checker.after_step(None, None, [])
    with pytest.raises(LivelockError, match="stuck"):
        checker.after_step(None, None, [])


def _strip(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True)


def test_a_seed_gives_identical_json_and_another_seed_differs():
    kwargs = dict(num_requests=12, policies=("fcfs", "tokenflow"))
    a = run_setup("4090", "llama3-8b", "c", seed=3, **kwargs)
    b = run_setup("4090", "llama3-8b", "c", seed=3, **kwargs)
    c = run_setup("4090", "llama3-8b", "c", seed=4, **kwargs)
    assert _strip(a) == _strip(b)
    assert _strip(a) != _strip(c)
    assert set(a["policies"]["tokenflow"]) >= {"ttft_p50_s", "ttft_p99_s", "effective_tput", "raw_tput", "stall_s",
                                              "preemptions"}
    assert a["paper"]["vs_fcfs"] and a["ours"]["vs_fcfs"]["effective_tput"] > 0


@pytest.mark.parametrize("router", ["slack", "pow2", "round_robin"])
def test_several_replicas_share_one_clock_behind_a_router(router):
    requests = _requests(48, workload="poisson", arrival_rate=20.0)
    sim = Simulation(_setup("tokenflow"), num_replicas=4, router=router, checks=True)
    outcome = sim.run(requests)
    assert len(outcome.records) == 48 and all(r.finished for r in outcome.records)
    counts = outcome.per_replica_streams
    assert sum(counts.values()) == 48 and min(counts.values()) >= 6, counts
    assert all(r.engine.clock is sim.clock for r in sim.replicas)
    if router == "slack":  # the router's in-flight ledger reconciled bookings against the replicas' own stats
        states = [sim.ledger.state_of(f"req-{r.index}") for r in requests]
        assert states.count("pending") < len(requests) and {"absorbed", "departed"} & set(states)


def test_bad_arguments_are_rejected():
    setup = _setup("fcfs")
    with pytest.raises(ValueError, match="replicas"):
        Simulation(setup, num_replicas=0)
    with pytest.raises(ValueError, match="router"):
        Simulation(setup, num_replicas=2, router="random")
