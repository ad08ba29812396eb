"""The scale run: many streams over many simulated replicas behind the slack router, timed on the wall clock.

Workload [our choice]: Table 1 "SL" lengths scaled by 1/16 (~32-token prompts, ~128-token outputs on the H200
profile, whose outputs are 2x), Poisson arrivals over `arrival_window_s`, 20 tok/s readers. Each replica's engine
runs the real scheduler and policy every step, so the wall time is the scheduler's own cost at that scale.
"""

from __future__ import annotations

from tokenflow_ray.sim.experiments import summarize_outcome
from tokenflow_ray.sim.setups import DEFAULT_RATE, gpu_replica_setup
from tokenflow_ray.sim.simulator import Simulation
from tokenflow_ray.workloads.generators import LengthDist, WorkloadSpec, make_requests, table1_lengths


def scale_requests(num_streams: int, gpu: str, seed: int = 0, arrival_window_s: float = 10.0,
                   length_scale: float = 1 / 16):
    prompt, output = table1_lengths("SL")
    f = 2.0 if gpu == "h200" else 1.0
    spec = WorkloadSpec("poisson", num_streams, seed=seed, rate=DEFAULT_RATE,
                        arrival_rate=num_streams / arrival_window_s, length_scale=length_scale,
                        prompt=LengthDist(prompt.mean, prompt.std, min_len=8),
                        output=LengthDist(output.mean * f, output.std * f, min_len=16))
    return make_requests(spec)


def run_scale(num_streams: int = 10_000, replicas: int = 64, gpu: str = "h200", model: str = "llama3-8b",
              policy: str = "tokenflow", router: str = "slack", seed: int = 0, checks: bool = True) -> dict:
    requests = scale_requests(num_streams, gpu, seed)
    setup = gpu_replica_setup(gpu, model, policy, num_requests=num_streams)
    sim = Simulation(setup, num_replicas=replicas, router=router, checks=checks, integrity=False, seed=seed)
    outcome = sim.run(requests)
    summary = summarize_outcome(outcome)
    per = summary.pop("per_replica_streams")
    return {"streams": num_streams, "replicas": replicas, "gpu": gpu, "model": model, "policy": policy,
            "router": router, "wall_s": outcome.wall_s, "steps": outcome.steps, "sim_end_s": outcome.sim_end_s,
            "per_replica_streams": {"min": min(per.values()), "max": max(per.values())}, "summary": summary}
