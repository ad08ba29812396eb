"""Gradient averaging over Train workers without DDP (scaling.grad_sync = "flat"), and rank 0's weights at start.

A gloo call costs ~1-2 ms on this box however small, so gradients go in one flat collective per model rather than
one per tensor or bucket. The collective is started asynchronously: the generator's gradients travel while the
discriminator computes its own, and the discriminator's while the generator's optimiser steps. With
`compress="bf16"` the wire carries bfloat16 (half the bytes; what torch's bf16_compress_hook does for DDP): values are
divided by the world size before the sum so it cannot overflow, and written back to the fp32 gradients.

As with DDP, a parameter unused on this rank contributes zeros, and one unused on every rank keeps no gradient (Adam
then skips it); a per-parameter "has a gradient" flag rides in the same collective.

When every rank runs on one host (`SharedSlots`, scaling.shm_reduce), the gradients do not go through gloo at all:
each rank writes its flat (pre-divided) gradients into its own slot of a shared file mapping and bumps its message
counter beside it; every rank sums the slots itself in rank order, so all ranks hold bitwise the same average (for
2 ranks exactly what gloo's sum gives). Why: on the 2-core dev box any gloo collective between the 2 local workers
costs 5-8 ms a call, however small (the blocked rank's vCPU idles and waits to be woken), and an async one in
flight slows the compute it was meant to overlap (docs/tokenizer.md); writing and summing the slots takes well under
1 ms. Slots are double-buffered per message shape, so a rank can write the next step's gradients while a slower peer
still reads this step's.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

COMPRESSIONS = ("none", "bf16")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class SharedSlots:
    """Per-rank gradient slots in file mappings shared by every rank of the group (all on one host), and a
    per-rank message counter beside them: a rank writes its slot, then its counter; a reader waits (polling, so an
    idle vCPU never has to be woken) until every counter has reached the message, then sums the slots. Built
    collectively (every rank calls `create` at the same point); a region per message shape is made on first use,
    which every rank reaches in the same order, so that is collective too. x86-64 only: the protocol relies on its
    stores becoming visible in program order."""

    SPIN_TIMEOUT_S = 600.0  # a peer that never arrives (it died): fail the step rather than wait forever

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._regions: dict[tuple[int, torch.dtype], dict] = {}
        self._maps: list[mmap.mmap] = []

    @classmethod
    def create(cls, rank: int, world: int) -> SharedSlots | None:
        """The slots, or None on every rank when any rank cannot map rank 0's file (not one host) or the CPU is
        not x86-64."""
        slots = cls(rank, world)
        ok = 0.0
        if platform.machine().lower() in ("x86_64", "amd64"):
            try:
                slots._region(1, torch.float32)  # a probe region: proves every rank sees rank 0's file
                ok = 1.0
            except OSError:
                pass
        flag = torch.tensor([ok])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() < 1.0:
            slots.close()
            return None
        return slots

    def _map(self, nbytes: int) -> mmap.mmap:
        names = [None]
        if self.rank == 0:
            fd, path = tempfile.mkstemp(prefix="tokenflow-grads-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            os.ftruncate(fd, nbytes)
            os.close(fd)
            names = [path]
        dist.broadcast_object_list(names, src=0)
        mapping, error = None, None
        try:
            with open(names[0], "r+b") as f:
                mapping = mmap.mmap(f.fileno(), nbytes)
        except OSError as exc:
            error = exc
        dist.barrier()  # every rank has mapped it (or failed): the name can go, the mappings stay
        if self.rank == 0:
            os.unlink(names[0])
        if error is not None:
            raise error
        self._maps.append(mapping)
        return mapping

    def _region(self, numel: int, dtype: torch.dtype) -> dict:
        key = (numel, dtype)
        if key not in self._regions:
            count = 2 * self.world * numel
            data = self._map(count * torch.empty((), dtype=dtype).element_size())
            counters = self._map(8 * self.world)
            self._regions[key] = {"slots": torch.frombuffer(data, dtype=dtype, count=count).view(2, self.world, numel),
                                  "counters": np.frombuffer(counters, dtype=np.int64), "sent": 0, "in_flight": False}
        return self._regions[key]

    def begin(self, numel: int, dtype: torch.dtype) -> dict | None:
        """The region for a new message of this shape, or None while one of that shape is still in flight (two
        buffers are safe only one message deep; every rank makes the same calls, so all fall back together)."""
        region = self._region(numel, dtype)
        if region["in_flight"]:
            return None
        region["in_flight"] = True
        region["sent"] += 1
        return region

    def publish(self, region: dict) -> None:
        region["counters"][self.rank] = region["sent"]  # after the slot's writes: x86 keeps them in order

    def gather(self, region: dict) -> torch.Tensor:
        """Wait for every rank's slot of this message; the world x numel slots."""
        sent, counters = region["sent"], region["counters"]
        deadline = None
        spins = 0
        while int(counters.min()) < sent:
            spins += 1
            if spins % 64 == 0:
                os.sched_yield()  # let a Ray process on this core run instead of spinning it out
                if deadline is None:
                    deadline = time.monotonic() + self.SPIN_TIMEOUT_S
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"gradient slots: a peer never reached message {sent} "
                                       f"(counters {counters.tolist()})")
        region["in_flight"] = False
        return region["slots"][(sent - 1) % 2]

    def buffer_of(self, region: dict) -> torch.Tensor:
        return region["slots"][(region["sent"] - 1) % 2]

    def close(self) -> None:
        self._regions.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a tensor still views it; the mapping goes when that tensor does
                pass
        self._maps.clear()


class PendingAverage:
    """An average in flight; `wait()` writes the averages into the parameters' .grad."""

    def __init__(self, params: list[torch.nn.Parameter], compress: str, slots: SharedSlots | None = None) -> None:
        self.params = params
        world = world_size()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        dtype = torch.bfloat16 if compress == "bf16" else grads[0].dtype
        used = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=grads[0].device)
        n = len(params)
        self.slots = slots
        self.region = None
        if slots is not None and grads[0].device.type == "cpu":
            self.region = slots.begin(sum(g.numel() for g in grads) + n, dtype)
        if self.region is not None:
            mine = slots.buffer_of(self.region)[slots.rank]
            torch.cat([g.reshape(-1).to(dtype) for g in grads] + [used], out=mine)
            mine[:-n] /= world
            slots.publish(self.region)
            return
        self.flat = torch.cat([g.reshape(-1).to(dtype) for g in grads] + [used])
        self.flat[:-n] /= world  # before the sum: a bf16 sum of world-size-scaled values cannot overflow
        self.work = dist.all_reduce(self.flat, async_op=True)

    def wait(self) -> None:
        n = len(self.params)
        if self.region is not None:  # sum the slots in rank order: the same bits on every rank
            buffer = self.slots.gather(self.region)
            self.flat = buffer[0].clone()
            for r in range(1, buffer.shape[0]):
                self.flat += buffer[r]
        else:
            self.work.wait()
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


def start_average(params: list[torch.nn.Parameter], compress: str = "none",
                  slots: SharedSlots | None = None) -> PendingAverage | _Done:
    """Start averaging these parameters' gradients over ranks; call `.wait()` before using them. With `slots`
    (every rank on one host) the values go through shared memory and gloo carries only the flags."""
    if compress not in COMPRESSIONS:
        raise ValueError(f"compress must be one of {COMPRESSIONS}, got {compress!r}")
    if world_size() == 1 or not params:
        return _Done()
    return PendingAverage(params, compress, slots)


def average_grads(params: list[torch.nn.Parameter], compress: str = "none", slots: SharedSlots | None = None) -> None:
    """Average now (start and wait)."""
    start_average(params, compress, slots).wait()


def broadcast_params(modules: list[torch.nn.Module]) -> None:
    """Rank 0's weights everywhere (what DDP does at wrap time), for the flat gradient sync."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for module in modules:
            for t in module.state_dict().values():
                dist.broadcast(t, src=0)
