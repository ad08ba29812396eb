"""Part `step_grid`: the Llama-3-8B-shape step grid of `../shared/data/h200/step_grid.json`, in its format (written
beside the main JSON as `step_grid.json`), plus the HBM roofline at batch 32, context 1024.

fcfs, unpaced, max_num_seqs 256, 8192 tokens a step, a 20,000-block pool, dummy bf16 weights; at each point B
streams of P prompt tokens and 64 output tokens on one engine, one point after another (the first point pays for
the first shapes, as in the baseline), every step timed whole. The roofline point: every weight but the
embedding and the decode steps' KV (median Σ context x KV bytes a token) read once a step at the measured device
copy rate (gpu_check's, as in gpu_check.json), over the median decode step (the engine's whole step, and the
model's alone).
"""

from __future__ import annotations

import statistics
import time

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.lab.gpu.context import PartContext, write_json_atomic
from tokenflow_ray.lab.gpu.steps import (
    decode_step_ms,
    device_name,
    model_config,
    prefill_tok_s,
    run_batch,
)
from tokenflow_ray.runner.factory import build_engine

GRID = ((1, 512), (16, 512), (64, 512), (128, 512), (256, 256), (256, 1024), (32, 2048))
QUICK_GRID = ((1, 512), (64, 512), (256, 256))
DRY_GRID = ((1, 16), (4, 32))
ROOFLINE = (32, 1024)
FILE = "step_grid.json"


def _setup(ctx: PartContext) -> dict:
    if ctx.dry:
        return {"grid": DRY_GRID, "roofline": (4, 32), "new_tokens": 8, "blocks": 256, "max_num_seqs": 8,
                "budget": 64}
    return {"grid": QUICK_GRID if ctx.quick else GRID, "roofline": ROOFLINE, "new_tokens": 64, "blocks": 20_000,
            "max_num_seqs": 256, "budget": 8192}


def engine_config(ctx: PartContext) -> EngineConfig:
    setup = _setup(ctx)
    return EngineConfig(model=model_config(ctx),
                        cache=CacheConfig(block_size=16, num_device_blocks=setup["blocks"], num_host_blocks=0),
                        scheduler=SchedulerConfig(max_num_seqs=setup["max_num_seqs"],
                                                  max_num_batched_tokens=setup["budget"], policy="fcfs"))


def _point(engine: LLMEngine, ctx: PartContext, batch: int, prompt: int, new_tokens: int) -> tuple[dict, list]:
    t = time.perf_counter()
    run, _ = run_batch(engine, batch, prompt, new_tokens, ctx.deadline)
    wall = time.perf_counter() - t
    ms = decode_step_ms(run.steps)
    point = {"batch": batch, "prompt": prompt, "wall_s": wall, "decode_step_ms_median": ms,
             "decode_tok_s": batch / ms * 1e3 if ms else None, "prefill_tok_s": prefill_tok_s(run.steps),
             "steps": [s.grid_row() for s in run.steps]}
    if run.stopped_early:
        point["stopped_early"] = True
    return point, run.steps


def roofline(engine: LLMEngine, steps: list, device) -> dict:
    """HBM bytes a decode step must read over the measured copy rate, against the measured decode step."""
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed"))
    decodes = [s for s in steps if s.shape.decodes and not s.shape.prefill_tokens]
    if not decodes:
        return {"of_roofline": None, "reason": "no decode-only step ran (the point was cut by the part's limit)"}
    kv_bytes = statistics.median(s.shape.decode_context for s in decodes) * engine.runner.info.kv_bytes_per_token
    out = {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "step_ms": decode_step_ms(steps),
           "model_ms": decode_step_ms(steps, "model_s")}
    from tokenflow_ray.runner.gpu_check import hbm_bandwidth

    cuda = device.type == "cuda"
    bw = hbm_bandwidth(device, mb=1024 if cuda else 64)  # dry run: the CPU's memory copy rate stands in
    roof_ms = (weight_bytes + kv_bytes) / bw * 1e3
    return {**out, "hbm_gb_s": bw / 1e9, "rate": "device copy" if cuda else "CPU memory copy (dry-run stand-in)",
            "roofline_ms": roof_ms, "of_roofline": roof_ms / out["step_ms"],
            "of_roofline_model": roof_ms / out["model_ms"]}


def run(ctx: PartContext) -> None:
    device = ctx.device()
    setup = _setup(ctx)
    t = time.perf_counter()
    engine = build_engine(engine_config(ctx))
    out = {"device": device.type, "load_s": time.perf_counter() - t, "backend": engine.runner.backend.name,
           "gpu": device_name(device), "mem_alloc_gb": _mem_gb(device), "runs": {}}
    headline = []
    for batch, prompt in setup["grid"]:
        if ctx.time_left() <= 0:
            out["stopped_early"] = True
            break
        point, _ = _point(engine, ctx, batch, prompt, setup["new_tokens"])
        out["runs"][f"b{batch}_p{prompt}"] = point
        out["probe_wall_s"] = time.perf_counter() - t
        write_json_atomic(ctx.out_dir / FILE, out)  # the shared format, as it grows
        ctx.save("points", {k: {f: v for f, v in p.items() if f != "steps"} for k, p in out["runs"].items()})
        headline.append(f"b{batch}@{prompt} {_fmt(point['decode_step_ms_median'])}")
    if ctx.time_left() > 0:
        point, steps = _point(engine, ctx, *setup["roofline"], setup["new_tokens"])
        roof = {**{f: v for f, v in point.items() if f != "steps"}, **roofline(engine, steps, device)}
        out["roofline"] = roof
        write_json_atomic(ctx.out_dir / FILE, out)
        ctx.save("roofline", roof)
        headline.append(f"of_roofline b{roof['batch']}@{roof['prompt']} {_fmt(roof['of_roofline'], '.2f')}")
    ctx.save("file", FILE)
    ctx.save("header", {k: v for k, v in out.items() if k not in ("runs", "roofline")})
    ctx.save("headline", "decode step ms: " + ", ".join(headline))


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _mem_gb(device) -> float | None:
    import torch

    return torch.cuda.memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
