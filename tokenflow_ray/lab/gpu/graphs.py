"""Part `graphs`: decode through CUDA graphs against eager, on the 8B shape (dummy weights, bf16): the same greedy
tokens, and each one's decode step time, at batches on the graph ladder (no padding rows: the same kernels at the
same shapes, so the tokens must be identical).

The switch is `ModelConfig.enforce_eager` (vLLM's name: True disables CUDA graphs). Without that field the part is
recorded unavailable. Whether graphs were in use is read from the runner (`graphs`), since the runner falls back to
eager when capture fails or the backend cannot be captured. One engine at a time (two 8B models would fit an H200,
but the second load would then wait on the first's memory).
"""

from __future__ import annotations

import dataclasses
import gc

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenflow_ray.lab.gpu.context import PartContext
from tokenflow_ray.lab.gpu.steps import decode_step_ms, model_config, run_batch
from tokenflow_ray.runner.factory import build_engine


def _sizes(ctx: PartContext) -> tuple[tuple[int, ...], int, int]:
    """(batches, prompt tokens, new tokens)"""
    return ((1, 2), 16, 8) if ctx.dry else ((1, 8, 32), 128, 48)


def engine_config(ctx: PartContext, eager: bool) -> EngineConfig:
    batches, prompt_len, new_tokens = _sizes(ctx)
    blocks = max(batches) * -(-(prompt_len + new_tokens) // 16) + 16
    return EngineConfig(
        model=model_config(ctx, enforce_eager=eager), cache=CacheConfig(block_size=16, num_device_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches))))


def run(ctx: PartContext) -> None:
    if "enforce_eager" not in {f.name for f in dataclasses.fields(ModelConfig)}:
        ctx.part_unavailable("ModelConfig has no enforce_eager field (the CUDA graphs change is not merged)")
        ctx.save("headline", "unavailable: no ModelConfig.enforce_eager")
        return
    batches, prompt_len, new_tokens = _sizes(ctx)
    ctx.save("setup", {"batches": list(batches), "prompt_len": prompt_len, "new_tokens": new_tokens})
    tokens: dict[bool, dict[int, list[list[int]]]] = {}
    for eager in (True, False):
        label = "eager" if eager else "graphs"
        engine = build_engine(engine_config(ctx, eager))
        info = {"graphs_active": getattr(engine.runner, "graphs", None) is not None,
                "backend": engine.runner.backend.name, "batches": {}}
        tokens[eager] = {}
        for b in batches:
            run, ids = run_batch(engine, b, prompt_len, new_tokens, ctx.deadline)
            tokens[eager][b] = [run.tokens.get(i, []) for i in ids]
            info["batches"][str(b)] = {"decode_step_ms_median": decode_step_ms(run.steps),
                                       "decode_model_ms_median": decode_step_ms(run.steps, "model_s"),
                                       "steps": len(run.steps), "stopped_early": run.stopped_early}
            ctx.save(label, info)
        del engine
        gc.collect()
        if not ctx.dry:
            import torch

            torch.cuda.empty_cache()
    compare = {}
    for b in batches:
        pairs = list(zip(tokens[False][b], tokens[True][b]))
        compare[str(b)] = {"identical": sum(a == e and len(a) == new_tokens for a, e in pairs), "of": b,
                           "first_diff": [next((i for i, (x, y) in enumerate(zip(a, e)) if x != y), None)
                                          for a, e in pairs]}
    ctx.save("graphs_vs_eager", compare)
    g, e = ctx.result["graphs"], ctx.result["eager"]
    ctx.save("headline", f"graphs active: {g['graphs_active']}; identical "
             + ", ".join(f"b{b} {c['identical']}/{c['of']}" for b, c in compare.items()) + "; decode ms graphs/eager "
             + ", ".join(f"b{b} {_ms(g['batches'][b])}/{_ms(e['batches'][b])}" for b in compare))


def _ms(batch: dict) -> str:
    ms = batch["decode_step_ms_median"]
    return "-" if ms is None else f"{ms:.1f}"
