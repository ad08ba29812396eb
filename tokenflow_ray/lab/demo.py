"""`tokenflow demo`: a burst of paced streaming clients over HTTP, once per scheduling policy, compared.

The regime where buffer-aware scheduling matters: the KV pool holds only a fraction of the burst at full length
(memory contention), while the sum of declared reading rates stays within the engine's decode capacity, so a
stream with a full buffer can give its memory to a newcomer without its reader noticing.

The server runs at the default ServeConfig admission (serve/replica/admission.py): only the memory (device pool, host store) and
the workload's stream length are set here. A burst larger than the replica's working set plus Serve's bounded
queue gets 429s, which the table counts as rejected; the other columns are over admitted streams.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from tokenflow_ray.client import LoadResult, StreamSpec, run_load
from tokenflow_ray.serve.config import ServeConfig, serve_engine

_FILLER = "the sea was calm and the ship sailed on through the night while the crew told stories. "


def trace_prompt(index: int, tokens: int) -> str:
    """A prompt of about `tokens` tokens for the embedded model's byte-level tokenizer (one token a byte, and the
    two its template adds), distinct from its first bytes on, so no two streams share a prefix by accident."""
    head = f"Reader {index:05d}: "
    body = max(0, tokens - 2 - len(head))
    return head + (_FILLER * (body // len(_FILLER) + 1))[:body]


def trace_specs(trace) -> list[StreamSpec]:
    """A replayed trace (workloads/traces.Trace) as paced streaming clients: each request's prompt length, output
    length, reader rate and arrival."""
    return [StreamSpec(trace_prompt(r.index, r.prompt_len), max_tokens=r.output_len, rate=r.rate, start_s=r.arrival_s)
            for r in trace.requests]


@dataclass(frozen=True)
class DemoConfig:
    policies: tuple[str, ...] = ("tokenflow", "fcfs")
    streams: int = 48
    max_tokens: int = 128
    rate: float = 16.0  # tokens/s each reader consumes; streams x rate near (under) the replica's decode capacity
    burst_s: float = 1.0  # arrivals spread over this long
    kv_streams: int = 8  # the device pool holds about this many streams at full length
    host_blocks: int = 1024  # CPU spill store (blocks): paused streams live here, so the working set can exceed the device pool
    num_cpus: int = 4  # the local Ray instance
    timeout_s: float = 120.0  # per policy
    trace: object | None = None  # a workloads/traces.Trace replayed instead of the burst

    def __post_init__(self) -> None:
        if not self.policies or self.streams <= 0 or self.max_tokens <= 0 or self.rate <= 0:
            raise ValueError("policies, streams, max_tokens and rate must be non-empty/positive")

    def prompt(self, i: int) -> str:
        return f"Reader {i:03d}: please tell me a long story about the sea."

    @property
    def stream_tokens(self) -> int:
        """Prompt + output of one stream: a fact of the workload (byte-level tokenizer: ~1 token per byte); a
        trace's mean."""
        if self.trace is not None:
            d = self.trace.describe()
            return round(d["mean_prompt"] + d["mean_output"])
        return len(self.prompt(0).encode()) + 2 + self.max_tokens

    def serve_config(self, policy: str) -> ServeConfig:
        block = 16
        blocks = self.kv_streams * -(-self.stream_tokens // block)
        return ServeConfig(app_name="demo", expected_stream_tokens=self.stream_tokens, num_cpus=1, images=False,
                           engine=serve_engine(policy=policy, num_device_blocks=blocks,
                                               num_host_blocks=self.host_blocks, block_size=block))

    def specs(self) -> list[StreamSpec]:
        if self.trace is not None:
            return trace_specs(self.trace)
        gap = self.burst_s / max(1, self.streams - 1)
        return [StreamSpec(self.prompt(i), max_tokens=self.max_tokens, rate=self.rate, start_s=i * gap)
                for i in range(self.streams)]


# `tokenflow demo --quick`: the same contrast at about a third of the streams and tokens (~30 s on 2 cores),
# for a fresh-install check.
QUICK = DemoConfig(streams=16, max_tokens=48, burst_s=0.5, kv_streams=4, host_blocks=256, timeout_s=60.0)


def _run_policy(base_url: str, cfg: DemoConfig, policy: str, progress) -> LoadResult:
    from tokenflow_ray.serve.app import deploy, undeploy

    serve_cfg = cfg.serve_config(policy)
    deploy(serve_cfg)
    try:
        asyncio.run(run_load(base_url, [StreamSpec("warm up", max_tokens=2)], timeout_s=60))
        task = progress.add_task(f"{policy:>9}", total=len(cfg.specs()))
        return asyncio.run(run_load(base_url, cfg.specs(), timeout_s=cfg.timeout_s, report_interval_s=1.0,
                                    on_done=lambda _: progress.advance(task)))
    finally:
        undeploy(serve_cfg)


def load_row(res: LoadResult) -> dict:
    """A load run's figures as every table and JSON shows them: what readers feel first."""
    s = res.summary().to_dict()
    keys = ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "qoe_mean", "stall_per_stream_mean_s",
            "stall_per_stream_p99_s", "stall_s", "raw_tput", "effective_tput", "preemptions")
    return {**{k: s[k] for k in keys}, "complete": res.num_complete, "streams": len(res.results),
            "admitted": res.num_admitted, "rejected": res.num_rejected}


def run_demo(cfg: DemoConfig) -> tuple[dict, dict[str, LoadResult]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tokenflow_ray.serve.local import local_serve

    start = time.monotonic()
    runs: dict[str, LoadResult] = {}
    with local_serve(num_cpus=cfg.num_cpus) as base_url, Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as progress:
        for policy in cfg.policies:
            runs[policy] = _run_policy(base_url, cfg, policy, progress)
    policies = {}
    for name, res in runs.items():
        policies[name] = load_row(res)
    sc = cfg.serve_config(cfg.policies[0])
    adm, cache = sc.admission(), sc.engine.cache
    report = {"policies": policies, "wall_s": time.monotonic() - start,
              "workload": {"trace": cfg.trace.describe() if cfg.trace is not None else None,
                           "streams": len(cfg.specs()), "max_tokens": cfg.max_tokens, "rate": cfg.rate,
                           "burst_s": cfg.burst_s, "num_device_blocks": cache.num_device_blocks,
                           "num_host_blocks": cache.num_host_blocks, "block_size": cache.block_size,
                           "expected_stream_tokens": sc.expected_stream_tokens,
                           "max_ongoing_requests": adm.max_ongoing_requests,
                           "max_queued_requests": adm.max_queued_requests}}
    return report, runs


def print_table(report: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    w = report["workload"]
    t = w.get("trace")
    title = (f"{w['streams']} streams x {w['max_tokens']} tokens read at {w['rate']} tok/s" if t is None else
             f"trace {t['trace']} at {t['speed']:g}x: {w['streams']} streams, mean prompt {t['mean_prompt']:.0f}, "
             f"output {t['mean_output']:.0f}")
    table = Table(title=f"{title}, KV pool {w['num_device_blocks']} blocks",
                  caption=f"a replica takes {w['max_ongoing_requests']} streams, Serve queues "
                          f"{w['max_queued_requests']} more; the rest get 429 (rejected). "
                          "Over admitted streams: TTFT mean and P99 (s), Andes QoE, stall per stream mean and P99 "
                          "(s), raw and effective throughput (tok/s).")
    table.add_column("policy", no_wrap=True)
    # Short headers: the table fits an 80-column terminal (the caption says what each is).
    cols = (("TTFT", "ttft_mean_s", ".2f"), ("P99", "ttft_p99_s", ".2f"), ("QoE", "qoe_mean", ".3f"),
            ("stall", "stall_per_stream_mean_s", ".2f"), ("P99", "stall_per_stream_p99_s", ".2f"),
            ("raw", "raw_tput", ".0f"), ("eff.", "effective_tput", ".0f"))
    for col, _, _ in cols:
        table.add_column(col, justify="right")
    table.add_column("done", justify="right")
    table.add_column("429", justify="right")
    for name, p in report["policies"].items():
        cells = ["—" if p.get(k) is None else format(p[k], f) for _, k, f in cols]
        table.add_row(name, *cells, f"{p['complete']}/{p['admitted']}", str(p["rejected"]))
    console = Console(record=True)
    console.print(table)
    return console.export_text()


def demo_config(policies: str | None = None, streams: int | None = None, max_tokens: int | None = None,
                rate: float | None = None, quick: bool = False, trace=None) -> DemoConfig:
    cfg = QUICK if quick else DemoConfig()
    if trace is not None:
        if streams or max_tokens or rate:
            raise ValueError("--trace: sets the streams, their lengths and rates; not with --streams, --max-tokens, "
                             "--rate")
        span = trace.requests[-1].arrival_s
        cfg = replace(cfg, trace=trace, timeout_s=cfg.timeout_s + 4 * span)
    if max_tokens:
        cfg = replace(cfg, max_tokens=max_tokens)
    if rate:
        cfg = replace(cfg, rate=rate)
    if policies:
        cfg = replace(cfg, policies=tuple(p.strip() for p in policies.split(",") if p.strip()))
    if streams:  # more streams, more time: the replica works through all it admits
        cfg = replace(cfg, streams=streams, timeout_s=cfg.timeout_s * max(1.0, streams / cfg.streams))
    for p in cfg.policies:
        cfg.serve_config(p)  # validates the policy name before anything starts
    return cfg
