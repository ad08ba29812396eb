"""Warm-up steps run once at start on CUDA, so that the first burst does not pay for kernel compilation and
selection (on the H200 the first step, a 7,978-token prefill, took 4.09 s against ~0.3 s later in the run).

They are ordinary plans through the runner's whole path (persistent batch, staged inputs, attention, sampling) for
warm-up streams whose every block is the pool's scratch block, which no stream owns: the pool's real blocks are
never written. In order: a prefill at the full token budget (the largest chunk), a mixed step with a short chunk
(one varlen launch), a mixed step with a long chunk (a decode launch beside the large-tile prefill launch), then,
when decodes are not captured in graphs, a decode-only step at each graph-ladder size (each split-KV variant), and
a last plan that finishes every warm-up stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenflow_ray.engine.plan import ScheduledChunk, StepPlan

_PREFIX = "__warmup"


def warmup_plans(token_budget: int, max_tokens_per_seq: int, block_size: int, scratch_block: int,
                 decode_sizes: Sequence[int] = ()) -> list[StepPlan]:
    """token_budget: the most tokens a step takes; max_tokens_per_seq: what a table row holds (blocks x size)."""
    big = max(1, min(token_budget, max_tokens_per_seq))
    step = iter(range(-1, -10_000, -1))  # warm-up plans' ids, apart from the engine's
    plans: list[StepPlan] = []
    held: dict[str, int] = {}  # stream -> blocks its table holds

    def chunk(sid: str, n: int, start: int, sample: bool = True) -> ScheduledChunk:
        have = held.get(sid, 0)
        need = max(have, -(-(start + n) // block_size))
        held[sid] = need
        return ScheduledChunk(sid, (0,) * n, start, (scratch_block,) * (need - have), have, sample)

    w0 = f"{_PREFIX}_0"
    plans.append(StepPlan(next(step), prefills=(chunk(w0, big, 0),)))
    if big >= 3:
        short = min(2, big - 1)
        plans.append(StepPlan(next(step), decodes=(chunk(w0, 1, big - 1),),
                              prefills=(chunk(f"{_PREFIX}_1", short, 0),)))
        plans.append(StepPlan(next(step), decodes=(chunk(w0, 1, big - 1),),
                              prefills=(chunk(f"{_PREFIX}_2", big - 1, 0),)))
    for d in decode_sizes:
        plans.append(StepPlan(next(step), decodes=tuple(chunk(f"{_PREFIX}_d{i}", 1, 0) for i in range(d))))
        # (each decode-only step's streams are fresh tables of one block, so sizes need not grow in order)
        plans.append(StepPlan(next(step), finished=tuple(f"{_PREFIX}_d{i}" for i in range(d))))
        for i in range(d):
            held.pop(f"{_PREFIX}_d{i}")
    plans.append(StepPlan(next(step), finished=tuple(held)))
    return plans
