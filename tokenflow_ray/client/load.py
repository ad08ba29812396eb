"""run_load: a bounded burst of paced streams against a loopback server (count and time are capped)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx

from tokenflow_ray.client.stream import PacedStreamClient, StreamResult, StreamSpec
from tokenflow_ray.metrics.summary import PolicySummary, summarize

MAX_STREAMS = 1024
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class LoadResult:
    results: list[StreamResult]
    wall_s: float

    @property
    def records(self) -> list:
        """Admitted streams that produced a token: what summaries are over (a rejected stream has no record)."""
        return [r.record for r in self.results if r.record is not None]

    @property
    def num_rejected(self) -> int:
        return sum(r.rejected for r in self.results)

    @property
    def num_admitted(self) -> int:
        return len(self.results) - self.num_rejected

    @property
    def num_complete(self) -> int:
        return sum(r.complete for r in self.results)

    @property
    def total_tokens(self) -> int:
        return sum(r.num_tokens for r in self.results)

    def summary(self) -> PolicySummary:
        return summarize(self.records)


async def run_load(base_url: str, specs: Sequence[StreamSpec], *, model: str = "embedded",
                   api_key: str | None = None, timeout_s: float = 300.0, report_interval_s: float | None = 1.0,
                   report_drift_s: float | None = 0.5,
                   on_done: Callable[[StreamResult], None] | None = None) -> LoadResult:
    """report_interval_s=None sends no consumption reports (servers without the route, e.g. vLLM); otherwise each
    stream checks that often and reports when its reader drifted report_drift_s seconds of reading off the
    server's model of it (None: at every check). See client/report_trigger.py."""
    host = urlparse(base_url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"base_url: the load generator only targets loopback hosts, got {host!r}")
    if not 0 < len(specs) <= MAX_STREAMS:
        raise ValueError(f"specs: between 1 and {MAX_STREAMS} streams, got {len(specs)}")
    limits = httpx.Limits(max_connections=len(specs) + 16, max_keepalive_connections=len(specs) + 16)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as http:
        client = PacedStreamClient(http, base_url, model, api_key, report_interval_s, report_drift_s)

        async def one(spec: StreamSpec) -> StreamResult:
            await asyncio.sleep(max(0.0, spec.start_s - client.now()))
            res = await client.run(spec)
            if on_done is not None:
                on_done(res)
            return res

        tasks = [asyncio.create_task(one(s)) for s in specs]
        start = time.monotonic()
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.monotonic() - start
    results = []
    for spec, task in zip(specs, tasks):
        if task in done and task.exception() is None:
            results.append(task.result())
        else:
            results.append(StreamResult(spec, error="timed out" if task in pending else repr(task.exception())))
    return LoadResult(results, wall)
