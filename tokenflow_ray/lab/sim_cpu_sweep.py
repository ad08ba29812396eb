"""`tokenflow simulate cpu-sweep`: the regimes of `tokenflow bench policies --sweep` in the simulator, on the law
calibrated from the real CPU engine (`simulate validate`'s JSON), so they can be run on a busy box.

The workloads are the sweep's own (lab/load_scaling.py over PolicyBenchConfig's defaults: 48 streams of Table 1 SL
at 1/8, the device pool 30% of the burst at full length, the host store 4x, 64 sequences and 256 tokens a step,
Δt 0.2 s), at Σ rates of `load` x Γ, with Γ what the calibrated law gives at the batch the pool holds at the
burst's mean full length (lab/capacity.py's batch). Beyond the sweep's points it runs overloads the sweep does
not cover (`OVERLOAD_POINTS`). Each point: fcfs and tokenflow on the same requests, the simulator's conservation
checks on every step. The JSON: `{calibration, gamma_tok_s, points: [{workload, load, policies, tokenflow_vs_fcfs}]}`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow_ray.engine.policies import TokenFlowConfig
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.engine.step_time_model import StepTimeFit
from tokenflow_ray.lab.load_scaling import policy_config_for_load
from tokenflow_ray.lab.policy_bench import PolicyBenchConfig, policy_ratios, pool_sizes
from tokenflow_ray.lab.sweep import DEFAULT_LOADS, PRESETS
from tokenflow_ray.sim.cost import CalibratedStepCost, HostLink, StepShape
from tokenflow_ray.sim.experiments import summarize_outcome
from tokenflow_ray.sim.simulator import ReplicaSetup, Simulation
from tokenflow_ray.workloads.generators import make_requests

DEFAULT_CALIBRATION = "docs/results/runs/sim_validate_cpu.json"
OVERLOAD_POINTS = (("burst", 2.0), ("poisson", 2.0), ("gamma", 2.0))
# The embedded model (models/embedded.py): 6 layers x K/V x 2 KV heads x 64 dims x 4 bytes (fp32) a token.
EMBEDDED_KV_BYTES = 6 * 2 * 2 * 64 * 4


def load_calibration(path: str | Path) -> tuple[dict[str, CalibratedStepCost], float]:
    """The per-policy laws and the copy bandwidth `simulate validate` measured (its JSON's `calibration`)."""
    data = json.loads(Path(path).read_text())
    try:
        laws = {p: CalibratedStepCost(StepTimeFit(c["fixed_s"], c["decode_s"], c["prefill_s"]), c["context_s"],
                                      c.get("pair_s", 0.0))  # JSONs before the pair term: none
                for p, c in data["calibration"].items()}
        return laws, float(data["copy_bytes_s"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a `simulate validate` JSON ({e})") from None


def capacity(base: PolicyBenchConfig, law: CalibratedStepCost) -> float:
    """Γ: the batch the pool holds at the burst's mean full length, decoding at mean mid-life context."""
    burst = replace(base, workload="burst")
    requests = make_requests(burst.workload_spec())
    device, _ = pool_sizes(burst, requests)
    full = statistics.mean(r.prompt_len + r.output_len for r in requests)
    batch = max(1, min(base.max_num_seqs, int(device / -(-full // base.block_size))))
    life = statistics.mean(r.prompt_len + r.output_len / 2 for r in requests)
    return batch / law.step_s(StepShape(batch, 0, int(batch * life), 0.0, batch))


def run_point(base: PolicyBenchConfig, workload: str, load: float, gamma: float,
              laws: dict[str, CalibratedStepCost], copy_bytes_s: float, tokenflow: TokenFlowConfig) -> dict:
    cfg = policy_config_for_load(base, workload, load, gamma)
    requests = make_requests(cfg.workload_spec())
    device, host = pool_sizes(cfg, requests)
    info = ModelInfo("embedded", vocab_size=1000, max_model_len=4096, eos_token_ids=frozenset(),
                     kv_bytes_per_token=EMBEDDED_KV_BYTES)
    policies = {}
    for policy in ("fcfs", "tokenflow"):
        engine = EngineConfig(cache=CacheConfig(block_size=cfg.block_size, num_device_blocks=device,
                                                num_host_blocks=host),
                              scheduler=SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                                                        max_num_batched_tokens=cfg.max_num_batched_tokens,
                                                        policy=policy, tokenflow=tokenflow),
                              record_history=len(requests) + 8)
        setup = ReplicaSetup(engine, info, laws[policy], HostLink(copy_bytes_s))
        policies[policy] = summarize_outcome(Simulation(setup, checks=True).run(requests))
    return {"workload": workload, "load": load, "num_requests": len(requests),
            "sum_rates": sum(r.rate for r in requests), "policies": policies,
            "tokenflow_vs_fcfs": policy_ratios(policies["tokenflow"], policies["fcfs"])}


def run_cpu_sweep(calibration: str | Path = DEFAULT_CALIBRATION, tokenflow: TokenFlowConfig | None = None,
                  progress=print) -> dict:
    laws, copy_bytes_s = load_calibration(calibration)
    base = PolicyBenchConfig()
    tokenflow = tokenflow or replace(TokenFlowConfig(), delta_t=base.tokenflow.delta_t)
    gamma = capacity(base, laws["fcfs"])
    points = [("burst", load) for load in DEFAULT_LOADS] + [(p, 1.0) for p in PRESETS] + list(OVERLOAD_POINTS)
    out = []
    for workload, load in points:
        point = run_point(base, workload, load, gamma, laws, copy_bytes_s, tokenflow)
        r = point["tokenflow_vs_fcfs"]
        progress(f"{workload} {load:g}x Γ: tokenflow / fcfs effective {r['effective_tput']:.2f}x, P99 TTFT "
                 f"{r['ttft_p99']:.3f}x, raw {r['raw_tput']:.3f}x, stall {point['policies']['tokenflow']['stall_s']:.0f}"
                 f" s against {point['policies']['fcfs']['stall_s']:.0f} s")
        out.append(point)
    return {"calibration": str(calibration), "gamma_tok_s": gamma, "copy_bytes_s": copy_bytes_s,
            "tokenflow": tokenflow.__dict__, "points": out}
