"""Simulated experiments on a GPU profile: one Table 1 setup under each policy, the rate sweep, μ, Δt and the
Table 2 ablation; every figure is `tokenflow_ray.metrics.summarize` over the engine's own stream records.

The JSON follows docs/design.md §10: `setup`, `policies: {name: {ttft_p50_s, ttft_p99_s, effective_tput, raw_tput,
stall_s, preemptions, ...}}`, `paper: {...}` with our ratios beside the paper's.

With `migration` (replicas > 1) every policy runs twice on the same requests, with the central actor's table fed
and checked both times: `policies` is the run where nothing moves, and `migration` holds
`{settings, link, policies: {name: summary of the run with moves}, ours: tokenflow's ratios in those runs,
vs_no_migration: {name: {effective_tput, ttft_p99, raw_tput}: with / without}}`. Each summary of a run with the
table has `migration: {ticks, reliefs, migrations, moved_streams, taken_back, kv_bytes, transfer_s,
transfer_s_max}` and `stream_migrations` (Σ over the streams' records).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, replace

from tokenflow_ray.cluster.migration_policy import MigrationSettings
from tokenflow_ray.engine.config import prefix_cache_overrides
from tokenflow_ray.engine.policies import POLICY_NAMES, TokenFlowConfig
from tokenflow_ray.metrics import summarize
from tokenflow_ray.metrics.guards import guards
from tokenflow_ray.metrics.summary import policy_ratios
from tokenflow_ray.sim.hardware import MEASURED, deployment
from tokenflow_ray.sim.migration import MigrationLink
from tokenflow_ray.sim.real_runs import STANDARD_WARMUP
from tokenflow_ray.sim.setups import (
    DEFAULT_RATE,
    PAPER,
    PaperSetup,
    gpu_replica_setup,
    paper_figures,
    paper_setup,
    setup_requests,
)
from tokenflow_ray.sim.simulator import SimOutcome, Simulation
from tokenflow_ray.workloads.ablations import ABLATIONS
from tokenflow_ray.workloads.generators import RequestSpec
from tokenflow_ray.workloads.traces import Trace

Progress = Callable[[int, int], None] | None


def prefix_cache_summary(engines: Sequence) -> dict:
    """The prefix cache's prompt hits per tier, summed over the replicas (issue 42's JSON)."""
    stats = [e.scheduler.prefix_stats for e in engines]
    return {"mode": engines[0].config.cache.prefix_cache_mode,
            "prompt_tokens": sum(s.prompt_tokens for s in stats),
            "hit_tokens_device": sum(s.prompt_hit_tokens_device for s in stats),
            "hit_tokens_host": sum(s.prompt_hit_tokens_host for s in stats)}


def summarize_outcome(outcome: SimOutcome) -> dict:
    engines = [r.engine for r in outcome.replicas]
    to_host = sum(e.scheduler.bytes_to_host for e in engines)
    from_host = sum(e.scheduler.bytes_from_host for e in engines)
    summary = summarize(outcome.records, bytes_to_host=to_host, bytes_from_host=from_host).to_dict()
    completion = max((r.token_times[-1] for r in outcome.records if r.token_times), default=0.0)
    # No wall-clock figure here: a seed's JSON must be identical run to run (the scale command times runs).
    summary.update(completion_s=completion, steps=outcome.steps, per_replica_streams=outcome.per_replica_streams,
                   prefix_cache=prefix_cache_summary(engines))
    if outcome.migration is not None:
        summary.update(migration=outcome.migration.totals.to_dict(),
                       stream_migrations=sum(r.migrations for r in outcome.records))
    return summary


def simulate_policy(gpu: str, model: str, policy: str, requests: Sequence[RequestSpec], replicas: int = 1,
                    router: str = "slack", tokenflow: TokenFlowConfig | None = None,
                    cache_overrides: dict | None = None, checks: bool = True, integrity: bool = False,
                    seed: int = 0, progress: Progress = None, migration: MigrationSettings | None = None,
                    migration_on: bool = True, migration_link: MigrationLink | None = None,
                    length_scale: float = 1.0, what_if: tuple[str, ...] = ()) -> dict:
    """One policy on `requests`. A measured engine profile (hardware.MEASURED) first runs the standard warm-up, as
    its real runs did (the engine's learnt costs start from it)."""
    setup = gpu_replica_setup(gpu, model, policy, tokenflow, cache_overrides, num_requests=len(requests),
                              length_scale=length_scale, what_if=what_if)
    sim = Simulation(setup, num_replicas=replicas, router=router, checks=checks, integrity=integrity, seed=seed,
                     migration=migration, migration_on=migration_on, migration_link=migration_link)
    start = 0.0
    if gpu in MEASURED and replicas == 1:
        start = sim.warm_up(*STANDARD_WARMUP)
        requests = [replace(r, arrival_s=r.arrival_s + start) for r in requests]
    summary = summarize_outcome(sim.run(requests, progress=progress))
    summary["completion_s"] -= start
    return summary


def ratios(results: dict) -> dict:
    out = {}
    if "tokenflow" in results and "fcfs" in results:
        out["vs_fcfs"] = policy_ratios(results["tokenflow"], results["fcfs"])
    if "tokenflow" in results and "andes" in results:
        out["vs_andes"] = policy_ratios(results["tokenflow"], results["andes"])
    return out


def run_setup(gpu: str, model: str, name: str, policies: Sequence[str] = POLICY_NAMES, replicas: int = 1,
              router: str = "slack", seed: int = 0, rate: float = DEFAULT_RATE, num_requests: int | None = None,
              tokenflow: TokenFlowConfig | None = None, checks: bool = True,
              progress: Callable[[str], Progress] | None = None, migration: MigrationSettings | None = None,
              migration_link: MigrationLink | None = None, length_scale: float = 1.0,
              what_if: tuple[str, ...] = (), prefix_cache: str | None = None) -> dict:
    """`prefix_cache`: off, device or device+host (None: the engine's default)."""
    setup = paper_setup(gpu, name)
    overrides = prefix_cache_overrides(prefix_cache) if prefix_cache else None
    dep = deployment(gpu, model)
    requests = setup_requests(setup, seed=seed, rate=rate, num_requests=num_requests,
                              max_total=dep.model.max_model_len, length_scale=length_scale)
    results, moved = {}, {}
    for policy in policies:
        bar = progress(policy) if progress is not None else None
        results[policy] = simulate_policy(gpu, model, policy, requests, replicas, router, tokenflow,
                                          cache_overrides=overrides, checks=checks, seed=seed, progress=bar,
                                          migration=migration, migration_on=False, migration_link=migration_link,
                                          length_scale=length_scale, what_if=what_if)
        if migration is not None:
            bar = progress(f"{policy}+migration") if progress is not None else None
            moved[policy] = simulate_policy(gpu, model, policy, requests, replicas, router, tokenflow,
                                            cache_overrides=overrides, checks=checks, seed=seed, progress=bar,
                                            migration=migration,
                                            migration_link=migration_link, length_scale=length_scale,
                                            what_if=what_if)
    out = {"setup": {**setup_dict(setup, gpu, model, requests, replicas, router, rate, seed),
                     "length_scale": length_scale, "what_if": list(what_if)},
           "policies": results, "ours": ratios(results), "paper": paper_figures(setup)}
    if migration is not None:
        out["migration"] = {"settings": asdict(migration), "link": asdict(migration_link or MigrationLink()),
                            "policies": moved,
                            "ours": ratios(moved),
                            "vs_no_migration": {p: policy_ratios(moved[p], results[p]) for p in moved}}
    return out


def run_trace(gpu: str, model: str, trace: Trace, policies: Sequence[str] = ("fcfs", "tokenflow"),
              replicas: int = 1, router: str = "slack", seed: int = 0, tokenflow: TokenFlowConfig | None = None,
              checks: bool = True, progress: Callable[[str], Progress] | None = None,
              prefix_cache: str | None = None) -> dict:
    """A replayed trace (workloads/traces.py) under each policy on the same requests; tokenflow's reader-felt
    guards against fcfs (metrics/guards.py) beside the ratios. `prefix_cache`: off, device or device+host (None:
    the engine's default). The JSON: `setup` (the trace as replayed), `policies: {name: summary}` (each with
    `prefix_cache: {mode, prompt_tokens, hit_tokens_device, hit_tokens_host}`), `ours`, `guards`."""
    dep = deployment(gpu, model)
    too_long = [r for r in trace.requests if r.prompt_len + r.output_len > dep.model.max_model_len]
    if too_long:
        raise ValueError(f"{trace.path}: {len(too_long)} requests exceed {model}'s context of "
                         f"{dep.model.max_model_len} tokens; pass --max-context {dep.model.max_model_len}")
    results = {}
    for policy in policies:
        bar = progress(policy) if progress is not None else None
        results[policy] = simulate_policy(gpu, model, policy, trace.requests, replicas, router, tokenflow,
                                          checks=checks, seed=seed, progress=bar,
                                          cache_overrides=prefix_cache_overrides(prefix_cache) if prefix_cache
                                          else None)
    out = {"setup": {**trace.describe(), "describe": _trace_label(trace), "gpu": gpu, "model": model,
                     "deployment": dep.name, "tp": dep.tp, "kv_pool_tokens": dep.kv_pool_tokens,
                     "replicas": replicas, "router": router if replicas > 1 else None},
           "policies": results, "ours": ratios(results)}
    if "tokenflow" in results and "fcfs" in results:
        out["guards"] = {"tokenflow_vs_fcfs": guards(results["tokenflow"], results["fcfs"])}
    return out


def _trace_label(trace: Trace) -> str:
    o, d = trace.options, trace.describe()
    window = f", min {o.window[0]:g}-{o.window[0] + o.window[1]:g}" if o.window else ""
    return (f"trace {trace.path.rsplit('/', 1)[-1]}{window} at {o.speed:g}x: {d['num_requests']} streams, "
            f"{d['requests_per_s'] or 0:.1f} req/s, mean prompt {d['mean_prompt']:.0f}, output {d['mean_output']:.0f}")


def setup_dict(setup: PaperSetup, gpu: str, model: str, requests: Sequence[RequestSpec], replicas: int,
               router: str, rate: float, seed: int) -> dict:
    dep = deployment(gpu, model)
    return {"name": setup.name, "describe": setup.describe(), **asdict(setup), "model": model,
            "deployment": dep.name, "tp": dep.tp, "kv_pool_tokens": dep.kv_pool_tokens, "replicas": replicas,
            "router": router if replicas > 1 else None, "rate": rate, "seed": seed, "num_requests": len(requests),
            "sum_rate": sum(r.rate for r in requests),
            "mean_prompt": sum(r.prompt_len for r in requests) / len(requests),
            "mean_output": sum(r.output_len for r in requests) / len(requests)}


def rate_sweep(gpu: str, model: str, name: str = "a", rates: Sequence[float] = (20.0, 25.0, 30.0),
               seed: int = 0, replicas: int = 1) -> dict:
    rows = {}
    for rate in rates:
        r = run_setup(gpu, model, name, ("fcfs", "tokenflow"), replicas=replicas, seed=seed, rate=rate)
        rows[str(rate)] = {"policies": r["policies"], "ours": r["ours"],
                           "paper_effective_vs_fcfs": PAPER["rate_sweep"]["vs_fcfs"]["effective_tput"].get(rate)}
    return {"setup": name, "rates": rows, "paper_source": PAPER["rate_sweep"]["source"]}


def knob_sweep(gpu: str, model: str, name: str, knob: str, values: Sequence[float], seed: int = 0) -> dict:
    """tokenflow at each value of one TokenFlowConfig knob (mu or delta_t), fcfs once for the ratio."""
    setup = paper_setup(gpu, name)
    requests = setup_requests(setup, seed=seed, max_total=deployment(gpu, model).model.max_model_len)
    fcfs = simulate_policy(gpu, model, "fcfs", requests, seed=seed)
    rows = {}
    for v in values:
        tf = simulate_policy(gpu, model, "tokenflow", requests, tokenflow=replace(TokenFlowConfig(), **{knob: v}),
                             seed=seed)
        rows[str(v)] = {"tokenflow": tf, "vs_fcfs": policy_ratios(tf, fcfs)}
    return {"setup": name, "knob": knob, "values": rows, "fcfs": fcfs, "paper_source": PAPER["knobs"]["source"]}


def ablation(gpu: str = "4090", model: str = "llama3-8b", name: str = "b", seed: int = 0) -> dict:
    """Table 2: tokenflow without offload, write-through, or evict/load overlap (lab/policy_bench.py's
    ABLATIONS, the same cache-config changes the real engine bench makes)."""
    setup = paper_setup(gpu, name)
    requests = setup_requests(setup, seed=seed, max_total=deployment(gpu, model).model.max_model_len)
    rows = {variant: simulate_policy(gpu, model, "tokenflow", requests, cache_overrides=overrides, seed=seed)
            for variant, overrides in ABLATIONS.items()}
    paper = PAPER["ablation"]["completion_s"]
    return {"setup": name, "variants": rows,
            "completion_vs_tokenflow": {v: rows[v]["completion_s"] / rows["tokenflow"]["completion_s"] for v in rows},
            "paper_completion_vs_tokenflow": {v: paper[v] / paper["tokenflow"] for v in paper},
            "paper_source": PAPER["ablation"]["source"]}


def reproduction(gpus: Sequence[str] = ("4090", "h200"), model: str = "llama3-8b",
                 setups: Sequence[str] = ("a", "b", "c", "d"), seed: int = 0,
                 progress: Callable[[str], Progress] | None = None) -> dict:
    """Setups a-d on each GPU profile under every policy: the reproduction table's data."""
    runs = {}
    for gpu in gpus:
        for name in setups:
            key = f"{gpu}/{name}"
            runs[key] = run_setup(gpu, model, name, seed=seed,
                                  progress=(lambda p, k=key: progress(f"{k} {p}")) if progress else None)
    return {"model": model, "runs": runs, "table_markdown": reproduction_markdown(runs)}


def _fmt(x: object) -> str:
    if not isinstance(x, (int, float)):
        return "—"
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.3f}x"


def reproduction_markdown(runs: dict) -> str:
    head = ("| GPU / setup | vs fcfs: effective | P99 TTFT | raw | vs andes: effective | P99 TTFT | raw "
            "| paper (vs SGLang) |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for key, run in runs.items():
        f, a = run["ours"].get("vs_fcfs", {}), run["ours"].get("vs_andes", {})
        paper = run["paper"]["vs_fcfs"]
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in paper.items())
        lines.append(f"| {key} {run['setup']['describe']} | {_fmt(f.get('effective_tput'))} | "
                     f"{_fmt(f.get('ttft_p99'))} | {_fmt(f.get('raw_tput'))} | {_fmt(a.get('effective_tput'))} | "
                     f"{_fmt(a.get('ttft_p99'))} | {_fmt(a.get('raw_tput'))} | {shown} |")
    return "\n".join(lines)
