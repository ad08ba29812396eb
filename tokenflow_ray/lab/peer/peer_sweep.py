"""`tokenflow bench peer --load X` and `--sweep`: the peer workload sized from the measured decode capacity Γ.

Γ is measured once, in this process before any server starts, by the same calibration as `bench policies --sweep`
(lab/capacity.py) at the peer bench's own engine config: its device pool (kv_blocks), host store, block size, step
budget, CPU threads, mean prompt and max_tokens. The batch is the streams the pool holds at full length
(480 blocks / 20 blocks a stream = 24 by default), as on the server.

A load point keeps the pool, the lengths and the reader rate and sets the stream count (lab/load_scaling.py):
streams = round(load x Γ / mean declared rate), the mean being `rate` for burst and poisson and 0.9 x rate for
mixed (40% at 0.75x). Unlike the policy sweep this changes the memory regime with the load (more streams for the
same pool), which is the point of this bench: one fixed server, more readers. Poisson gets the same number of
streams and λ = load x Γ / max_tokens by Little's law.

Γ is the engine's in-process capacity with the whole machine; over HTTP on the same cores our server delivers less
(docs/results/serving.md: at load 1.0, 333 streams asking 6660 tok/s, tokenflow delivered 1673 tok/s raw and vLLM
2030 on 2 cores), so load 1.0 here is already past what any of the three systems can serve, and the sweep shows how
each degrades.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from tokenflow_ray.lab.capacity import Capacity, CapacityConfig, measure_decode_capacity
from tokenflow_ray.lab.load_scaling import arrival_rate_for_load, streams_for_load
from tokenflow_ray.lab.peer.peer_bench import PeerBenchConfig, print_table, run_peer_bench
from tokenflow_ray.metrics.summary import policy_ratios

MAX_STREAMS = 1024  # the load generator's cap (PeerBenchConfig)


def peer_capacity_config(cfg: PeerBenchConfig, decode_steps: int = 96) -> CapacityConfig:
    # The batch cap does not bind (the pool does); SchedulerConfig wants it <= the step budget.
    seqs = min(cfg.max_num_seqs or cfg.max_num_batched_tokens, cfg.max_num_batched_tokens)
    return CapacityConfig(num_device_blocks=cfg.kv_blocks, num_host_blocks=cfg.host_blocks, block_size=cfg.block_size,
                          mean_prompt_len=cfg.prompt_len, mean_output_len=cfg.max_tokens, max_num_seqs=seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens, model=cfg.model, num_threads=cfg.threads,
                          decode_steps=decode_steps, seed=cfg.seed)


def mean_rate(cfg: PeerBenchConfig) -> float:
    if cfg.workload == "mixed":
        return sum(rate * fraction for rate, fraction in cfg.workload_spec().rate_mix)
    return cfg.rate


def peer_config_for_load(cfg: PeerBenchConfig, load: float, gamma: float) -> PeerBenchConfig:
    """`cfg` with its stream count (and, for poisson, arrival rate) set for Σ rates ≈ load x Γ."""
    streams = streams_for_load(load, gamma, mean_rate(cfg))
    if streams > MAX_STREAMS:
        raise ValueError(f"load {load:g}: {streams} streams (Γ {gamma:.0f} tok/s / {mean_rate(cfg):g} tok/s per "
                         f"reader) exceed the load generator's {MAX_STREAMS}; raise --rate")
    out = replace(cfg, streams=streams)
    if out.batch_cap > out.max_num_batched_tokens:  # the engine wants every running stream to fit a step's budget
        raise ValueError(f"load {load:g}: {streams} streams exceed max_num_batched_tokens="
                         f"{out.max_num_batched_tokens} (the batch cap is the stream count); raise --rate")
    if cfg.workload == "poisson":
        out = replace(out, arrival_rate=arrival_rate_for_load(load, gamma, cfg.max_tokens))
    return out


def describe_peer_point(cfg: PeerBenchConfig, load: float, gamma: float) -> dict:
    reqs = cfg.requests()
    return {"load": load, "workload": cfg.workload, "gamma_tok_s": gamma, "streams": cfg.streams, "rate": cfg.rate,
            "sum_rates": sum(r.rate for r in reqs),
            "arrival_rate": cfg.arrival_rate if cfg.workload == "poisson" else None}


def measure_peer_capacity(cfg: PeerBenchConfig, progress: Callable[[str], None] = print) -> Capacity:
    return measure_decode_capacity(peer_capacity_config(cfg), progress=progress)


def run_peer_at_load(cfg: PeerBenchConfig, load: float, capacity: Capacity) -> tuple[dict, dict]:
    """One peer bench at load x Γ: its usual report plus `load` (how it was sized) and `capacity`."""
    point = peer_config_for_load(cfg, load, capacity.tok_s)
    report, runs = run_peer_bench(point)
    report.update(load=describe_peer_point(point, load, capacity.tok_s), capacity=capacity.to_dict())
    return report, runs


def run_peer_sweep(cfg: PeerBenchConfig, loads: tuple[float, ...], capacity: Capacity,
                   plots_dir: str | None = None) -> dict:
    """Each load in turn (ascending), each a full peer bench (systems take turns); `sweep: [...]` like the policy
    sweep's, with the systems under `policies`. Per-point plots and vLLM logs go to <dir>/load-<x>/."""
    start = time.monotonic()
    base_dir = Path(cfg.log_dir or "out/peer")
    sweep = []
    for i, load in enumerate(sorted(loads)):
        point = peer_config_for_load(cfg, load, capacity.tok_s)
        sub = f"load-{load:g}"
        point = replace(point, log_dir=str(base_dir / sub))
        entry = describe_peer_point(point, load, capacity.tok_s)
        print(f"== point {i + 1}/{len(loads)}: {cfg.workload} at {load:g}x Γ ({point.streams} streams, "
              f"Σrate {entry['sum_rates']:.0f} tok/s)", flush=True)
        report, runs = run_peer_bench(point)
        print_table(report)
        systems = report["systems"]
        entry.update(policies=systems, kv=report["kv"], workload_detail=report["workload"], wall_s=report["wall_s"])
        if "tokenflow" in systems and "fcfs" in systems:
            entry["tokenflow_vs_fcfs"] = policy_ratios(systems["tokenflow"], systems["fcfs"])
        if "tokenflow" in systems and "vllm" in systems:
            entry["tokenflow_vs_vllm"] = policy_ratios(systems["tokenflow"], systems["vllm"])
        if plots_dir:
            from tokenflow_ray.lab.peer.plots import write_peer_plots

            entry["plots"] = write_peer_plots(runs, report, Path(plots_dir) / sub)
        sweep.append(entry)
    return {"sweep": sweep, "capacity": capacity.to_dict(), "config": asdict(cfg), "loads": sorted(loads),
            "wall_s": time.monotonic() - start}
