"""Device checks: paged attention parity, the KV spill round trip, host<->device copy bandwidth and its overlap
with compute, KV block copies through `KVTransfer`.

`jobs/gpu_bench.py` runs them on a GPU (parts `copies`, `attention`: tokenflow_ray/lab/gpu/); all but
`copy_overlap` also run on the CPU (tests, and the bench's dry run).
"""

from __future__ import annotations

import statistics
import time

import torch

from tokenflow_ray.layers.attention import AttentionMetadata, PrefillSpan
from tokenflow_ray.runner.kv_pool import KVPool


def _random_paged_batch(device: torch.device, dtype: torch.dtype, block_size: int = 256, heads: int = 32,
                        kv_heads: int = 8, head_dim: int = 128, decodes: int = 8, chunk: int = 64, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks = 64
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    perm = torch.randperm(blocks, generator=g)
    lens = [int(x) for x in torch.randint(1, 3 * block_size, (decodes,), generator=g)]
    width = max(-(-n // block_size) for n in lens)
    tables = torch.stack([perm[i * width:(i + 1) * width] for i in range(decodes)]).to(device)
    prefill_table = perm[decodes * width:decodes * width + 2].to(device)
    start_pos = block_size - chunk // 2  # the chunk continues a context already in the pool
    T = decodes + chunk
    slots = [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
    slots += [int(prefill_table[p // block_size]) * block_size + p % block_size
              for p in range(start_pos, start_pos + chunk)]
    q = torch.randn(T, heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(device, dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    mask = (torch.arange(width * block_size, device=device)[None, :] < lens_t[:, None]).view(decodes, 1, 1, -1)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), num_decodes=decodes,
                             decode_block_tables=tables, decode_seq_lens=lens_t, decode_mask=mask,
                             prefills=[PrefillSpan(decodes, T, start_pos, prefill_table)], scale=head_dim ** -0.5)
    return q, k, v, k_cache, v_cache, meta


def paged_attention_parity(backend_a, backend_b, device: str = "cuda", dtype=torch.bfloat16, **batch) -> float:
    """Max abs difference between two backends on the same paged batch (decodes + a continued prefill chunk);
    batch: shape arguments of `_random_paged_batch`."""
    dev = torch.device(device)
    q, k, v, kc, vc, meta = _random_paged_batch(dev, dtype, **batch)
    meta_b = AttentionMetadata(**{**meta.__dict__, "decode_block_tables": meta.decode_block_tables.int(),
                                  "prefills": [PrefillSpan(p.start, p.end, p.start_pos, p.block_table.int())
                                               for p in meta.prefills]})
    out_a = backend_a.forward(q, k, v, kc.clone(), vc.clone(), meta_b if backend_a.name == "flash" else meta)
    out_b = backend_b.forward(q, k, v, kc.clone(), vc.clone(), meta_b if backend_b.name == "flash" else meta)
    return float((out_a.float() - out_b.float()).abs().max())


def kv_transfer_roundtrip(device: str = "cuda", overlap: bool = True) -> dict:
    """KVTransfer's real path: write-through and swap-out tails to the host, then loads into other device blocks,
    in two steps; every loaded block must equal its source. On CUDA this exercises the side stream, the per-stream
    events and the device-to-host staging."""
    from tokenflow_ray.engine.plan import BlockCopy, StepPlan
    from tokenflow_ray.runner.kv_transfer import KVTransfer

    dev = torch.device(device)
    pool = KVPool(2, 16, 4, 2, 8, torch.float32, dev)
    pool.tensor.normal_()
    transfer = KVTransfer(pool, num_host_blocks=16, overlap=overlap)
    try:
        out = StepPlan(step_id=0, write_through=(BlockCopy("a", 0, 0), BlockCopy("a", 1, 1)),
                       swap_out=(BlockCopy("a", 2, 2), BlockCopy("b", 3, 3), BlockCopy("b", 4, 4)))
        timing = transfer.wait(transfer.launch(out))
        back = StepPlan(step_id=1, swap_in=tuple(BlockCopy("a", 8 + i, i) for i in range(5)))
        transfer.wait(transfer.launch(back))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        loaded, sources = pool.blocks(torch.arange(8, 13, device=dev)), pool.blocks(torch.arange(0, 5, device=dev))
        max_abs = float((loaded - sources).abs().max())
        return {"max_abs": max_abs, "tails_timed": sorted(timing.swap_out_done), "blocks": timing.num_blocks}
    finally:
        transfer.close()


def _sync(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _timed(fn, sync, repeats: int = 1) -> float:
    """Median seconds of `fn` over `repeats`, the device synchronised around each."""
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _matmuls(device: torch.device, size: int, dtype: torch.dtype, n: int = 20):
    a = torch.randn(size, size, device=device, dtype=dtype)

    def compute() -> None:
        for _ in range(n):
            a @ a
    return compute


def copy_overlap(device: str = "cuda", blocks: int = 512, block_mb: float = 2.0) -> dict:
    """Pinned host<->device copies (CUDA): host->device and device->host alone, both at once (each on its own
    stream), and host->device beside a bf16 matmul loop on another stream."""
    dev = torch.device(device)
    host = torch.empty(blocks, int(block_mb * 2 ** 20 / 2), dtype=torch.bfloat16, pin_memory=True)
    host_back = torch.empty_like(host, pin_memory=True)
    dst = torch.empty_like(host, device=dev)
    src = torch.randn(host.shape, device=dev).to(torch.bfloat16)
    h2d_stream, d2h_stream = torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)
    sync, compute = _sync(dev), _matmuls(dev, 8192, torch.bfloat16)

    def h2d() -> None:
        with torch.cuda.stream(h2d_stream):
            dst.copy_(host, non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(d2h_stream):
            host_back.copy_(src, non_blocking=True)

    compute(), h2d(), d2h()  # warm-up
    t_compute, t_h2d, t_d2h = _timed(compute, sync, 3), _timed(h2d, sync, 3), _timed(d2h, sync, 3)
    t_bidir = _timed(lambda: (h2d(), d2h()), sync, 3)
    t_both = _timed(lambda: (h2d(), compute()), sync, 3)
    gb = host.numel() * 2 / 1e9
    return {"bytes": host.numel() * 2, "compute_s": t_compute, "copy_s": t_h2d, "both_s": t_both,
            "overlap_fraction": (t_compute + t_h2d - t_both) / min(t_compute, t_h2d), "copy_gb_s": gb / t_h2d,
            "d2h_gb_s": gb / t_d2h, "bidirectional_gb_s_each": gb / t_bidir}


def hbm_bandwidth(device: torch.device, mb: int = 1024) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted); on the CPU, of a memory copy."""
    x = torch.empty(mb * 2 ** 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    sync = _sync(device)
    for _ in range(3):
        y.copy_(x)
    return 2 * x.numel() / _timed(lambda: y.copy_(x), sync, 10)


def kv_copy_overlap(device: str = "cuda", blocks: int = 64, block_size: int = 16, layers: int = 32,
                    kv_heads: int = 8, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                    matmul: int = 8192, repeats: int = 5) -> dict:
    """KV block copies through `KVTransfer`'s public methods (launch, wait, host_block), beside compute: `blocks`
    device blocks out to the host (write-through) alone, `blocks` others in (loads) alone, both in one plan, and
    both beside a matmul loop (launch_ms: the host time to enqueue them; overlap_fraction: the share of the
    shorter of copies and compute hidden under the other). Every copied block must equal its source."""
    from tokenflow_ray.engine.plan import BlockCopy, StepPlan
    from tokenflow_ray.runner.kv_transfer import KVTransfer

    dev = torch.device(device)
    sync = _sync(dev)
    pool = KVPool(layers, 4 * blocks, block_size, kv_heads, head_dim, dtype, dev)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, device=dev))
    transfer = KVTransfer(pool, num_host_blocks=2 * blocks)
    try:
        out = StepPlan(0, write_through=tuple(BlockCopy("a", i, i) for i in range(blocks)))
        seed = StepPlan(0, write_through=tuple(BlockCopy("b", blocks + i, blocks + i) for i in range(blocks)))
        load = StepPlan(0, swap_in=tuple(BlockCopy("b", 2 * blocks + i, blocks + i) for i in range(blocks)))
        both = StepPlan(0, write_through=out.write_through, swap_in=load.swap_in)
        transfer.wait(transfer.launch(seed))  # the host blocks the loads read
        compute = _matmuls(dev, matmul, dtype)
        launch_s: list[float] = []

        def overlapped() -> None:
            t = time.perf_counter()
            handle = transfer.launch(both)
            launch_s.append(time.perf_counter() - t)
            compute()
            transfer.wait(handle)

        compute(), overlapped()  # warm-up
        launch_s.clear()
        t_out = _timed(lambda: transfer.wait(transfer.launch(out)), sync, repeats)
        t_in = _timed(lambda: transfer.wait(transfer.launch(load)), sync, repeats)
        t_copy = _timed(lambda: transfer.wait(transfer.launch(both)), sync, repeats)
        t_compute = _timed(compute, sync, repeats)
        t_both = _timed(overlapped, sync, repeats)
        sync()
        block = pool.block
        exact = all(torch.equal(transfer.host_block(i).cpu(), block(i).cpu()) for i in range(blocks)) and \
            all(torch.equal(block(2 * blocks + i).cpu(), block(blocks + i).cpu())
                and torch.equal(transfer.host_block(blocks + i).cpu(), block(blocks + i).cpu())
                for i in range(blocks))
        gb = blocks * transfer.block_bytes / 1e9
        return {"blocks": blocks, "block_size": block_size, "block_bytes": transfer.block_bytes,
                "out_gb_s": gb / t_out, "in_gb_s": gb / t_in, "copy_gb_s": 2 * gb / t_copy, "copy_s": t_copy,
                "compute_s": t_compute, "both_s": t_both, "launch_ms": statistics.median(launch_s) * 1e3,
                "overlap_fraction": (t_compute + t_copy - t_both) / min(t_compute, t_copy), "roundtrip_exact": exact}
    finally:
        transfer.close()
