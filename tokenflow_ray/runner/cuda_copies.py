"""KV block copies on CUDA: a step's copies in each direction as one batched driver call, on side streams.

The host store is block-major and page-locked at its exact size (host_store.py). A step's copies are turned into
(destination, source, size) triples (copy_plan.py: one per block on the block-major pool, runs of consecutive blocks
merged; one per layer piece on a layer-major pool) and enqueued with one `cuMemcpyBatchAsync` (batch_memcpy.py) per
group: the swap-out tails, then write-through, on the evict stream; the loads on the load stream. Copies stay on the
copy engines (vLLM found DMA beats copy kernels end to end: kernels take SMs from the model). Where the batch call is
unavailable or fails its start-up self-check, each run of blocks is one `copy_(..., non_blocking=True)` instead
(the per-block path, obviously correct, and the one before this change). The path is logged at start;
`TOKENFLOW_KV_COPY=per_block` in the environment forces the per-block path (default `auto`).

Ordering is by stream waits and events only; the host never waits before the step's compute:
- each side stream first waits for the compute stream (the KV earlier steps wrote) and for the other side stream's
  earlier copies (one may touch a host block that this step's reuses after a release, or load one an earlier
  eviction wrote): copies of consecutive steps never overlap on the device, so host-block release and reuse need
  nothing more, and this holds even without the join;
- loads wait for this step's evictions only when they touch a block those touch (never, with today's plans), so a
  step's write-through and loads use both directions of the link at once;
- at the join the compute stream waits for both side streams (the next step may reuse a tail's blocks or read a
  loaded one). The host waits only for the tails' event (it reports when each preempted stream's blocks were on
  the host) and reads the copy time from timing events.
- `settle()` makes the host wait for every copy issued: callers do so before the CPU reads or writes the host store
  (migration's export and import).

`cuda` is the torch.cuda namespace; tests pass a recording stand-in (and a stand-in batch call) on CPU.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenflow_ray.engine.plan import BlockCopy, StepPlan
from tokenflow_ray.runner.batch_memcpy import resolve_driver_batch_memcpy
from tokenflow_ray.runner.copy_plan import (
    BlockLayout,
    CopyTiming,
    block_runs,
    by_stream_shortest_first,
    descriptors,
)
from tokenflow_ray.runner.host_store import PinnedHostStore
from tokenflow_ray.runner.kv_pool import KVPool

log = logging.getLogger(__name__)

KV_COPY_ENV = "TOKENFLOW_KV_COPY"  # auto (the batched call where it works) | per_block


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

    def result(self) -> CopyTiming:
        return self.copier.join(self)


class CudaBlockCopier:
    """`batch_memcpy`: "auto" (the driver's batch call when it resolves and passes the self-check), None (per-block
    copies), or a callable `(Descriptors, stream_handle)` (tests)."""

    def __init__(self, pool: KVPool, num_host_blocks: int, cuda: Any = None, batch_memcpy: Any = "auto") -> None:
        self.cuda = cuda if cuda is not None else torch.cuda
        self.pool = pool
        self.device_kv = pool.tensor
        self.store = PinnedHostStore((num_host_blocks, pool.num_layers, 2, pool.block_size, pool.kv_heads,
                                      pool.head_dim), pool.dtype, self.cuda.cudart())
        self.host_kv = self.store.tensor
        self.block_bytes = pool.block_bytes
        dev = pool.device
        self.evict_stream = self.cuda.Stream(device=dev)
        self.load_stream = self.cuda.Stream(device=dev)
        pieces = 1 if pool.block_major else 2 * pool.num_layers
        self._device_layout = BlockLayout.of(pool.tensor, pool.block_major)
        self._host_layout = BlockLayout.of(self.host_kv, block_major=True, pieces=pieces)
        self.calls = 0  # copy calls issued: one a batch, or one a run of blocks on the per-block path
        self.batch, why = self._choose_batch(batch_memcpy)
        log.info("KV copies: %s (%s; %s pool, %.2f MiB a block)", self.path, why, pool.layout,
                 self.block_bytes / 2**20)

    @property
    def path(self) -> str:
        return "batch" if self.batch is not None else "per_block"

    def _event(self):
        return self.cuda.Event(enable_timing=True)

    # ---- one step ---------------------------------------------------------------------------------------------
    def launch(self, plan: StepPlan) -> CudaCopyHandle:
        compute = self.cuda.current_stream(self.device_kv.device)
        evict, load = self.evict_stream, self.load_stream
        handle = CudaCopyHandle(self, self._event(), time.perf_counter())
        handle.num_evicts = len(plan.swap_out) + len(plan.write_through)
        handle.num_blocks = handle.num_evicts + len(plan.swap_in)
        with torch.inference_mode():
            # Each side stream after the compute so far and after the other's earlier copies (not this step's).
            evict.wait_stream(compute)
            evict.wait_stream(load)
            if plan.swap_in:
                load.wait_stream(compute)
                load.wait_stream(evict)
            with self.cuda.stream(evict):
                handle.start.record(evict)
                if plan.swap_out:
                    self._tails(plan.swap_out, handle)
                if plan.write_through:
                    self._copy(plan.write_through, to_host=True, stream=evict)
                handle.evict_end = self._event()
                handle.evict_end.record(evict)
            if plan.swap_in:
                if _share_blocks(plan):  # this step's evictions too (a plan that loads a block it evicts: not today)
                    load.wait_stream(evict)
                with self.cuda.stream(load):
                    handle.load_start = self._event()
                    handle.load_start.record(load)
                    self._copy(plan.swap_in, to_host=False, stream=load)
                    handle.load_end = self._event()
                    handle.load_end.record(load)
        return handle

    def _tails(self, copies: tuple[BlockCopy, ...], handle: CudaCopyHandle) -> None:
        """Swap-out tails before write-through. Batched: one call and one event for all of them (a batch runs its
        copies in no set order); per block: shortest stream first, an event after each stream's."""
        groups = by_stream_shortest_first(copies)
        if self.batch is not None:
            self._copy(tuple(c for _, tail in groups for c in tail), to_host=True, stream=self.evict_stream)
            event = self._event()
            event.record(self.evict_stream)
            handle.tails = {sid: event for sid, _ in groups}
            return
        for sid, tail in groups:
            self._copy(tuple(tail), to_host=True, stream=self.evict_stream)
            event = handle.tails[sid] = self._event()
            event.record(self.evict_stream)

    def _copy(self, copies: tuple[BlockCopy, ...], to_host: bool, stream) -> None:
        dev_ids = [c.device_block for c in copies]
        host_ids = [c.host_block for c in copies]
        if self.batch is not None:
            if to_host:
                batch = descriptors(self._host_layout, host_ids, self._device_layout, dev_ids)
            else:
                batch = descriptors(self._device_layout, dev_ids, self._host_layout, host_ids)
            try:
                self.batch(batch, stream.cuda_stream)
                self.calls += 1
                return
            except Exception:  # noqa: BLE001 - logged; the same copies again, per block (idempotent)
                log.exception("KV copies: the batched call failed; per-block copies from now on")
                self.batch = None
        self._copy_per_block(dev_ids, host_ids, to_host)

    def _copy_per_block(self, dev_ids: list[int], host_ids: list[int], to_host: bool) -> None:
        """One `copy_` a run of consecutive blocks (block-major), or a block (layer-major: strided pieces)."""
        host, pool = self.host_kv, self.pool
        if pool.block_major:
            for d, h, n in zip(*block_runs(np.asarray(dev_ids), np.asarray(host_ids))):
                d, h, n = int(d), int(h), int(n)
                dst, src = (host[h:h + n], pool.tensor[d:d + n]) if to_host else (pool.tensor[d:d + n], host[h:h + n])
                dst.copy_(src, non_blocking=True)
                self.calls += 1
            return
        for d, h in zip(dev_ids, host_ids):
            dst, src = (host[h], pool.block(d)) if to_host else (pool.block(d), host[h])
            dst.copy_(src, non_blocking=True)
            self.calls += 1

    def join(self, handle: CudaCopyHandle) -> CopyTiming:
        compute = self.cuda.current_stream(self.device_kv.device)
        compute.wait_stream(self.evict_stream)  # device-side: the next step's kernels come after the copies
        compute.wait_stream(self.load_stream)
        swap_out_done, synced = {}, set()
        for sid, event in handle.tails.items():  # small, issued first: long done once the compute is
            if id(event) not in synced:
                event.synchronize()
                synced.add(id(event))
            swap_out_done[sid] = handle.t0 + handle.start.elapsed_time(event) / 1e3
        # copy_s and the blocks counted are what the cost model learns copy bandwidth from. Copies still running
        # at the join are not waited for (the host would stall): they are left out of both.
        copy_ms, measured = 0.0, 0
        if handle.num_evicts and handle.evict_end.query():
            copy_ms += handle.start.elapsed_time(handle.evict_end)
            measured += handle.num_evicts
        if handle.load_end is not None and handle.load_end.query():
            copy_ms += handle.load_start.elapsed_time(handle.load_end)
            measured += handle.num_blocks - handle.num_evicts
        return CopyTiming(copy_s=copy_ms / 1e3, swap_out_done=swap_out_done, num_blocks=measured)

    # ---- the host's view --------------------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait on the host for every copy issued so far: before the CPU reads or writes the host store."""
        self.evict_stream.synchronize()
        self.load_stream.synchronize()

    def close(self) -> None:
        self.settle()
        self.store.close()

    # ---- start-up: which path ---------------------------------------------------------------------------------
    def _choose_batch(self, batch_memcpy: Any) -> tuple[Any, str]:
        if batch_memcpy is None:
            return None, "batched copies switched off"
        if isinstance(batch_memcpy, str):
            if batch_memcpy != "auto":
                raise ValueError(f"batch_memcpy: 'auto', None or a callable, got {batch_memcpy!r}")
            choice = os.environ.get(KV_COPY_ENV, "auto").strip() or "auto"
            if choice not in ("auto", "per_block"):
                raise ValueError(f"${KV_COPY_ENV}: expected auto or per_block, got {choice!r}")
            if choice == "per_block":
                return None, f"${KV_COPY_ENV}=per_block"
            if self.pool.device.type != "cuda":
                return None, "not a CUDA pool"
            index = self.pool.device.index
            resolved = resolve_driver_batch_memcpy(self.cuda.current_device() if index is None else index)
            if resolved.memcpy is None:
                return None, resolved.why
            batch_memcpy, found = resolved.memcpy, f"cuMemcpyBatchAsync, {resolved.why}"
        else:
            found = getattr(batch_memcpy, "name", type(batch_memcpy).__name__)
        failed = self._self_check(batch_memcpy)
        if failed is not None:
            log.warning("KV copies: the batched call failed its self-check (%s)", failed)
            return None, f"batch self-check failed: {failed}"
        return batch_memcpy, f"{found}, self-check passed"

    def _self_check(self, memcpy) -> str | None:
        """A batched round trip of up to two blocks, device scratch -> host store -> device scratch, in reverse
        block order (two triples), compared byte for byte. None when it matched, else what went wrong."""
        n = min(2, self.host_kv.shape[0])
        dev = self.pool.device
        try:
            src = torch.randint(0, 256, (n, self.block_bytes), dtype=torch.uint8, device=dev)
            back = torch.zeros_like(src)
            host = BlockLayout.of(self.host_kv, block_major=True)
            ids, rev = list(range(n)), list(range(n))[::-1]
            stream = self.evict_stream
            stream.wait_stream(self.cuda.current_stream(dev))
            memcpy(descriptors(host, rev, BlockLayout.of(src, True), ids), stream.cuda_stream)
            stream.synchronize()
            host_bytes = self.host_kv[:n].reshape(n, -1).view(torch.uint8)
            if not torch.equal(host_bytes[rev], src.cpu()):
                return "device -> host bytes differ"
            memcpy(descriptors(BlockLayout.of(back, True), ids, host, rev), stream.cuda_stream)
            stream.synchronize()
            if not torch.equal(back.cpu(), src.cpu()):
                return "host -> device bytes differ"
        except Exception as exc:  # noqa: BLE001 - any failure means: per-block copies
            return f"{type(exc).__name__}: {exc}"
        return None


def _share_blocks(plan: StepPlan) -> bool:
    """Does a load of this plan touch a device or host block that one of its evictions touches?"""
    out = (*plan.swap_out, *plan.write_through)
    dev, host = {c.device_block for c in out}, {c.host_block for c in out}
    return any(c.device_block in dev or c.host_block in host for c in plan.swap_in)
