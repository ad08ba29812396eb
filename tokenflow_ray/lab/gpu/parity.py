"""Part `parity`: the embedded model through `LLMEngine.generate` against HF `generate`, greedy, on the device:
fp32 must be token-identical (`../shared/data/h200/cuda_parity.json`: 8/8 with SDPA); bf16 is recorded as
agreement (its rounding moves the first difference to some token, which is expected). The fp32 run is on the
engine's default backend and, when that is not SDPA, on SDPA too.
"""

from __future__ import annotations

import random
import time

import torch

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.lab.gpu.context import PartContext
from tokenflow_ray.lab.gpu.steps import embedded_config
from tokenflow_ray.runner.factory import build_engine

PAD_TOKEN = 258  # the embedded tokenizer's pad


def _sizes(ctx: PartContext) -> tuple[int, int]:
    """(prompts, new tokens): the H200 run's 8 x 48; fewer in quick and dry runs."""
    return (2, 8) if ctx.dry else (4, 24) if ctx.quick else (8, 48)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 60))] for _ in range(n)]


@torch.inference_mode()
def hf_reference(device: torch.device, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF `generate`, fp32, one prompt at a time (no padding in the reference)."""
    from transformers import AutoModelForCausalLM

    from tokenflow_ray.models.embedded import embedded_model_dir

    hf = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).to(device).eval()
    refs = []
    for p in batch:
        x = torch.tensor([p], device=device)
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_TOKEN)
        refs.append(out[0, len(p):].tolist())
    return refs


def first_differences(ours: list[list[int]], refs: list[list[int]]) -> list[int | None]:
    """Per prompt, the first token index where the two differ (None: identical)."""
    out = []
    for a, b in zip(ours, refs):
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        out.append(diff if diff is not None or len(a) == len(b) else min(len(a), len(b)))
    return out


def engine_config(ctx: PartContext, dtype: str, backend: str) -> EngineConfig:
    overrides = {} if ctx.dry else {"attention_backend": backend}  # a dry run stays on SDPA
    return EngineConfig(model=embedded_config(ctx, dtype, **overrides),
                        cache=CacheConfig(block_size=16, num_device_blocks=256),
                        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512))


def run(ctx: PartContext) -> None:
    device = ctx.device()
    n, new_tokens = _sizes(ctx)
    batch = prompts(n)
    ctx.save("device", device.type)
    refs = hf_reference(device, batch, new_tokens)
    runs = [("float32", "float32", "auto"), ("float32_sdpa", "float32", "sdpa")]
    if not ctx.quick:
        runs.append(("bfloat16", "bfloat16", "auto"))
    default_backend = None
    for key, dtype, backend in runs:
        if key == "float32_sdpa" and default_backend == "sdpa":
            continue  # the default already was SDPA
        engine = build_engine(engine_config(ctx, dtype, backend))
        t = time.perf_counter()
        out = engine.generate(batch, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        s = time.perf_counter() - t
        diffs = first_differences([list(r.token_ids) for r in out], refs)
        default_backend = default_backend or engine.runner.backend.name
        ctx.save(key, {"identical": sum(d is None for d in diffs), "of": len(diffs), "first_diff": diffs,
                       "backend": engine.runner.backend.name, "s": s})
        del engine
    f32 = ctx.result["float32"]
    ctx.save("headline", f"fp32 {f32['identical']}/{f32['of']} token-identical to HF ({f32['backend']})"
             + "".join(f"; {k} {ctx.result[k]['identical']}/{ctx.result[k]['of']}"
                       for k in ("float32_sdpa", "bfloat16") if k in ctx.result))
