"""Part `copies`: pinned host<->device bandwidth alone and beside compute (CUDA only), the KV spill round trip, and
KV block copies through the runner's `KVTransfer` (blocks out and in, GB/s, launch ms, overlap, exact round trip)
at the engine's block size (16 tokens: a step's copies in serving) and at 256 (as `gpu_check.json` measured).

Issue 34's goal for a step's copies: >= 45 GB/s one way and <= 0.3 ms to launch. A dry run runs the KVTransfer
pieces on the CPU (its copy thread) with small blocks; the raw pinned-copy test needs CUDA and is recorded so.
"""

from __future__ import annotations

import torch

from tokenflow_ray.lab.gpu.context import PartContext
from tokenflow_ray.runner.gpu_check import copy_overlap, kv_copy_overlap, kv_transfer_roundtrip

# label -> (blocks each way, tokens a block); Llama-3-8B's layers and KV heads: 2 MiB a 16-token block.
FULL = {"block16_x64": (64, 16), "block256_x16": (16, 256)}
QUICK = {"block16_x64": (64, 16)}


def run(ctx: PartContext) -> None:
    device = ctx.device()
    ctx.save("device", device.type)
    if device.type == "cuda":
        ctx.save("host_device_copy", copy_overlap(str(device)))
    else:
        ctx.unavailable("host_device_copy", "pinned host<->device copies need a CUDA device")
    ctx.save("kv_transfer_roundtrip", kv_transfer_roundtrip(str(device)))
    headline = []
    if ctx.dry:
        configs = {"block16_x32": dict(blocks=32, block_size=16, layers=4, kv_heads=2, head_dim=64,
                                       dtype=torch.float32, matmul=256, repeats=3)}
    else:
        configs = {label: dict(blocks=b, block_size=bs) for label, (b, bs) in (QUICK if ctx.quick else FULL).items()}
    for label, kwargs in configs.items():
        r = kv_copy_overlap(str(device), **kwargs)
        ctx.save(f"kv_blocks_{label}", r)
        headline.append(f"{label} out {r['out_gb_s']:.1f} / in {r['in_gb_s']:.1f} GB/s, launch "
                        f"{r['launch_ms']:.2f} ms, overlap {r['overlap_fraction']:.2f}, exact {r['roundtrip_exact']}")
    if "host_device_copy" in ctx.result and "copy_gb_s" in ctx.result["host_device_copy"]:
        headline.insert(0, f"pinned h2d {ctx.result['host_device_copy']['copy_gb_s']:.1f} GB/s")
    ctx.save("headline", "; ".join(headline))
