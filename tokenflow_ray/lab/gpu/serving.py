"""Part `serving`: the paper's H200 setup (a) at 1/8 length through the real engine on the wall clock, one policy
per process (the task), every step timed, written as `setup_a_eighth_<policy>.json` in exactly the format of
`../shared/data/h200/setup_a_eighth_*.json` (the simulator calibrates on it).

The setup, as the baseline ran it: 400 streams at t=0 read at 20 tok/s by the engine's own reader model, prompts
and outputs of `setup_requests(paper_setup("h200", "a"), seed=0)` x 1/8 (rounded, at least 8 / 16 tokens), pool
1,734 device / 6,936 host blocks of 16 tokens, max_num_seqs 256, 8192 tokens a step, default policy configs, a
4-token warm-up before. A run still going at its deadline stops (`stopped_early`) with the summary of every
stream so far. Beside the file: issue 34's slow-step share (slow_steps.py). A dry run: 16 streams at 1/128 on
the CPU (`setup_a_dry_<policy>.json`, same format).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.lab.gpu.context import COMMIT_ENV, PartContext, write_json_atomic
from tokenflow_ray.lab.gpu.slow_steps import slow_step_share
from tokenflow_ray.lab.gpu.steps import Drive, drive, model_config, prompt_ids
from tokenflow_ray.metrics import summarize
from tokenflow_ray.runner.factory import build_engine
from tokenflow_ray.sim.setups import paper_setup, setup_requests
from tokenflow_ray.workloads.generators import RequestSpec

SAMPLES_COLUMNS = ("decodes", "prefill_tokens", "decode_context", "prefill_pairs", "sampled", "step_s")
SERIES_COLUMNS = ("t_s", "running", "paused", "waiting", "tokens_so_far")
REQUEST_COLUMNS = ("index", "arrival_s", "prompt_len", "output_len", "rate")
# The shared files' keys, in their order: a file of this part has exactly these.
FILE_KEYS = ("policy", "device", "scale", "requests", "finished", "stopped_early", "load_s", "device_blocks",
             "host_blocks", "backend", "wall_s", "summary", "fit", "preempt_costs_s_mean", "swap_preemptions",
             "copy_bytes_s_median", "samples", "series", "tokens_generated_all", "probe_wall_s", "request_list",
             "request_list_columns", "engine", "samples_columns", "series_columns", "prompt_tokens")
PROMPT_TOKENS = ("[1 + (index + k) % 200 for k in range(prompt_len)]; SamplingParams(max_tokens=output_len, "
                 "ignore_eos=True); arrival_time = start + arrival_s")
SERIES_EVERY_S = 1.0
EXTRA_MARGIN_S = 2.0  # writing 400 records' summary and a ~200 KB file takes well under this


def scaled_requests(scale: float, count: int | None = None) -> list[RequestSpec]:
    """Setup (a)'s requests with prompt and output lengths x scale (rounded; at least 8 and 16 tokens)."""
    reqs = setup_requests(paper_setup("h200", "a"), seed=0)[:count]
    return [RequestSpec(r.index, r.arrival_s, max(8, round(r.prompt_len * scale)),
                        max(16, round(r.output_len * scale)), r.rate) for r in reqs]


def _setup(ctx: PartContext) -> dict:
    if ctx.dry:
        return {"scale": 1 / 128, "count": 16, "pool": (16, 64), "max_num_seqs": 16, "budget": 256, "tag": "dry",
                "model": "embedded model shape, random fp32 weights (dry run, CPU)"}
    return {"scale": 1 / 8, "count": None, "pool": (1734, 6936), "max_num_seqs": 256, "budget": 8192,
            "tag": "eighth", "model": "Llama-3-8B shape, random bf16 weights"}


def engine_config(ctx: PartContext, num_requests: int) -> EngineConfig:
    setup = _setup(ctx)
    device_blocks, host_blocks = setup["pool"]
    return EngineConfig(
        model=model_config(ctx), cache=CacheConfig(block_size=16, num_device_blocks=device_blocks,
                                                   num_host_blocks=host_blocks),
        scheduler=SchedulerConfig(max_num_seqs=setup["max_num_seqs"], max_num_batched_tokens=setup["budget"],
                                  policy=ctx.task), record_history=num_requests + 8)


def file_name(ctx: PartContext) -> str:
    return f"setup_a_{_setup(ctx)['tag']}_{ctx.task}.json"


@dataclass
class _Run:
    """What a serving run collects as it goes."""

    load_s: float
    start: float  # the burst's start on the engine's clock
    steps: Drive = field(default_factory=Drive)
    series: list[list] = field(default_factory=list)  # once a second: t, running, paused, waiting, tokens so far
    copies: list[float] = field(default_factory=list)  # bytes/s of each step's copy job
    tokens: int = 0


def run(ctx: PartContext) -> None:
    policy = ctx.task
    if policy is None:
        raise ValueError("serving: the task is the policy (fcfs, tokenflow or andes)")
    setup = _setup(ctx)
    ctx.device()  # a clear error without CUDA, before the load
    requests = scaled_requests(setup["scale"], setup["count"])
    t = time.perf_counter()
    engine = build_engine(engine_config(ctx, len(requests)))
    ctx.save("load_s", time.perf_counter() - t)
    engine.generate([[1] * 8], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up, not recorded
    engine.finished_records.clear()
    run = _Run(load_s=ctx.result["load_s"], start=engine.clock.now())
    for r in requests:
        engine.add_request(prompt_ids(r.index, r.prompt_len), SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                           stream_id=f"req-{r.index}", arrival_time=run.start + r.arrival_s, rate=r.rate)

    def on_step(step, outputs) -> None:
        run.tokens += sum(len(o.token_ids) for o in outputs)
        if step.copy_bytes and step.copy_s > 0:
            run.copies.append(step.copy_bytes / step.copy_s)
        now = engine.clock.now() - run.start
        if not run.series or now >= run.series[-1][0] + SERIES_EVERY_S:
            st = engine.stats()
            run.series.append([round(now, 2), st.num_running, st.num_preempted, st.num_waiting, run.tokens])
            ctx.save("progress", {"t_s": round(now, 2), "tokens": run.tokens, "steps": len(run.steps.steps)})

    try:
        drive(engine, deadline=ctx.deadline - EXTRA_MARGIN_S, on_step=on_step, into=run.steps)
    except Exception:  # the steps so far still make a file (stopped early); the error is the part's
        run.steps.stopped_early = True
        write_json_atomic(ctx.out_dir / file_name(ctx), _file(ctx, engine, setup, requests, run))
        ctx.save("file", file_name(ctx))
        raise
    out = _file(ctx, engine, setup, requests, run)
    write_json_atomic(ctx.out_dir / file_name(ctx), out)
    slow = slow_step_share(out["samples"], out["wall_s"]) if out["samples"] else None
    ctx.save("file", file_name(ctx))
    ctx.save("run", {k: out[k] for k in ("policy", "finished", "requests", "stopped_early", "wall_s", "load_s",
                                         "backend", "swap_preemptions", "copy_bytes_s_median")})
    ctx.save("summary", out["summary"])
    ctx.save("slow_steps", slow)
    s = out["summary"]
    ctx.save("headline", f"{policy}: {out['finished']}/{out['requests']} finished"
             + (" (stopped early)" if out["stopped_early"] else "") + f" in {out['wall_s']:.0f} s; slow-step "
             f"share {_pct(slow and slow['share'])} (>60 ms {_pct(slow and slow['over_60ms_share'])}); TTFT p99 "
             f"{_num(s['ttft_p99_s'])} s, raw {_num(s['raw_tput'])} tok/s, effective {_num(s['effective_tput'])} tok/s")


def _file(ctx: PartContext, engine: LLMEngine, setup: dict, requests: list[RequestSpec], run: _Run) -> dict:
    """The run in the shared files' format (FILE_KEYS, in order)."""
    sched = engine.scheduler
    live = [s.record for s in sched.streams.values()]
    records = list(engine.finished_records) + live
    for r in records:  # times from the burst's start, as the baseline files (and the simulator) count them
        r.arrival_s -= run.start
        r.token_times[:] = [x - run.start for x in r.token_times]
    summary = summarize(records, bytes_to_host=sched.bytes_to_host, bytes_from_host=sched.bytes_from_host)
    costs = sched.preempt_costs_s
    cc, sc = engine.config.cache, engine.config.scheduler
    return {
        "policy": ctx.task, "device": engine.runner.device.type, "scale": setup["scale"], "requests": len(requests),
        "finished": sum(r.finished for r in records), "stopped_early": run.steps.stopped_early, "load_s": run.load_s,
        "device_blocks": cc.num_device_blocks, "host_blocks": cc.num_host_blocks,
        "backend": engine.runner.backend.name, "wall_s": run.steps.wall_s, "summary": summary.to_dict(),
        "fit": asdict(sched.cost.fit), "preempt_costs_s_mean": statistics.mean(costs) if costs else None,
        "swap_preemptions": len(costs), "copy_bytes_s_median": statistics.median(run.copies) if run.copies else None,
        "samples": [s.sample_row() for s in run.steps.steps], "series": run.series, "tokens_generated_all": run.tokens,
        "probe_wall_s": time.monotonic() - ctx.started,
        "request_list": [[r.index, r.arrival_s, r.prompt_len, r.output_len, r.rate] for r in requests],
        "request_list_columns": list(REQUEST_COLUMNS),
        "engine": {"block_size": cc.block_size, "num_device_blocks": cc.num_device_blocks,
                   "num_host_blocks": cc.num_host_blocks, "max_num_seqs": sc.max_num_seqs,
                   "max_num_batched_tokens": sc.max_num_batched_tokens, "policy": sc.policy,
                   "policy_config": "defaults of TokenFlowConfig / AndesConfig at commit "
                                    f"{os.environ.get(COMMIT_ENV) or 'unknown'}",
                   "model": setup["model"], "dtype": str(engine.runner.dtype).removeprefix("torch."),
                   "attention": engine.runner.backend.name, "kv_bytes_per_token": engine.runner.info.kv_bytes_per_token,
                   "write_through": cc.write_through, "overlap_copies": cc.overlap_copies},
        "samples_columns": list(SAMPLES_COLUMNS), "series_columns": list(SERIES_COLUMNS),
        "prompt_tokens": PROMPT_TOKENS,
    }


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x) -> str:
    return "-" if x is None else f"{x:.1f}"
