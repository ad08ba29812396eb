"""NullRunner: a device that does nothing, at once, for measuring the engine's own host work per step.

Every sampling chunk gets a token back at once, no KV is stored or read (FakeRunner hashes each stream's whole
context, O(L²) per stream, which would swamp the engine's own time), and copies are acknowledged done. So
that the cost model plans as it would in serving, a step reports `compute_s` as its compute time (a GPU's step)
and the copies it was asked for at `copy_bytes_per_s`; those are figures handed back, not time spent.
"""

from __future__ import annotations

import math

from tokenflow_ray.engine.plan import StepPlan, StepResult
from tokenflow_ray.engine.runner_api import ModelInfo


class NullRunner:
    def __init__(self, info: ModelInfo, block_size: int, compute_s: float = 0.02,
                 copy_bytes_per_s: float = 27e9, token_id: int = 0) -> None:
        if not 0 <= token_id < info.vocab_size or token_id in info.eos_token_ids:
            raise ValueError(f"token_id: must be a non-eos id in [0, {info.vocab_size})")
        for name, value in (("compute_s", compute_s), ("copy_bytes_per_s", copy_bytes_per_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size!r}")
        self.info = info
        self.compute_s = compute_s
        self.block_bytes = info.kv_bytes_per_token * block_size
        self.block_s = self.block_bytes / copy_bytes_per_s  # one block's copy, as reported
        self.token_id = token_id
        self.steps = 0

    def execute(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        token = self.token_id
        sampled = {c.stream_id: token for c in plan.decodes if c.sample}
        sampled.update((c.stream_id, token) for c in plan.prefills if c.sample)
        copies = len(plan.write_through) + len(plan.swap_out) + len(plan.swap_in)
        swap_out_s: dict[str, float] = {}
        for i, c in enumerate(plan.swap_out, 1):  # tails one after another, as the copy job runs them
            swap_out_s[c.stream_id] = i * self.block_s
        return StepResult(step_id=plan.step_id, sampled=sampled,
                          compute_s=0.0 if plan.is_empty else self.compute_s, copy_s=copies * self.block_s,
                          copy_bytes=copies * self.block_bytes, swap_out_s=swap_out_s)

    # ---- migration: nothing is stored, so only the block count travels ----------------------------------
    def export_kv(self, host_blocks: list[int]) -> int:
        return len(host_blocks)

    def import_kv(self, host_blocks: list[int], data: int) -> None:
        if data != len(host_blocks):
            raise ValueError(f"KV blocks: {data} exported, {len(host_blocks)} host blocks given")
