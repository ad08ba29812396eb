"""KV copy bandwidth by direction through KVTransfer's real path, for a GPU session (runs on CPU too, for CI).

`kv_copy_directions` moves `blocks` scattered blocks (no two consecutive on either side, the per-block path's worst
case) device -> host, host -> device, and both at once (write-through and loads in one step, which share no block
and so use both directions of the link), and reports GB/s for each and the host time to launch a step's copies.
Run it twice on a GPU, `batch_memcpy="auto"` and `None`, for the batched path against the per-block one in the
same process. Default shape: Llama-3-8B's KV (32 layers, 8 KV heads, head dim 128, bf16) at block 16, 2 MiB a block.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tokenflow_ray.engine.plan import BlockCopy, StepPlan
from tokenflow_ray.runner.kv_pool import KVPool
from tokenflow_ray.runner.kv_transfer import KVTransfer


def kv_copy_directions(device: str = "cuda", blocks: int = 64, layers: int = 32, block_size: int = 16,
                       kv_heads: int = 8, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                       batch_memcpy: Any = "auto", repeats: int = 5, cuda: Any = None) -> dict:
    """`cuda`: a torch.cuda stand-in, to run the CUDA path's code on a CPU pool (tests)."""
    if blocks < 1 or repeats < 1:
        raise ValueError("kv_copy_directions: blocks and repeats must be >= 1")
    dev = torch.device(device)
    pool = KVPool(layers, 4 * blocks, block_size, kv_heads, head_dim, dtype, dev)
    pool.tensor.normal_()
    transfer = KVTransfer(pool, 2 * blocks, batch_memcpy=batch_memcpy, cuda=cuda)
    transfer.settle()
    transfer.host_kv.normal_()  # the store starts uninitialised (a NaN would never compare equal)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    # Device blocks 0, 2, 4, ... out to host blocks in reverse order; loads from the other half of the host store
    # into device blocks 2 * blocks + 1, + 3, ...: no run of consecutive blocks on either side.
    out = tuple(BlockCopy("w", 2 * i, blocks - 1 - i) for i in range(blocks))
    back = tuple(BlockCopy("r", 2 * blocks + 2 * i + 1, 2 * blocks - 1 - i) for i in range(blocks))
    plans = {"d2h": StepPlan(0, write_through=out), "h2d": StepPlan(1, swap_in=back),
             "both": StepPlan(2, write_through=out, swap_in=back)}
    result: dict = {"path": transfer.copy_path, "layout": pool.layout, "blocks": blocks,
                    "block_mib": transfer.block_bytes / 2**20, "repeats": repeats}
    try:
        for name, plan in plans.items():
            transfer.wait(transfer.launch(plan))  # warm-up
            launch_s, total_s = [], 0.0
            for _ in range(repeats):
                transfer.settle()
                sync()
                t0 = time.perf_counter()
                handle = transfer.launch(plan)
                launch_s.append(time.perf_counter() - t0)
                transfer.wait(handle)
                transfer.settle()
                sync()
                total_s += time.perf_counter() - t0
            moved = (2 if name == "both" else 1) * blocks * transfer.block_bytes * repeats
            result[f"{name}_gb_s"] = moved / total_s / 1e9
            result[f"{name}_launch_ms"] = sorted(launch_s)[len(launch_s) // 2] * 1e3
        loaded = pool.blocks(torch.tensor([c.device_block for c in back], device=dev))
        stored = torch.stack([transfer.host_block(c.host_block) for c in back]).to(dev)
        written = torch.stack([transfer.host_block(c.host_block) for c in out]).to(dev)
        sources = pool.blocks(torch.tensor([c.device_block for c in out], device=dev))
        result["exact"] = bool(torch.equal(loaded, stored) and torch.equal(written, sources))
    finally:
        transfer.close()
    return result
