"""One host->device copy a step: the step's inputs, packed on the host into a pinned buffer, land in one device
buffer with one non-blocking copy; the step reads views of it (vLLM's persistent-batch inputs, Model Runner V2's
packed diffs). Pageable `.to(device)` copies block the host and cost a copy call each.

Two pinned host buffers alternate: the host fills one while the copy out of the other may still be queued behind
the GPU's work; before a buffer is refilled its last copy must have landed (an event; it has, unless the GPU is two
steps behind, and then waiting is the right throttle). The device buffer never moves: captured CUDA graphs read
views of it at fixed offsets.
"""

from __future__ import annotations

from array import array

import numpy as np
import torch


class StagingBuffer:
    def __init__(self, capacity: int, device: torch.device, pinned: bool | None = None, depth: int = 2) -> None:
        """capacity: int64 values a step may stage at most (the caller's bound; exceeding it is an error)."""
        if capacity <= 0 or depth <= 0:
            raise ValueError("StagingBuffer: capacity and depth must be positive")
        pinned = device.type == "cuda" if pinned is None else pinned
        self.capacity = capacity
        self.device_buffer = torch.zeros(capacity, dtype=torch.long, device=device)
        self._host = [torch.zeros(capacity, dtype=torch.long, pin_memory=pinned) for _ in range(depth)]
        self._host_np = [h.numpy() for h in self._host]
        cuda = device.type == "cuda"
        self._landed = [torch.cuda.Event() if cuda else None for _ in range(depth)]
        self._recorded = [False] * depth
        self._next = 0
        self.copies = 0  # host->device copies made (tests count them: one a step)

    def stage(self, values: array) -> torch.Tensor:
        """`values` (an int64 array) on the device: device_buffer[:len(values)], after one copy."""
        n = len(values)
        if n > self.capacity:
            raise RuntimeError(f"StagingBuffer: a step staged {n} values, more than its bound {self.capacity}")
        i = self._next
        self._next = (i + 1) % len(self._host)
        if self._recorded[i]:
            self._landed[i].synchronize()  # that buffer's previous copy has landed (normally long since)
        if n:
            self._host_np[i][:n] = np.frombuffer(values, dtype=np.int64)
        dst = self.device_buffer[:n]
        dst.copy_(self._host[i][:n], non_blocking=True)
        if self._landed[i] is not None:
            self._landed[i].record()
            self._recorded[i] = True
        self.copies += 1
        return dst
