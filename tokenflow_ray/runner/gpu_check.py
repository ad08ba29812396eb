"""Device checks for a CUDA machine (not run in CI): paged attention parity, KV spill round trip, copy/compute
overlap, 8B step time.

`python jobs/gpu_check.py --json out.json` runs them all; each function is also usable from tests (on CPU).
"""

from __future__ import annotations

import time

import torch

from tokenflow_ray.runner.attention import AttentionMetadata, PrefillSpan
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


def copy_overlap(device: str = "cuda", blocks: int = 512, block_mb: float = 2.0) -> dict:
    """Time a matmul loop alone, host->device copies alone, and both together on separate streams."""
    dev = torch.device(device)
    host = torch.empty(blocks, int(block_mb * 2 ** 20 / 2), dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty_like(host, device=dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device=dev)

    def compute() -> None:
        for _ in range(20):
            a @ a

    def copy() -> None:
        with torch.cuda.stream(side):
            dst.copy_(host, non_blocking=True)

    def timed(fn) -> float:
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t

    compute(), copy()
    t_compute, t_copy = timed(compute), timed(copy)
    t_both = timed(lambda: (copy(), compute()))
    return {"compute_s": t_compute, "copy_s": t_copy, "both_s": t_both,
            "overlap_fraction": (t_compute + t_copy - t_both) / min(t_compute, t_copy),
            "copy_gb_s": host.numel() * 2 / t_copy / 1e9}


def llama8b_step_time(device: str = "cuda", batch: int = 32, context: int = 1024, backend: str = "auto") -> dict:
    """Decode step time of a Llama-3-8B-shaped model with random weights, through our runner's model code."""
    from transformers import LlamaConfig

    from tokenflow_ray.models.llama import LlamaForPagedLM
    from tokenflow_ray.runner.attention import select_backend

    dev = torch.device(device)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0)
    with torch.device("meta"):
        model = LlamaForPagedLM(cfg)
    model = model.to_empty(device=dev).to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.build_rope_tables(8192, dev)
    block = 256
    nblocks = batch * (-(-context // block)) + 1  # the last one is spare: the CUDA graph's padding writes there
    pool = KVPool(32, nblocks, block, 8, 128, torch.bfloat16, dev)
    kv = pool.layers
    attn = select_backend(dev, block, backend, contiguous_layers=not pool.block_major)
    width = -(-context // block)
    tables = torch.arange(batch * width, device=dev).view(batch, width)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    slots = tables[:, -1] * block + (context - 1) % block
    mask = (torch.arange(width * block, device=dev)[None, :] < lens[:, None]).view(batch, 1, 1, -1)
    meta = AttentionMetadata(slot_mapping=slots.long(), num_decodes=batch,
                             decode_block_tables=tables.int() if attn.name == "flash" else tables,
                             decode_seq_lens=lens, decode_mask=mask if attn.name == "sdpa" else None, prefills=[],
                             scale=128 ** -0.5)
    ids = torch.randint(0, 128256, (batch,), device=dev)
    pos = torch.full((batch,), context - 1, device=dev)

    def timed(fn, n: int = 10) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t) / n

    with torch.inference_mode():
        step = timed(lambda: model.compute_logits(model(ids, pos, kv, meta, attn)))
        out = {"backend": attn.name, "batch": batch, "context": context, "step_ms": step * 1e3, "tok_s": batch / step}
        if attn.name == "flash":  # decode CUDA graph of this batch, padding into the spare last block
            from tokenflow_ray.runner.cuda_graphs import CopyInInputs, DecodeGraphs, run_copied_in

            inputs = CopyInInputs(batch, width, block, scratch_block=nblocks - 1, device=dev, scale=meta.scale)
            graphs = DecodeGraphs(lambda i, p, m: model(i, p, kv, m, attn), [batch], inputs.views)
            eager_h = model(ids, pos, kv, meta, attn)
            graph_h = run_copied_in(graphs, inputs, ids, pos, meta)
            out["graph_vs_eager_max_abs"] = float((graph_h.float() - eager_h.float()).abs().max())
            g_step = timed(lambda: model.compute_logits(run_copied_in(graphs, inputs, ids, pos, meta)))
            out.update(graph_step_ms=g_step * 1e3, graph_tok_s=batch / g_step)
    # HBM roofline: every weight but the embedding and the whole context's KV read once per step
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed"))
    kv_bytes = batch * context * 32 * 2 * 8 * 128 * 2
    bw = hbm_bandwidth(dev)
    roof_ms = (weight_bytes + kv_bytes) / bw * 1e3
    best = min(out["step_ms"], out.get("graph_step_ms", out["step_ms"]))
    out.update(hbm_gb_s=bw / 1e9, roofline_ms=roof_ms, of_roofline=roof_ms / best)
    return out


def hbm_bandwidth(device: torch.device, mb: int = 1024) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    x = torch.empty(mb * 2 ** 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def kv_copy_overlap(device: str = "cuda", blocks: int = 16) -> dict:
    """KVTransfer's evict/load streams beside compute: a step's worth of matmuls alone, the same with 2x`blocks`
    8B-shaped KV blocks (256 tokens) copied out and in per launch, and the copies alone; the join must not stall
    the host before compute (launch_ms is the host time to enqueue everything)."""
    from tokenflow_ray.engine.plan import BlockCopy, StepPlan
    from tokenflow_ray.runner.kv_transfer import KVTransfer

    dev = torch.device(device)
    pool = KVPool(32, 4 * blocks, 256, 8, 128, torch.bfloat16, dev)
    pool.tensor.normal_()
    transfer = KVTransfer(pool, num_host_blocks=2 * blocks)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    plan = StepPlan(0, write_through=tuple(BlockCopy("a", i, i) for i in range(blocks)),
                    swap_in=tuple(BlockCopy("b", 2 * blocks + i, blocks + i) for i in range(blocks)))

    def compute() -> None:
        for _ in range(20):
            a @ a

    def timed(fn) -> float:
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t

    launch_s: list[float] = []

    def both() -> None:
        t = time.perf_counter()
        handle = transfer.launch(plan)
        launch_s.append(time.perf_counter() - t)
        compute()
        transfer.wait(handle)

    compute(), both()
    t_compute = timed(compute)
    t_copy = timed(lambda: transfer.wait(transfer.launch(plan)))
    t_both = timed(both)
    loaded = pool.blocks(torch.arange(2 * blocks, 3 * blocks, device=dev))
    host = torch.stack([transfer.host_block(blocks + i) for i in range(blocks)]).to(dev)
    roundtrip = float((loaded.float() - host.float()).abs().max())
    return {"compute_s": t_compute, "copy_s": t_copy, "both_s": t_both, "launch_ms": launch_s[-1] * 1e3,
            "overlap_fraction": (t_compute + t_copy - t_both) / min(t_compute, t_copy),
            "copy_gb_s": 2 * blocks * transfer.block_bytes / t_copy / 1e9, "load_matches_host_max_abs": roundtrip}
