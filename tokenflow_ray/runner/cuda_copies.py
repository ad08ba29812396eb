"""KV block copies on CUDA: per block, asynchronous, from a pinned host pool, on separate evict and load streams.

The host pool is block-major ([host_blocks, layers, K/V, block_size, kv_heads, head_dim], pinned), so a block is one
contiguous pinned region and each copy is one `copy_(..., non_blocking=True)`: no gather into a temporary, no
staging buffer, no CPU scatter, and the engine thread never waits for a copy before the step's compute
(vLLM's `swap_blocks`, per block). Ordering is by stream waits and events only:

- both side streams first wait for the compute stream (the KV that earlier steps wrote, blocks they still read);
- the evict stream copies swap-out tails first (an event per preempted stream), then write-through;
- the load stream also waits for the evict stream (a host block being loaded may have been written by an evict
  still in flight), then copies host -> device;
- at the step's join the compute stream waits for both side streams (the next step may reuse a tail's blocks or
  read a loaded one), again on the device. The host waits only for the tails' events, after the step's compute
  (they report when each preempted stream's blocks were free), and reads the copy time from timing events.

`cuda` is the torch.cuda namespace; tests pass a recording stand-in to check the ordering on CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenflow_ray.engine.plan import BlockCopy, StepPlan
from tokenflow_ray.runner.kv_pool import KVPool


@dataclass
class CudaCopyHandle:
    """A step's copies in flight. `result()` joins them into the compute stream and returns their timing."""

    copier: CudaBlockCopier
    start: Any  # timing event on the evict stream at launch
    t0: float  # perf_counter at launch
    tails: dict[str, Any] = field(default_factory=dict)  # preempted stream -> event after its tail
    evict_end: Any = None
    load_start: Any = None
    load_end: Any = None
    num_blocks: int = 0
    num_evicts: int = 0

    def result(self):
        return self.copier.join(self)


class CudaBlockCopier:
    def __init__(self, pool: KVPool, num_host_blocks: int, cuda: Any = None, pin_memory: bool = True) -> None:
        self.cuda = cuda if cuda is not None else torch.cuda
        self.pool = pool
        self.device_kv = pool.tensor
        self.host_kv = torch.zeros((num_host_blocks, pool.num_layers, 2, pool.block_size, pool.kv_heads,
                                    pool.head_dim), dtype=pool.dtype, pin_memory=pin_memory)
        self.block_bytes = pool.block_bytes
        dev = pool.device
        self.evict_stream = self.cuda.Stream(device=dev)
        self.load_stream = self.cuda.Stream(device=dev)

    def _event(self):
        return self.cuda.Event(enable_timing=True)

    def launch(self, plan: StepPlan) -> CudaCopyHandle:
        compute = self.cuda.current_stream(self.device_kv.device)
        handle = CudaCopyHandle(self, self._event(), time.perf_counter())
        handle.num_evicts = len(plan.swap_out) + len(plan.write_through)
        handle.num_blocks = handle.num_evicts + len(plan.swap_in)
        with torch.inference_mode():
            self.evict_stream.wait_stream(compute)
            with self.cuda.stream(self.evict_stream):
                handle.start.record(self.evict_stream)
                for sid, tail in _by_stream_shortest_first(plan.swap_out):
                    for c in tail:
                        self.host_kv[c.host_block].copy_(self.pool.block(c.device_block), non_blocking=True)
                    event = handle.tails[sid] = self._event()
                    event.record(self.evict_stream)
                for c in plan.write_through:
                    self.host_kv[c.host_block].copy_(self.pool.block(c.device_block), non_blocking=True)
                handle.evict_end = self._event()
                handle.evict_end.record(self.evict_stream)
            if plan.swap_in:
                self.load_stream.wait_stream(compute)
                self.load_stream.wait_stream(self.evict_stream)
                with self.cuda.stream(self.load_stream):
                    handle.load_start = self._event()
                    handle.load_start.record(self.load_stream)
                    for c in plan.swap_in:
                        self.pool.block(c.device_block).copy_(self.host_kv[c.host_block], non_blocking=True)
                    handle.load_end = self._event()
                    handle.load_end.record(self.load_stream)
        return handle

    def join(self, handle: CudaCopyHandle):
        from tokenflow_ray.runner.kv_transfer import CopyTiming

        compute = self.cuda.current_stream(self.device_kv.device)
        compute.wait_stream(self.evict_stream)  # device-side: the next step's kernels come after the copies
        compute.wait_stream(self.load_stream)
        swap_out_done = {}
        for sid, event in handle.tails.items():  # small, issued first: long done once the compute is
            event.synchronize()
            swap_out_done[sid] = handle.t0 + handle.start.elapsed_time(event) / 1e3
        # copy_s and the blocks counted are what the cost model learns copy bandwidth from. Copies still running
        # at the join are not waited for (the host would stall): they are left out of both.
        copy_ms, measured = 0.0, 0
        if handle.evict_end.query():
            copy_ms += handle.start.elapsed_time(handle.evict_end)
            measured += handle.num_evicts
        if handle.load_end is not None and handle.load_end.query():
            copy_ms += handle.load_start.elapsed_time(handle.load_end)
            measured += handle.num_blocks - handle.num_evicts
        return CopyTiming(copy_s=copy_ms / 1e3, swap_out_done=swap_out_done, num_blocks=measured)


def _by_stream_shortest_first(copies: tuple[BlockCopy, ...]) -> list[tuple[str, list[BlockCopy]]]:
    """One stream's tail after another, shortest first (the mean wait for freed blocks is then least)."""
    by_stream: dict[str, list[BlockCopy]] = {}
    for c in copies:
        by_stream.setdefault(c.stream_id, []).append(c)
    return sorted(by_stream.items(), key=lambda item: len(item[1]))
