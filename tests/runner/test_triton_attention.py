"""The Triton paged-attention kernels under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors), against a
float64 reference: the KV write and attention over every layout case (GQA groups 1/2/4, head dims 16/64/128,
ragged lengths, partly filled blocks, tables with holes and non-monotone block ids, both pool layouts, decode with
and without split-KV, prefill from position 0 and continuing a prefix, several sequences in one launch), fp32 and
fp16. Tiny shapes: the interpreter runs programs one after another."""

from __future__ import annotations

import os

import pytest
import torch

from tokenflow_ray.layers.attention import AttentionMetadata, SdpaPagedAttention
from tokenflow_ray.layers.triton_attention import TritonPagedAttention, triton_available
from tokenflow_ray.runner.kv_pool import KVPool

if not triton_available():
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the Triton kernel tests: install the dev extra (triton)")
    pytest.skip("triton is not installed", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    """The Triton backend runs on CPU tensors only when the interpreter is asked for. triton is imported first:
    imported under TRITON_INTERPRET=1, its own library would be interpreted for compiled (CUDA) kernels too."""
    import triton.language  # noqa: F401

    monkeypatch.setenv("TRITON_INTERPRET", "1")

CPU = torch.device("cpu")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pool(layout: str, blocks: int, bs: int, kvh: int, hd: int, dtype, g: torch.Generator, device=CPU):
    """Layer 1 of a 2-layer pool, random: block-major views are strided over blocks, as on CUDA."""
    pool = KVPool(2, blocks, bs, kvh, hd, dtype, device, layout)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=g).to(dtype))
    k, v = pool.layers[1]
    assert k.is_contiguous() == (layout == "layer_major")
    return pool, k, v


def _step(seqs, bs: int, blocks: int, rows: int, heads: int, kvh: int, hd: int, dtype, g: torch.Generator):
    """seqs: (context before the step, tokens this step) per sequence, decodes first. Each gets a random,
    non-monotone set of blocks out of the pool (the rest are holes) in a random row of a persistent table whose
    unused entries are garbage block ids."""
    need = [-(-(c + n) // bs) for c, n in seqs]
    perm = torch.randperm(blocks, generator=g)
    assert sum(need) <= blocks
    width = max(need) + 2
    tables = torch.randint(0, blocks, (rows, width), generator=g)
    seq_rows = torch.randperm(rows, generator=g)[:len(seqs)]
    used = 0
    slots, starts = [], [0]
    for (c, n), k, r in zip(seqs, need, seq_rows.tolist()):
        tables[r, :k] = perm[used:used + k]
        used += k
        slots += [int(tables[r, p // bs]) * bs + p % bs for p in range(c, c + n)]
        starts.append(starts[-1] + n)
    T = starts[-1]
    q = torch.randn(T, heads + 2 * kvh, hd, generator=g).to(dtype)  # a fused QKV output: strided views
    return dict(q=q[:, :heads], k=q[:, heads:heads + kvh], v=q[:, heads + kvh:], tables=tables,
                seq_rows=seq_rows, slots=torch.tensor(slots), starts=starts)





def _meta(seqs, st, scale: float, decodes: int) -> AttentionMetadata:
    dev = st["slots"].device
    return AttentionMetadata(
        slot_mapping=st["slots"], num_decodes=decodes, decode_block_tables=None, decode_seq_lens=None,
        decode_mask=None, prefills=[], scale=scale, block_tables=st["tables"], seq_rows=st["seq_rows"],
        seq_lens=torch.tensor([c + n for c, n in seqs], device=dev),
        query_start=torch.tensor(st["starts"], device=dev), max_query_len=max(n for _, n in seqs),
        num_seqs=len(seqs))


def _reference(seqs, st, k_cache, v_cache, scale: float) -> torch.Tensor:
    """float64 on the CPU: each sequence's keys gathered through its table, causal from its context length."""
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    st = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
    q = st["q"].double()
    T, H, hd = q.shape
    group = H // k_cache.shape[2]
    bs = k_cache.shape[1]
    out = torch.zeros(T, H, hd, dtype=torch.float64)
    for (c, n), r, t0 in zip(seqs, st["seq_rows"].tolist(), st["starts"]):
        L = c + n
        blocks = st["tables"][r, :-(-L // bs)]
        k = k_cache[blocks].flatten(0, 1)[:L].double().repeat_interleave(group, dim=1)  # [L, H, hd]
        v = v_cache[blocks].flatten(0, 1)[:L].double().repeat_interleave(group, dim=1)
        s = torch.einsum("nhd,lhd->hnl", q[t0:t0 + n], k) * scale
        pos = torch.arange(c, L)[:, None]
        s = s.masked_fill(torch.arange(L)[None, :] > pos, float("-inf"))
        out[t0:t0 + n] = torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)
    return out


def _run_case(seqs, *, heads, kvh, hd, dtype, layout, bs=4, splits=None, seed=0, device=CPU):
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-(c + n) // bs) for c, n in seqs) + 5
    pool, k_cache, v_cache = _pool(layout, blocks, bs, kvh, hd, dtype, g, device)
    st = _step(seqs, bs, blocks, rows=len(seqs) + 3, heads=heads, kvh=kvh, hd=hd, dtype=dtype, g=g)
    st = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
    decodes = sum(1 for _, n in seqs if n == 1)
    meta = _meta(seqs, st, hd ** -0.5, decodes)
    before = pool.tensor.clone()
    # The KV write alone first: exactly the step's slots of layer 1's K and V change.
    attn = TritonPagedAttention(device, decode_splits=splits)
    attn.write_kv(st["k"], st["v"], k_cache, v_cache, meta.slot_mapping)
    slots = meta.slot_mapping
    want = before.clone()
    wk, wv = (want[:, 1, 0], want[:, 1, 1]) if pool.block_major else (want[1, 0], want[1, 1])
    wk[slots // bs, slots % bs] = st["k"]
    wv[slots // bs, slots % bs] = st["v"]
    assert torch.equal(pool.tensor, want)
    ref = _reference(seqs, st, k_cache, v_cache, meta.scale)
    meta.kv_written = True
    out = attn.forward(st["q"], None, None, k_cache, v_cache, meta).view(ref.shape)
    err = (out.double().cpu() - ref).abs().max().item()
    assert err < TOL[dtype], err
    assert torch.equal(pool.tensor, want)  # attention reads the pool only
    return attn


# (context before the step, tokens this step): ragged lengths, blocks partly filled, one block exactly full.
DECODES = [(0, 1), (6, 1), (3, 1), (12, 1), (17, 1)]
MIXED = [(4, 1), (9, 1), (0, 7), (5, 6), (0, 2)]  # decodes, a prompt from 0, a chunk continuing 5 tokens
LONG = [(2, 1), (0, 13), (7, 19)]  # chunks long enough for the 64-row tiles: the decodes get their own launch

SHAPES = [dict(heads=2, kvh=2, hd=16), dict(heads=4, kvh=2, hd=16), dict(heads=8, kvh=2, hd=16),
          dict(heads=4, kvh=1, hd=64), dict(heads=8, kvh=2, hd=128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout", ["block_major", "layer_major"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s['heads']}kv{s['kvh']}d{s['hd']}")
@pytest.mark.parametrize("case", ["decode", "decode_split", "mixed", "long"])
def test_kernels_match_the_float64_reference(case, shape, layout, dtype):
    seqs = {"decode": DECODES, "decode_split": DECODES, "mixed": MIXED, "long": LONG}[case]
    _run_case(seqs, dtype=dtype, layout=layout, splits=4 if case == "decode_split" else 1, **shape)


@pytest.mark.parametrize("case", ["decode_split", "mixed", "long", "prefill_only"])
def test_a_group_of_three_heads_and_prefill_only_steps(case):
    """A query group that is not a power of two (Qwen2.5-32B has 5): tiles of 3 x 5 and 12 x 5 rows with the rest
    masked; and steps without decodes, in small and large tiles."""
    seqs = {"decode_split": DECODES, "mixed": MIXED, "long": LONG, "prefill_only": [(0, 13), (7, 19)]}[case]
    for heads, kvh in ((6, 2), (10, 2)):
        _run_case(seqs, heads=heads, kvh=kvh, hd=16, dtype=torch.float32, layout="block_major",
                  splits=4 if case == "decode_split" else 1)


def test_split_count_follows_the_batch_not_the_lengths():
    attn = TritonPagedAttention(CPU)
    attn.num_sms = 132
    assert attn.splits_for(1, 8) == 16 and attn.splits_for(32, 8) == 4 and attn.splits_for(256, 8) == 1
    assert all(attn.splits_for(b, 8) & (attn.splits_for(b, 8) - 1) == 0 for b in range(1, 300))
    with pytest.raises(ValueError, match="decode_splits"):
        TritonPagedAttention(CPU, decode_splits=3)


def test_more_splits_than_tiles_and_a_one_token_context():
    """16 splits over contexts of 1-18 tokens (one or two 64-key tiles): most splits are empty and must weigh
    nothing in the reduce."""
    _run_case([(0, 1), (17, 1)], heads=4, kvh=2, hd=16, dtype=torch.float32, layout="block_major", splits=16)


def test_matches_sdpa_on_the_per_step_metadata_form():
    """The gathered-table form the SDPA backend reads (and the device checks build) converts to the varlen form."""
    from tokenflow_ray.runner.gpu_check import _random_paged_batch

    q, k, v, kc, vc, meta = _random_paged_batch(CPU, torch.float32, block_size=8, heads=4, kv_heads=2,
                                                head_dim=16, decodes=3, chunk=6)
    want = SdpaPagedAttention().forward(q, k, v, kc.clone(), vc.clone(), meta)
    got = TritonPagedAttention(CPU).forward(q, k, v, kc.clone(), vc.clone(), meta)
    assert meta.num_seqs == 4 and meta.max_query_len == 6
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- the engine on the Triton backend ------------------------------------------------------------------------
ENGINE_TOKENS = 8


def _engine_run(engine, prompts) -> list[list[int]]:
    from tokenflow_ray.engine.sampling import SamplingParams

    sp = SamplingParams(max_tokens=ENGINE_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.stream_id].extend(out.token_ids)
        engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks
    return [tokens[i] for i in ids]


@pytest.mark.parametrize("mode", ["eager", "staged_graphs_overlapped"])
def test_engine_on_triton_matches_hf_generate(tiny_llama_dir, mode):
    """Greedy through LLMEngine on the Triton kernels (block-major pool, chunked prefill with a 16-token budget, a
    pool small enough to force recompute preemption) is token-identical to HF `generate`. staged_graphs_overlapped
    is the CUDA path on CPU: one staged copy a step, decode steps replayed through (eager stand-in) graphs with
    padding rows, PENDING tokens filled on the device under overlapped scheduling, the warm-up steps first."""
    from tests.runner.test_parity import _hf_reference, _prompts
    from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tokenflow_ray.engine.llm_engine import LLMEngine
    from tokenflow_ray.runner.cuda_graphs import eager_capture
    from tokenflow_ray.runner.model_runner import RunnerOptions, TorchModelRunner

    prompts = _prompts(4)
    refs = _hf_reference(str(tiny_llama_dir), prompts, n=ENGINE_TOKENS)
    staged = mode != "eager"
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", attention_backend="triton"),
        cache=CacheConfig(block_size=8, num_device_blocks=10, kv_layout="block_major"),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), overlap_scheduling=staged)
    options = RunnerOptions(staged=True, graph_capture=eager_capture, warm_up=True) if staged else RunnerOptions()
    runner = TorchModelRunner(config, options=options)
    assert runner.backend.name == "triton" and runner.kv.block_major
    assert (runner.graphs is not None) == staged and (runner.batch.staging is not None) == staged
    scratch = config.cache.num_device_blocks
    if staged:  # warm-up and capture wrote the scratch block only
        assert not runner.kv.tensor[:scratch].any() and runner.kv.tensor[scratch].any()
    counts = _count_steps(runner)
    engine = LLMEngine(runner.config, runner, runner.tokenizer)
    assert _engine_run(engine, prompts) == refs
    assert engine.stats().preemptions > 0
    if staged:
        _check_one_copy_one_read(runner, counts)
        assert sum(graph.replays for graph, _ in runner.graphs._graphs.values()) > 0


def _count_steps(runner) -> dict:
    """Counts the plans that run a forward and those that sample, from now on (the runner's execute wrapped)."""
    counts = {"forwards": 0, "sampling": 0, "copies": runner.batch.staging.copies if runner.batch.staging else 0,
              "syncs": runner.host_syncs}
    execute = runner.execute

    def counted(plan):
        counts["forwards"] += bool(plan.decodes or plan.prefills)
        counts["sampling"] += any(c.sample for c in (*plan.decodes, *plan.prefills))
        return execute(plan)

    runner.execute = counted
    return counts


def _check_one_copy_one_read(runner, counts: dict) -> None:
    assert runner.batch.staging.copies - counts["copies"] == counts["forwards"]  # one host->device copy a step
    assert runner.host_syncs - counts["syncs"] == counts["sampling"]  # one device->host read a sampling step


# ---- on a GPU (opt-in: pytest -m gpu): the compiled kernels, at the serving shapes ---------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_compiled_kernels_match_the_reference_on_cuda(dtype, splits):
    """Llama-3-8B's head layout (32 query heads, 8 KV heads, head_dim 128), block 16, a block-major pool:
    decodes of 1 to 700 tokens of context, then the same batch with prefill chunks from 0 and continuing."""
    cuda = torch.device("cuda")
    shape = dict(heads=32, kvh=8, hd=128, dtype=dtype, layout="block_major", bs=16, device=cuda)
    decodes = [(0, 1), (15, 1), (16, 1), (255, 1), (700, 1)]
    _run_case(decodes, splits=splits, **shape)
    _run_case(decodes + [(0, 200), (333, 90), (16, 2)], splits=1 if splits is None else splits, **shape)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_engine_on_cuda_defaults_to_triton_and_matches_hf(tiny_llama_dir, overlap):
    """The CUDA defaults without flash-attn (Triton kernels, block-major pool, staged inputs, decode graphs after the
    warm-up), fp32: greedy token-identical to HF `generate` on the same GPU, through chunked prefill and recompute
    preemption; one staged copy a forward, one device->host read a sampling step."""
    from transformers import AutoModelForCausalLM

    from tests.runner.test_parity import _prompts
    from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tokenflow_ray.engine.llm_engine import LLMEngine
    from tokenflow_ray.layers.attention_select import flash_attn_available
    from tokenflow_ray.runner.model_runner import TorchModelRunner

    if flash_attn_available():
        pytest.skip("auto picks flash-attn here")
    prompts = _prompts(4)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).cuda().eval()
    refs = []
    with torch.inference_mode():
        for p in prompts:
            x = torch.tensor([p], device="cuda")
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=ENGINE_TOKENS,
                              min_new_tokens=ENGINE_TOKENS, do_sample=False, pad_token_id=258)
            refs.append(out[0, len(p):].tolist())
    config = EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cuda"),
                          cache=CacheConfig(block_size=8, num_device_blocks=10),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                          overlap_scheduling=overlap)
    runner = TorchModelRunner(config)
    assert runner.backend.name == "triton" and runner.graphs is not None and runner.kv.block_major
    counts = _count_steps(runner)
    engine = LLMEngine(runner.config, runner, runner.tokenizer)
    assert _engine_run(engine, prompts) == refs
    assert engine.stats().preemptions > 0
    _check_one_copy_one_read(runner, counts)
