"""Live estimates the scheduler plans with: step time, prefill time per token, copy bandwidth, capacity.

Exponential moving averages over measured step results, so decisions adapt to the machine and to I/O contention
(the paper's queue-aware t_IO): a busy copy queue makes reloads look slower and recompute wins.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Ema:
    value: float
    alpha: float = 0.2
    samples: int = 0

    def update(self, x: float) -> None:
        self.value = x if self.samples == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.samples += 1


class CostModel:
    def __init__(self, block_bytes: int, step_s: float = 0.02, prefill_s_per_token: float = 5e-4,
                 copy_bytes_per_s: float = 2e9) -> None:
        self.block_bytes = block_bytes  # one block's KV, all layers, K and V
        self._step = _Ema(step_s)
        self._decode_step = _Ema(step_s)
        self._prefill = _Ema(prefill_s_per_token)
        self._copy = _Ema(copy_bytes_per_s)
        self._decode_batch = _Ema(1.0)  # batch size the decode step time was measured at
        self.queued_copy_bytes = 0  # copies planned but not yet known complete (0 after each step: joined)

    # ---- observations -----------------------------------------------------------------------------------------
    def observe_step(self, compute_s: float, num_decodes: int, num_prefill_tokens: int, copy_s: float,
                     copy_bytes: int) -> None:
        if compute_s > 0:
            self._step.update(compute_s)
            if num_prefill_tokens == 0 and num_decodes:
                self._decode_step.update(compute_s)
                self._decode_batch.update(num_decodes)
            elif num_prefill_tokens >= 16:  # short chunks are dominated by fixed per-step cost
                self._prefill.update(compute_s / (num_prefill_tokens + num_decodes))
        if copy_bytes > 0 and copy_s > 0:
            self._copy.update(copy_bytes / copy_s)
        self.queued_copy_bytes = 0

    # ---- estimates --------------------------------------------------------------------------------------------
    @property
    def step_s(self) -> float:
        return self._step.value

    @property
    def copy_bytes_per_s(self) -> float:
        return self._copy.value

    def write_budget_bytes(self, fraction: float) -> int:
        """Write-through bytes that finish within the next step's estimated compute time."""
        return int(fraction * self.step_s * self.copy_bytes_per_s)

    def t_copy(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / self.copy_bytes_per_s

    def t_io(self, load_blocks: int, evict_blocks: int = 0) -> float:
        """Queue-aware reload time: what is queued ahead, the eviction still owed, then the load itself."""
        return (self.queued_copy_bytes / self.copy_bytes_per_s) + self.t_copy(evict_blocks) + self.t_copy(load_blocks)

    def t_recompute(self, num_tokens: int) -> float:
        return num_tokens * self._prefill.value

    def realized_decode_tok_s(self) -> float:
        """Decode tokens/s at the batch sizes actually being run (memory and arrivals limit them)."""
        return max(self._decode_batch.value, 1.0) / max(self._decode_step.value, 1e-6)

    def decode_capacity_tok_s(self, max_batch: float) -> float:
        """Γ: tokens/s with max_batch streams decoding. Decode is bound by streaming the weights, so step time
        is taken as the measured decode step time, growing only with the part of the batch beyond what was seen."""
        seen = max(self._decode_batch.value, 1.0)
        per_step = self._decode_step.value * max(1.0, max_batch / seen) ** 0.5
        return max_batch / max(per_step, 1e-6)
