"""The engine the bench's model parts run, and a loop that runs it to the end (or a deadline) timing every step.

The 8B-shape model is the llama3-8b preset with dummy weights in bf16 on CUDA, as the H200 baseline
(`../shared/data/h200/README.md`). A dry run (CPU) uses the embedded model's config with dummy weights in fp32,
on SDPA and without the compiled CPU kernels (a dry run must not spend a minute building them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenflow_ray.engine.config import ModelConfig
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.outputs import StreamOutput
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.lab.gpu.context import PartContext
from tokenflow_ray.sim.cost import StepShape
from tokenflow_ray.workloads.prompts import distinct_prompt

DRY_RUN_MODEL = {"fused_cpu_ops": False, "cpu_prepack": False, "attention_backend": "sdpa", "num_threads": 1}


def model_config(ctx: PartContext, **overrides) -> ModelConfig:
    """The 8B-shape model (dry run: the embedded model's shape), dummy weights."""
    if ctx.dry:
        base = {"model": "embedded", "load_format": "dummy", "dtype": "float32", "device": "cpu", **DRY_RUN_MODEL}
    else:
        base = {"model": "llama3-8b", "load_format": "dummy", "dtype": "bfloat16", "device": "cuda"}
    return ModelConfig(**{**base, **overrides})


def embedded_config(ctx: PartContext, dtype: str, **overrides) -> ModelConfig:
    """The embedded model with its real weights (parity), on the bench's device."""
    base = {"model": "embedded", "dtype": dtype, "device": "cpu" if ctx.dry else "cuda",
            **(DRY_RUN_MODEL if ctx.dry else {})}
    return ModelConfig(**{**base, **overrides})


def prompt_ids(index: int, length: int) -> list[int]:
    """The H200 runs' prompts: meaningless ids, valid in every vocabulary here (< 256), no two requests sharing a
    block (prefix caching finds nothing to reuse)."""
    return distinct_prompt(index, length)


@dataclass(frozen=True)
class TimedStep:
    shape: StepShape
    s: float  # the whole step on the wall clock: planning, the runner, the update
    model_s: float  # the runner's model step (StepResult.compute_s)
    copy_s: float
    copy_bytes: int

    def grid_row(self) -> dict:
        """step_grid.json's step format."""
        sh = self.shape
        return {"decodes": sh.decodes, "prefill_tokens": sh.prefill_tokens, "decode_context": sh.decode_context,
                "prefill_pairs": sh.prefill_pairs, "sampled": sh.sampled, "s": self.s, "model_s": self.model_s}

    def sample_row(self) -> list:
        """setup_a_eighth_*.json's `samples` row (samples_columns)."""
        sh = self.shape
        return [sh.decodes, sh.prefill_tokens, sh.decode_context, sh.prefill_pairs, sh.sampled, self.s]


@dataclass
class Drive:
    steps: list[TimedStep] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    stopped_early: bool = False
    wall_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


def drive(engine: LLMEngine, deadline: float | None = None,
          on_step: Callable[[TimedStep, list[StreamOutput]], None] | None = None, into: Drive | None = None) -> Drive:
    """Step until nothing is left (or time.monotonic() passes `deadline`: `stopped_early`) through
    `LLMEngine.step()`, as the engine serves (overlapped scheduling when its config has it: on CUDA by default),
    timing each step whole on the wall clock: from the end of the step before (or the start of this call when the
    engine was idle) to the end of this one, planning and the update included, which with overlapped scheduling
    is the interval between two steps' results. `into`: filled as it goes, so a caller keeps the steps so far when
    a step raises."""
    out = into if into is not None else Drive()
    start = time.monotonic()
    last_end: float | None = None
    while engine.has_unfinished():
        out.wall_s = time.monotonic() - start
        if deadline is not None and time.monotonic() >= deadline:
            out.stopped_early = True
            break
        t0 = engine.clock.now()
        before = engine.last_finished
        outputs = engine.step()
        finished = engine.last_finished
        if finished is before:  # nothing ran: every live stream paced, or arrivals still to come
            last_end = None
            if not outputs:
                time.sleep(0.001)
            continue
        end = engine.clock.now()
        plan, result = finished
        step = TimedStep(StepShape.of(plan), end - (t0 if last_end is None else last_end), result.compute_s,
                         result.copy_s, result.copy_bytes)
        last_end = end
        out.steps.append(step)
        for o in outputs:
            out.tokens.setdefault(o.stream_id, []).extend(o.token_ids)
        if on_step is not None:
            on_step(step, outputs)
    out.wall_s = time.monotonic() - start
    return out


def run_batch(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, deadline: float | None = None,
              first_index: int = 0) -> tuple[Drive, list[str]]:
    """`batch` unpaced streams of `prompt_len` prompt tokens and exactly `new_tokens` outputs, all at once."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(prompt_ids(first_index + i, prompt_len), params) for i in range(batch)]
    return drive(engine, deadline), ids


def decode_step_ms(steps: list[TimedStep], field_name: str = "s") -> float | None:
    """Median of the decode-only steps (no prefill tokens), in ms."""
    times = [getattr(s, field_name) for s in steps if s.shape.decodes and not s.shape.prefill_tokens]
    return statistics.median(times) * 1e3 if times else None


def prefill_tok_s(steps: list[TimedStep]) -> float | None:
    """Prefill tokens over the time of the steps that ran them."""
    pre = [s for s in steps if s.shape.prefill_tokens]
    t = sum(s.s for s in pre)
    return sum(s.shape.prefill_tokens for s in pre) / t if t > 0 else None


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
