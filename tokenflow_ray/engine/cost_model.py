"""Live estimates the scheduler plans with: step time, capacity, copy bandwidth, reload and recompute times.

Measured step results feed a batch-size-aware step-time model (step_time_model.py), so the decode capacity Γ is
predicted for the batch the device can hold, not read off the batch a policy chose to run, and the recompute time
uses the prefill cost alone. A second model sees only decode steps, each at most `DECODE_CLIP` x its prediction
(`decode_step_capacity_tok_s`): a decode step's time does not hang on the prefill steps' costs (on the H200 engine a
prefill step also pays ~61 ms per new prompt length, which the mixed fit spreads over its other terms: its Γ swung
from 0.5k to 3k tok/s and back in the first seconds of the run), and a one-off weighs as one slow step. Copy bandwidth is an exponential moving average over measured copies. Reload time is
queue-aware (paper §4.2.3): the copies queued ahead of a load come from the KV manager's live queue at decision
time, so a busy copy queue makes reloads look slower and recompute wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenflow_ray.engine.step_time_model import StepTimeFit, StepTimeModel


@dataclass
class _Ema:
    value: float
    alpha: float = 0.2
    samples: int = 0

    def update(self, x: float) -> None:
        self.value = x if self.samples == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.samples += 1


DECODE_CLIP = 2.0  # a decode step teaches the capacity model at most this many times its prediction
MIN_DECODE_STEPS = 8  # decode steps seen before their own model prices Γ (the mixed model until then)


class CostModel:
    def __init__(self, block_bytes: int, step_s: float = 0.02, prefill_s_per_token: float = 5e-4,
                 copy_bytes_per_s: float = 2e9, prefill_chunk_tokens: int = 512) -> None:
        if prefill_chunk_tokens <= 0:
            raise ValueError(f"prefill_chunk_tokens: must be > 0, got {prefill_chunk_tokens!r}")
        self.block_bytes = block_bytes  # one block's KV, all layers, K and V
        self.prefill_chunk_tokens = prefill_chunk_tokens  # the step token budget: a recompute runs in such chunks
        self.steps = StepTimeModel(step_s, prefill_s_per_token)
        self.decode_steps = StepTimeModel(step_s, prefill_s_per_token, clip=DECODE_CLIP)
        self._step = _Ema(step_s)
        self._decode_step = _Ema(step_s)
        self._copy = _Ema(copy_bytes_per_s)
        self._decode_batch = _Ema(1.0)  # batch size the decode step time was measured at

    # ---- observations -----------------------------------------------------------------------------------------
    def observe_step(self, compute_s: float, num_decodes: int, num_prefill_tokens: int, copy_s: float,
                     copy_bytes: int, step_s: float = 0.0) -> None:
        """`compute_s`: the model step (copies run beside it, so it sizes their budget). `step_s`: the whole step
        on the engine's clock, planning included; throughput estimates learn from the larger of the two, since
        that is what the engine delivers a step (0 on a virtual clock, where the runner's time is the step's)."""
        if compute_s > 0:
            delivered = max(compute_s, step_s)
            self._step.update(compute_s)
            self.steps.observe(num_decodes, num_prefill_tokens, delivered)
            if num_prefill_tokens == 0 and num_decodes:
                self._decode_step.update(delivered)
                self._decode_batch.update(num_decodes)
                self.decode_steps.observe(num_decodes, 0, delivered)
        if copy_bytes > 0 and copy_s > 0:
            self._copy.update(copy_bytes / copy_s)

    # ---- estimates --------------------------------------------------------------------------------------------
    @property
    def step_s(self) -> float:
        return self._step.value

    @property
    def fit(self) -> StepTimeFit:
        return self.steps.fit

    @property
    def copy_bytes_per_s(self) -> float:
        return self._copy.value

    def copy_budget_blocks(self, fraction: float = 1.0) -> int:
        """Blocks a copy job moves within `fraction` of the step's estimated compute time (at least one)."""
        return max(1, int(fraction * self.step_s * self.copy_bytes_per_s) // self.block_bytes)

    def t_copy(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / self.copy_bytes_per_s

    def t_io(self, load_blocks: int, evict_blocks: int = 0, queued_blocks: int = 0) -> float:
        """Queue-aware reload time: t_evict + t_load_queueing + t_load (paper §4.2.3). `evict_blocks` are tails
        being evicted this step, which the copy job runs first; `queued_blocks` are loads already waiting. Loads
        move at most `copy_budget_blocks` a step, so a long queue costs whole steps, not just its bytes."""
        ahead = evict_blocks + queued_blocks
        per_step = self.copy_budget_blocks()
        steps_waiting = ahead // per_step  # whole steps whose copy budget the queue ahead fills
        return steps_waiting * self.step_s + self.t_copy(ahead % per_step + load_blocks)

    def t_recompute(self, num_tokens: int) -> float:
        """Prefill-only: the step's fixed cost once per chunk plus the prefill cost of each token."""
        fit = self.fit
        chunks = math.ceil(num_tokens / self.prefill_chunk_tokens)
        return chunks * fit.fixed_s + num_tokens * fit.prefill_s

    def realized_decode_tok_s(self) -> float:
        """Decode tokens/s at the batch sizes actually being run (memory and arrivals limit them)."""
        return max(self._decode_batch.value, 1.0) / max(self._decode_step.value, 1e-6)

    def decode_capacity_tok_s(self, batch: float) -> float:
        """Γ: decode tokens/s with `batch` streams decoding every step, from the step-time model."""
        batch = max(batch, 1.0)
        return batch / max(self.fit.predict(batch), 1e-6)

    def decode_step_capacity_tok_s(self, batch: float) -> float:
        """Γ from the decode steps' own model (module docstring); the mixed model's until it has seen
        MIN_DECODE_STEPS of them."""
        fit = self.decode_steps.fit  # solved here, by its reader: the steps it observes are clipped against it
        if self.decode_steps.samples < MIN_DECODE_STEPS:
            return self.decode_capacity_tok_s(batch)
        batch = max(batch, 1.0)
        return batch / max(fit.predict(batch), 1e-6)
