"""`tokenflow bench serve`: the same streams through HTTP/SSE (Serve) and in-process (AsyncLLMEngine).

Runs alternate (in-process, HTTP, in-process, ...) so background load hits both alike; the figure is the median.
tok/s = output tokens / wall time from the first submission to the last token. Both sides use the same engine
config and the same number of torch threads.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

from tokenflow_ray.serve.config import ServeConfig, serve_engine


@dataclass(frozen=True)
class ServeBenchConfig:
    streams: int = 32
    max_tokens: int = 32
    runs: int = 3
    threads: int = 2  # torch threads on both sides (the replica's num_cpus)
    policy: str = "fcfs"
    stream_interval_s: float | None = None  # None: the app's default grouping interval

    def __post_init__(self) -> None:
        if self.streams <= 0 or self.max_tokens <= 0 or self.runs <= 0 or self.threads <= 0:
            raise ValueError("streams, max_tokens, runs and threads must be positive")


def _prompts(n: int) -> list[str]:
    return [f"Stream {i}: tell me about the sea." for i in range(n)]


async def _inproc_run(aengine, cfg: ServeBenchConfig) -> tuple[int, float]:
    from tokenflow_ray.engine.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: str) -> int:
        return sum([len(out.token_ids) async for out in aengine.generate(prompt, sampling, rate=0.0)])

    start = time.monotonic()
    counts = await asyncio.gather(*(one(p) for p in _prompts(cfg.streams)))
    return sum(counts), time.monotonic() - start


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    from tokenflow_ray.torch_threads import torch_threads

    with torch_threads(cfg.threads):  # the in-process engine's, as the replica's num_cpus
        return _run_serve_bench(cfg)


def _run_serve_bench(cfg: ServeBenchConfig) -> dict:
    from tokenflow_ray.client import StreamSpec, run_load
    from tokenflow_ray.engine.async_engine import AsyncLLMEngine
    from tokenflow_ray.runner.factory import build_engine
    from tokenflow_ray.serve.app import deploy, undeploy
    from tokenflow_ray.serve.local import local_serve

    serve_cfg = ServeConfig(app_name="bench", num_cpus=float(cfg.threads), images=False,
                            engine=serve_engine(policy=cfg.policy, max_num_seqs=max(64, cfg.streams),
                                                num_device_blocks=1024),
                            **({} if cfg.stream_interval_s is None else {"stream_interval_s": cfg.stream_interval_s}))
    aengine = AsyncLLMEngine(build_engine(serve_cfg.engine_config()))
    specs = [StreamSpec(p, max_tokens=cfg.max_tokens, rate=0.0) for p in _prompts(cfg.streams)]
    inproc, http = [], []
    with local_serve(num_cpus=max(4, cfg.threads + 2)) as base_url:
        deploy(serve_cfg)
        try:
            asyncio.run(run_load(base_url, specs[:2], timeout_s=120))  # warm-up: imports, first step
            from ray import serve

            replica = serve.get_deployment_handle("LLMServer", serve_cfg.app_name).runtime_info.remote().result()
            asyncio.run(_inproc_run(aengine, ServeBenchConfig(2, cfg.max_tokens, 1, cfg.threads)))
            for _ in range(cfg.runs):
                tokens, wall = asyncio.run(_inproc_run(aengine, cfg))
                inproc.append(tokens / wall)
                res = asyncio.run(run_load(base_url, specs, timeout_s=600, report_interval_s=3600))
                if res.num_complete != cfg.streams:
                    raise RuntimeError(f"HTTP run lost streams: {cfg.streams - res.num_complete}")
                http.append(res.total_tokens / res.wall_s)
        finally:
            undeploy(serve_cfg)
            aengine.shutdown()
    inproc_med, http_med = statistics.median(inproc), statistics.median(http)
    return {"streams": cfg.streams, "max_tokens": cfg.max_tokens, "runs": cfg.runs, "threads": cfg.threads, "replica": replica,
            "stream_interval_s": serve_cfg.stream_interval_s, "http_tok_s": http_med, "inproc_tok_s": inproc_med, "ratio": http_med / inproc_med,
            "http_tok_s_runs": http, "inproc_tok_s_runs": inproc}
