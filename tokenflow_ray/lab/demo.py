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

    def __post_init__(self) -> None:
        if not self.policies or self.streams <= 0 or self.max_tokens <= 0 or self.rate <= 0:
            raise ValueError("policies, streams, max_tokens and rate must be non-empty/positive")

    def prompt(self, i: int) -> str:
        return f"Reader {i:03d}: please tell me a long story about the sea."

    @property
    def stream_tokens(self) -> int:
        """Prompt + output of one stream: a fact of the workload (byte-level tokenizer: ~1 token per byte)."""
        return len(self.prompt(0).encode()) + 2 + self.max_tokens

    def serve_config(self, policy: str) -> ServeConfig:
        block = 16
        blocks = self.kv_streams * -(-self.stream_tokens // block)
        return ServeConfig(app_name="demo", expected_stream_tokens=self.stream_tokens, num_cpus=1, images=False,
                           engine=serve_engine(policy=policy, num_device_blocks=blocks,
                                               num_host_blocks=self.host_blocks, block_size=block))

    def specs(self) -> list[StreamSpec]:
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
        task = progress.add_task(f"{policy:>9}", total=cfg.streams)
        return asyncio.run(run_load(base_url, cfg.specs(), timeout_s=cfg.timeout_s, report_interval_s=1.0,
                                    on_done=lambda _: progress.advance(task)))
    finally:
        undeploy(serve_cfg)


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
        s = res.summary()
        policies[name] = {"ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s,
                          "effective_tput": s.effective_tput, "raw_tput": s.raw_tput, "stall_s": s.stall_s,
                          "qoe_mean": s.qoe_mean, "complete": res.num_complete, "streams": len(res.results),
                          "admitted": res.num_admitted, "rejected": res.num_rejected}
    sc = cfg.serve_config(cfg.policies[0])
    adm, cache = sc.admission(), sc.engine.cache
    report = {"policies": policies, "wall_s": time.monotonic() - start,
              "workload": {"streams": cfg.streams, "max_tokens": cfg.max_tokens, "rate": cfg.rate,
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
    table = Table(title=f"{w['streams']} streams x {w['max_tokens']} tokens read at {w['rate']} tok/s, "
                        f"KV pool {w['num_device_blocks']} blocks",
                  caption=f"a replica takes {w['max_ongoing_requests']} streams, Serve queues "
                          f"{w['max_queued_requests']} more; the rest get 429 (rejected). "
                          "TTFT, throughput and stall are over admitted streams.")
    table.add_column("policy", no_wrap=True)
    for col in ("TTFT p50 (s)", "TTFT p99 (s)", "eff. tok/s", "raw tok/s", "stall (s)", "done", "429"):
        table.add_column(col, justify="right")
    for name, p in report["policies"].items():
        table.add_row(name, f"{p['ttft_p50_s']:.2f}", f"{p['ttft_p99_s']:.2f}", f"{p['effective_tput']:.1f}",
                      f"{p['raw_tput']:.1f}", f"{p['stall_s']:.1f}", f"{p['complete']}/{p['admitted']}",
                      str(p["rejected"]))
    console = Console(record=True)
    console.print(table)
    return console.export_text()


def demo_config(policies: str | None = None, streams: int | None = None, max_tokens: int | None = None,
                rate: float | None = None, quick: bool = False) -> DemoConfig:
    cfg = QUICK if quick else DemoConfig()
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
