"""Block copies between the device KV pool and the host spill store, beside the model step.

One code path for CPU and GPU: a copy job runs on a dedicated thread while the model step runs, and the step
joins it before returning, so every copy planned in a step is complete when its result is read (the scheduler
sizes write-through to fit the step). On CUDA the job issues its copies on a side stream that first waits for
earlier steps' work, from/to pinned host memory, and synchronises on an event; on CPU the copies go through numpy
views of the same memory: single-threaded and without the GIL, so they never start an OpenMP team beside the
model's (two teams on a small box stall each other at barriers).

Swap-out tails gate freeing device blocks, so they are issued at launch on the caller's thread, before the step's
compute: on CPU they are a few blocks copied in tens of microseconds, where a hand-off to the copy thread would cost
a thread wake and a GIL hand-over (about a millisecond under a running step); on CUDA they go first on the side
stream. Loads and write-through then run on the copy thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tokenflow_ray.engine.plan import BlockCopy, StepPlan


@dataclass(frozen=True)
class CopyTiming:
    copy_s: float  # the job's own duration
    swap_out_done: dict[str, float]  # preempted stream -> perf_counter time when its tail was on the host
    num_blocks: int


class KVTransfer:
    def __init__(self, device_kv: torch.Tensor, num_host_blocks: int, overlap: bool = True) -> None:
        self.device_kv = device_kv  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        shape = list(device_kv.shape)
        shape[2] = num_host_blocks
        cuda = device_kv.device.type == "cuda"
        self.host_kv = torch.zeros(shape, dtype=device_kv.dtype, pin_memory=cuda)
        self.block_bytes = device_kv[:, :, 0].numel() * device_kv.element_size()
        self.overlap = overlap
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-copy") if overlap else None
        self._stream = torch.cuda.Stream(device=device_kv.device) if cuda else None
        self._np = None  # CPU: numpy views of both pools, made on first use

    def launch(self, plan: StepPlan) -> Future[CopyTiming] | CopyTiming:
        """Copy the swap-out tails now, then start loads and write-through (on the copy thread when overlapping)."""
        t0 = time.perf_counter()
        if self._stream is not None:  # the side stream must see KV written by earlier steps
            self._stream.wait_stream(torch.cuda.current_stream(self.device_kv.device))
        tails = self._swap_out_tails(plan.swap_out)
        inline_s = time.perf_counter() - t0
        if self._pool is None:
            return self._run(plan, inline_s, tails)
        return self._pool.submit(self._run, plan, inline_s, tails)

    @staticmethod
    def wait(handle: Future[CopyTiming] | CopyTiming) -> CopyTiming:
        return handle.result() if isinstance(handle, Future) else handle

    def _swap_out_tails(self, copies: tuple[BlockCopy, ...]) -> dict[str, float | torch.cuda.Event]:
        """One stream's tail after another, shortest first (the mean wait for freed blocks is then least).
        CPU: each stream's completion time; CUDA: an event per stream, for the copy thread to wait on."""
        by_stream: dict[str, list[BlockCopy]] = {}
        for c in copies:
            by_stream.setdefault(c.stream_id, []).append(c)
        done: dict[str, float | torch.cuda.Event] = {}
        with torch.inference_mode(), self._on_side_stream():
            for sid, tail in sorted(by_stream.items(), key=lambda item: len(item[1])):
                self._to_host(tuple(tail))
                if self._stream is None:
                    done[sid] = time.perf_counter()
                else:
                    done[sid] = event = torch.cuda.Event()
                    event.record(self._stream)
        return done

    def _run(self, plan: StepPlan, inline_s: float, tails: dict[str, float | torch.cuda.Event]) -> CopyTiming:
        t0 = time.perf_counter()  # copy_s counts copying, not the wait for this thread to start
        swap_out_done: dict[str, float] = {}
        for sid, done in tails.items():
            if not isinstance(done, float):
                done.synchronize()
                done = time.perf_counter()
            swap_out_done[sid] = done
        with torch.inference_mode(), self._on_side_stream():
            if plan.swap_in:
                self._to_device(plan.swap_in)
            if plan.write_through:
                self._to_host(plan.write_through)
            self._sync()
        n = len(plan.swap_out) + len(plan.swap_in) + len(plan.write_through)
        return CopyTiming(copy_s=inline_s + time.perf_counter() - t0, swap_out_done=swap_out_done, num_blocks=n)

    def _on_side_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else _nullcontext()

    def _index(self, copies: tuple[BlockCopy, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = torch.tensor([c.device_block for c in copies], dtype=torch.long, device=self.device_kv.device)
        host = torch.tensor([c.host_block for c in copies], dtype=torch.long)
        return dev, host

    def _to_host(self, copies: tuple[BlockCopy, ...]) -> None:
        if self.device_kv.device.type == "cpu":
            dev_np, host_np = self._np_views()
            for c in copies:  # slice by slice: one pass over memory (fancy indexing gathers into a temporary)
                host_np[:, :, c.host_block] = dev_np[:, :, c.device_block]
            return
        dev, host = self._index(copies)
        staged = self.device_kv.index_select(2, dev).to("cpu", non_blocking=True)  # pinned, filled asynchronously
        self._sync()  # the scatter below runs on the CPU: the device-to-host copy must have landed
        self.host_kv.index_copy_(2, host, staged)

    def _to_device(self, copies: tuple[BlockCopy, ...]) -> None:
        if self.device_kv.device.type == "cpu":
            dev_np, host_np = self._np_views()
            for c in copies:
                dev_np[:, :, c.device_block] = host_np[:, :, c.host_block]
            return
        dev, host = self._index(copies)
        blocks = self.host_kv.index_select(2, host)
        if self.device_kv.device.type == "cuda":
            blocks = blocks.pin_memory().to(self.device_kv.device, non_blocking=True)
        self.device_kv.index_copy_(2, dev, blocks)

    def _np_views(self):
        """numpy views sharing the pools' memory (bfloat16 has no numpy dtype: viewed as 2-byte integers)."""
        if self._np is None:
            def view(t: torch.Tensor):
                return (t.view(torch.int16) if t.element_size() == 2 else t).numpy()

            self._np = (view(self.device_kv), view(self.host_kv))
        return self._np

    def _sync(self) -> None:
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
            event.synchronize()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
