"""Routers compared at GPU scale: the same seeded requests of each Table 1 setup through each router, on a cluster
of replicas that may differ in device (`tokenflow simulate routing`).

The routers are the simulator's (simulator.ROUTERS): `slack` is cluster/routing.py's decision, the code the Serve
router runs; `pow2` is Serve's default (two random replicas, the shorter queue); `round_robin` the naive spread.
A heterogeneous cluster (several device kinds serving one model, each replica with its own KV pool, host link and
cost model) is where a count-balancing router and one that prices each replica's own speed part ways: with equal
replicas both spread a workload about evenly and tie.

JSON: `{cluster: [gpu per replica], model, policy, seed, setups: {name: {describe, requests, routers: {router:
summary}, slack_vs: {router: {effective_tput, ttft_p99, raw_tput}: slack / that router}}}}`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenflow_ray.metrics.summary import policy_ratios
from tokenflow_ray.sim.experiments import summarize_outcome
from tokenflow_ray.sim.hardware import GPU_NAMES, deployment
from tokenflow_ray.sim.setups import SETUP_NAMES, gpu_replica_setup, paper_setup, setup_requests
from tokenflow_ray.sim.simulator import ROUTERS, Simulation

COMPARED = ("slack", "pow2", "round_robin")


def compare_routers(gpus: Sequence[str], model: str = "llama3-8b", setups: Sequence[str] = ("a", "d"),
                    routers: Sequence[str] = COMPARED, policy: str = "tokenflow", seed: int = 0,
                    num_requests: int | None = None, checks: bool = True) -> dict:
    """Each setup's requests (sized for the H200 column of Table 1 unless `num_requests`) through each router."""
    if len(gpus) < 2:
        raise ValueError(f"replica gpus: a comparison needs 2 or more replicas, got {len(gpus)}")
    for g in gpus:
        if g not in GPU_NAMES:
            raise ValueError(f"replica gpus: expected names from {', '.join(GPU_NAMES)}, got {g!r}")
    for name in setups:
        if name not in SETUP_NAMES:
            raise ValueError(f"setup: expected names from {', '.join(SETUP_NAMES)}, got {name!r}")
    for r in routers:
        if r not in ROUTERS:
            raise ValueError(f"router: expected names from {', '.join(ROUTERS)}, got {r!r}")
    # Lengths must fit every replica's model limit; one model, so one limit.
    max_total = min(deployment(g, model).model.max_model_len for g in gpus)
    out: dict = {"cluster": list(gpus), "model": model, "policy": policy, "seed": seed, "setups": {}}
    for name in setups:
        setup = paper_setup("h200", name)
        requests = setup_requests(setup, seed=seed, num_requests=num_requests, max_total=max_total)
        replica_setups = [gpu_replica_setup(g, model, policy, num_requests=len(requests)) for g in gpus]
        results = {}
        for router in routers:
            sim = Simulation(replica_setups[0], num_replicas=len(gpus), router=router, checks=checks, seed=seed,
                             replica_setups=replica_setups)
            results[router] = summarize_outcome(sim.run(requests))
        out["setups"][name] = {
            "describe": setup.describe(), "requests": len(requests), "routers": results,
            "slack_vs": ({r: policy_ratios(results["slack"], results[r]) for r in results if r != "slack"}
                         if "slack" in results else {}),
        }
    return out


def print_comparison(out: dict) -> None:
    print(f"cluster {','.join(out['cluster'])} / {out['model']}, policy {out['policy']}, seed {out['seed']}")
    for row in out["setups"].values():
        print(f"{row['describe']}, {row['requests']} requests")
        print(f"{'router':>12} {'TTFT p50':>9} {'TTFT p99':>9} {'effective':>10} {'raw':>9} {'stall':>9}  streams")
        for router, s in row["routers"].items():
            per = "/".join(str(v) for v in s["per_replica_streams"].values())
            print(f"{router:>12} {s['ttft_p50_s']:>9.2f} {s['ttft_p99_s']:>9.2f} {s['effective_tput']:>10.0f} "
                  f"{s['raw_tput']:>9.0f} {s['stall_s']:>9.0f}  {per}")
