"""Serving runs in the real-run format (sim/real_runs.py), made by the simulator with known costs: the tests' stand-in
for ../shared/data/h200/setup_a_eighth_*.json, which CI does not have."""

from __future__ import annotations

from dataclasses import asdict, replace

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.engine.step_time_model import StepTimeFit
from tokenflow_ray.sim.cold_start import ColdStart
from tokenflow_ray.sim.cost import CalibratedStepCost, HostLink
from tokenflow_ray.sim.experiments import summarize_outcome
from tokenflow_ray.sim.simulator import ReplicaSetup, Simulation
from tokenflow_ray.workloads.generators import RequestSpec

KV_BYTES = 131_072  # Llama-3-8B's bf16 KV per token
LAW = CalibratedStepCost(StepTimeFit(0.020, 1.0e-4, 2.0e-5), 0.0)
COLD = ColdStart(decode_shape_s=0.050, prefill_shape_s=0.060)
LINK = HostLink(27e9, duplex=False)
INFO = ModelInfo(name="synthetic", vocab_size=1000, max_model_len=4096, eos_token_ids=frozenset(),
                 kv_bytes_per_token=KV_BYTES)


def burst(n: int = 40, rate: float = 20.0) -> list[RequestSpec]:
    """A burst at t = 0, prompts 16-27 tokens, outputs 48-70 (seeded by index, no RNG)."""
    return [RequestSpec(i, 0.0, 16 + (i * 7) % 12, 48 + (i * 5) % 23, rate) for i in range(n)]


def engine(policy: str, device_blocks: int = 80, host_blocks: int = 320) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(block_size=16, num_device_blocks=device_blocks, num_host_blocks=host_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, policy=policy),
                        record_history=1000)


def make_run(policy: str, requests: list[RequestSpec] | None = None, law: CalibratedStepCost = LAW,
             cold: ColdStart = COLD, link: HostLink = LINK, record_config: bool = True) -> dict:
    """The run as a real driver would record it: the standard warm-up first (not recorded), then every step timed,
    and the policy config it ran (`engine.tokenflow`) unless `record_config` is off (as in the first H200 runs)."""
    requests = requests or burst()
    cfg = engine(policy)
    sim = Simulation(ReplicaSetup(cfg, INFO, law, link, cold=cold), checks=True, integrity=True)
    start = sim.warm_up(8, 4)
    runner = sim.replicas[0].runner
    runner.step_log = []
    outcome = sim.run([replace(r, arrival_s=r.arrival_s + start) for r in requests])
    c, s = cfg.cache, cfg.scheduler
    return {
        "policy": policy, "device": "simulated", "an_extra_key": {"ignored": True},
        "request_list_columns": ["index", "arrival_s", "prompt_len", "output_len", "rate", "extra_column"],
        "request_list": [[r.index, r.arrival_s, r.prompt_len, r.output_len, r.rate, 0] for r in requests],
        "engine": {"block_size": c.block_size, "num_device_blocks": c.num_device_blocks,
                   "num_host_blocks": c.num_host_blocks, "max_num_seqs": s.max_num_seqs,
                   "max_num_batched_tokens": s.max_num_batched_tokens, "policy": policy,
                   "kv_bytes_per_token": KV_BYTES, "write_through": True, "overlap_copies": True,
                   **({"tokenflow": asdict(s.tokenflow)} if record_config else {})},
        "samples_columns": ["decodes", "prefill_tokens", "decode_context", "prefill_pairs", "sampled", "step_s"],
        "samples": [[st.shape.decodes, st.shape.prefill_tokens, st.shape.decode_context, st.shape.prefill_pairs,
                     st.shape.sampled, st.step_s] for st in runner.step_log],
        "summary": summarize_outcome(outcome),
        "copy_bytes_s_median": link.bytes_s,
    }
