"""Block copies between the device KV pool and the host spill store, beside the model step.

Every copy planned in a step is complete, for the next step's work, when its result is read (the scheduler sizes
write-through to fit the step). On CUDA, `cuda_copies.CudaBlockCopier`: a step's copies in each direction as one
batched driver call (or per-block copies where that is unavailable) from a pinned, block-major host store on
separate evict and load streams, ordered by stream waits and events, with no host synchronisation before the
compute. On CPU a copy job runs on a dedicated thread while the model step runs, and the step joins it before
returning; the copies go through numpy views of the same memory: single-threaded and without the GIL, so they
never start an OpenMP team beside the model's (two teams on a small box stall each other at barriers).

Swap-out tails gate freeing device blocks, so they go first: on CPU on the caller's thread at launch (a few blocks
copied in tens of microseconds, where a hand-off to the copy thread would cost a thread wake and a GIL hand-over,
about a millisecond under a running step), on CUDA first on the evict stream. Loads and write-through follow.

The CPU reads and writes the host store directly only for migration (`read_host_blocks`, `write_host_blocks`):
both `settle()` first, so no copy still in flight (a GPU's copies outlive the step that issued them) lands on top
of what the CPU wrote, or after what it read.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from tokenflow_ray.engine.plan import BlockCopy, StepPlan
from tokenflow_ray.runner.copy_plan import CopyTiming, by_stream_shortest_first
from tokenflow_ray.runner.cuda_copies import CudaBlockCopier
from tokenflow_ray.runner.kv_pool import KVPool

__all__ = ["CopyTiming", "KVTransfer"]


class KVTransfer:
    """`cuda` (the torch.cuda namespace, or a stand-in in tests) takes the CUDA path even for a CPU pool;
    `batch_memcpy` is passed to CudaBlockCopier ("auto", None for per-block copies, or a stand-in)."""

    def __init__(self, pool: KVPool, num_host_blocks: int, overlap: bool = True, cuda: Any = None,
                 batch_memcpy: Any = "auto") -> None:
        self.pool = pool
        self.device_kv = pool.tensor
        self.block_bytes = pool.block_bytes
        self.overlap = overlap
        self._np = None  # CPU: numpy views of both pools, made on first use
        self._cuda = None
        self._last: Future | None = None  # the CPU path's copy job last launched
        # The host store has the device pool's layout (block-major: [host_blocks, layers, 2, block_size, kv_heads,
        # head_dim]; layer-major: [layers, 2, host_blocks, ...]), so a block copy is the same slicing on both.
        self.host_block_major = pool.block_major
        if pool.device.type == "cuda" or cuda is not None:
            self._cuda = CudaBlockCopier(pool, num_host_blocks, cuda=cuda, batch_memcpy=batch_memcpy)
            self.host_kv = self._cuda.host_kv
            self.host_block_major = True
            self._pool = None
            return
        shape = list(pool.tensor.shape)
        shape[0 if pool.block_major else 2] = num_host_blocks
        self.host_kv = torch.zeros(shape, dtype=pool.dtype)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-copy") if overlap else None

    def launch(self, plan: StepPlan):
        """Copy the swap-out tails now, then start loads and write-through (on the copy thread when overlapping;
        on CUDA, enqueued on the side streams)."""
        if self._cuda is not None:
            return self._cuda.launch(plan)
        t0 = time.perf_counter()
        tails = self._swap_out_tails(plan.swap_out)
        inline_s = time.perf_counter() - t0
        if self._pool is None:
            return self._run(plan, inline_s, tails)
        self._last = self._pool.submit(self._run, plan, inline_s, tails)
        return self._last

    @property
    def copy_path(self) -> str:
        """Which copy path runs: `batch` or `per_block` (CUDA), `cpu` (numpy on a copy thread)."""
        return self._cuda.path if self._cuda is not None else "cpu"

    def settle(self) -> None:
        """Wait on the host for every copy launched so far: before the CPU touches the host store."""
        if self._cuda is not None:
            self._cuda.settle()
        elif self._last is not None:
            self._last.result()
            self._last = None

    @staticmethod
    def wait(handle) -> CopyTiming:
        """A launch's timing: a finished job's, a copy thread's future's, or a CUDA handle's (which joins)."""
        return handle if isinstance(handle, CopyTiming) else handle.result()

    def host_block(self, host_block: int) -> torch.Tensor:
        """One host block, [layers, 2, block_size, kv_heads, head_dim], whichever layout the pool has (copies
        launched so far have landed in it)."""
        self.settle()
        return self.host_kv[host_block] if self.host_block_major else self.host_kv[:, :, host_block]

    def read_host_blocks(self, host_blocks: list[int]):
        """The KV of these host blocks as one numpy array, block-major ([n, layers, 2, block_size, kv_heads,
        head_dim]; bfloat16 as int16): what a migrated stream carries through Ray's object store."""
        self.settle()
        host_np = self._host_np()
        if self.host_block_major:
            return host_np[host_blocks].copy()
        return np.ascontiguousarray(np.moveaxis(host_np[:, :, host_blocks], 2, 0))

    def write_host_blocks(self, host_blocks: list[int], data) -> None:
        """Store blocks that `read_host_blocks` of a runner with the same model and layout gave."""
        host_np = self._host_np()
        expected = (len(host_blocks),) + (host_np.shape[1:] if self.host_block_major else
                                          host_np.shape[:2] + host_np.shape[3:])
        if tuple(data.shape) != expected or data.dtype != host_np.dtype:
            raise ValueError(f"KV blocks: got {data.dtype}{tuple(data.shape)}, this pool holds "
                             f"{host_np.dtype}{expected} (another model or block size?)")
        self.settle()  # a copy still in flight to these blocks (their previous owner's) must not land afterwards
        if self.host_block_major:
            host_np[host_blocks] = data
        else:
            host_np[:, :, host_blocks] = np.moveaxis(data, 0, 2)

    def _swap_out_tails(self, copies: tuple[BlockCopy, ...]) -> dict[str, float]:
        """One stream's tail after another, shortest first (the mean wait for freed blocks is then least);
        returns each stream's completion time."""
        done: dict[str, float] = {}
        for sid, tail in by_stream_shortest_first(copies):
            self._to_host(tuple(tail))
            done[sid] = time.perf_counter()
        return done

    def _run(self, plan: StepPlan, inline_s: float, tails: dict[str, float]) -> CopyTiming:
        t0 = time.perf_counter()  # copy_s counts copying, not the wait for this thread to start
        if plan.swap_in:
            self._to_device(plan.swap_in)
        if plan.write_through:
            self._to_host(plan.write_through)
        n = len(plan.swap_out) + len(plan.swap_in) + len(plan.write_through)
        return CopyTiming(copy_s=inline_s + time.perf_counter() - t0, swap_out_done=tails, num_blocks=n)

    def _to_host(self, copies: tuple[BlockCopy, ...]) -> None:
        dev_np, host_np = self._np_views()
        if self.host_block_major:
            for c in copies:  # one contiguous block each side
                host_np[c.host_block] = dev_np[c.device_block]
            return
        for c in copies:  # slice by slice: one pass over memory (fancy indexing gathers into a temporary)
            host_np[:, :, c.host_block] = dev_np[:, :, c.device_block]

    def _to_device(self, copies: tuple[BlockCopy, ...]) -> None:
        dev_np, host_np = self._np_views()
        if self.host_block_major:
            for c in copies:
                dev_np[c.device_block] = host_np[c.host_block]
            return
        for c in copies:
            dev_np[:, :, c.device_block] = host_np[:, :, c.host_block]

    def _host_np(self):
        """A numpy view of the host store (pinned CPU memory on CUDA machines: numpy reads it in place)."""
        return _np_view(self.host_kv)

    def _np_views(self):
        """numpy views sharing both pools' memory: the CPU copy path only (a CUDA pool has no numpy view)."""
        if self._np is None:
            self._np = (_np_view(self.device_kv), _np_view(self.host_kv))
        return self._np

    def close(self) -> None:
        """Wait for the copies in flight and release the copy thread (CPU) or unregister the host store (CUDA)."""
        if self._cuda is not None:
            self._cuda.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)



def _np_view(t: torch.Tensor):
    """numpy sharing the tensor's memory (bfloat16 has no numpy dtype: viewed as 2-byte integers)."""
    return (t.view(torch.int16) if t.element_size() == 2 else t).numpy()
