"""What one forward takes (StepInputs), and the host array -> device tensor step both input builders share: the
persistent batch (step_state.py) and the Triton backend's varlen form (varlen_inputs.py)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from tokenflow_ray.layers.attention import AttentionMetadata


def host_tensor(values: array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of an array's values on `device`. On the CPU it shares the array's memory (and keeps the array
    alive): a few µs, where torch.tensor over a list of 128 ints takes about 25 µs, once or twice every step.
    Elsewhere through pinned memory, without blocking the host (the caching host allocator keeps the pinned block
    until the copy has landed); the Triton path stages a whole step in one copy instead (step_staging.py)."""
    t = torch.frombuffer(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


@dataclass
class StepInputs:
    """Everything one forward needs, on the runner's device."""

    input_ids: torch.Tensor  # [T] long (T: the step's tokens, or its graph bucket when padded)
    positions: torch.Tensor  # [T] long
    meta: AttentionMetadata
    sample_rows: list[int]  # rows of the flat batch whose next token is sampled
    sample_ids: list[str]  # their streams
    # The varlen (Triton) form: the sampled rows on the device (None: rows 0..len(sample_ids)-1, no gather), and
    # their streams' table rows, where the sampled tokens are kept on the device for PENDING inputs (staged only).
    sample_index: torch.Tensor | None = None
    sample_table_rows: torch.Tensor | None = None
