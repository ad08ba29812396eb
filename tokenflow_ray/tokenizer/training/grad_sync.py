"""Gradient averaging over Train workers without DDP (scaling.grad_sync = "flat"), and rank 0's weights at start.

A gloo call costs ~1-2 ms on this box however small, so gradients go in one flat collective per model rather than
one per tensor or bucket. The collective is started asynchronously: the generator's gradients travel while the
discriminator computes its own, and the discriminator's while the generator's optimiser steps. With
`compress="bf16"` the wire carries bfloat16 (half the bytes; what torch's bf16_compress_hook does for DDP): values are
divided by the world size before the sum so it cannot overflow, and written back to the fp32 gradients.

As with DDP, a parameter unused on this rank contributes zeros, and one unused on every rank keeps no gradient (Adam
then skips it); a per-parameter "has a gradient" flag rides in the same collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

COMPRESSIONS = ("none", "bf16")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class PendingAverage:
    """An all-reduce in flight; `wait()` writes the averages into the parameters' .grad."""

    def __init__(self, params: list[torch.nn.Parameter], compress: str) -> None:
        self.params = params
        world = world_size()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        dtype = torch.bfloat16 if compress == "bf16" else grads[0].dtype
        used = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=grads[0].device)
        self.flat = torch.cat([g.reshape(-1).to(dtype) for g in grads] + [used])
        self.flat[:-len(params)] /= world  # before the sum: a bf16 sum of world-size-scaled values cannot overflow
        self.work = dist.all_reduce(self.flat, async_op=True)

    def wait(self) -> None:
        self.work.wait()
        n = len(self.params)
        used_anywhere = (self.flat[-n:] > 0).tolist()
        values = self.flat[:-n].split([p.numel() for p in self.params])
        for p, anywhere, avg in zip(self.params, used_anywhere, values):
            if p.grad is not None:
                p.grad.copy_(avg.view_as(p))
            elif anywhere:
                p.grad = avg.view_as(p).to(p.dtype).clone()


class _Done:
    def wait(self) -> None:
        return None


def start_average(params: list[torch.nn.Parameter], compress: str = "none") -> PendingAverage | _Done:
    """Start averaging these parameters' gradients over ranks; call `.wait()` before using them."""
    if compress not in COMPRESSIONS:
        raise ValueError(f"compress must be one of {COMPRESSIONS}, got {compress!r}")
    if world_size() == 1 or not params:
        return _Done()
    return PendingAverage(params, compress)


def average_grads(params: list[torch.nn.Parameter], compress: str = "none") -> None:
    """Average now (start and wait)."""
    start_average(params, compress).wait()


def broadcast_params(modules: list[torch.nn.Module]) -> None:
    """Rank 0's weights everywhere (what DDP does at wrap time), for the flat gradient sync."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for module in modules:
            for t in module.state_dict().values():
                dist.broadcast(t, src=0)
