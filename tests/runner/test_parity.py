"""Greedy output is token-identical to HF `generate`: batched, chunk-prefilled, joining mid-batch, preempted."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.layers.cpu_kernels import compiler_available
from tokenflow_ray.layers.packed_linear import resolve_cpu_gemm
from tokenflow_ray.runner.factory import build_engine

NEW_TOKENS = 24


def _prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 60))] for _ in range(n)]


@functools.lru_cache(maxsize=4)
def _hf_reference_cached(model_dir, prompts_key):
    return _hf_reference(model_dir, [list(p) for p in prompts_key])


def _hf_reference(model_dir, prompts, n=NEW_TOKENS):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.inference_mode():
        for p in prompts:  # one at a time: no padding in the reference
            x = torch.tensor([p])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=258)
            refs.append(out[0, len(p):].tolist())
    return refs


def _engine(model_dir, budget=512, blocks=256, chunked=True, max_seqs=16, block_size=16, fused=True,
            overlap=False, gemm="auto", layout="auto"):
    return build_engine(EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu", fused_cpu_ops=fused, cpu_gemm=gemm),
        cache=CacheConfig(block_size=block_size, num_device_blocks=blocks, kv_layout=layout),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, chunked_prefill=chunked),
        overlap_scheduling=overlap))


def _run(engine, prompts, join_at: dict[int, int] | None = None) -> list[list[int]]:
    """Add prompts (some only at a later step), step to completion with integrity checks, return tokens."""
    join_at = join_at or {}
    sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ids: dict[int, str] = {}
    tokens: dict[str, list[int]] = {}
    for step in range(10_000):
        for i, p in enumerate(prompts):
            if i not in ids and join_at.get(i, 0) <= step:
                ids[i] = engine.add_request(p, sp)
        if len(ids) == len(prompts) and not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
        engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks
    return [tokens[ids[i]] for i in range(len(prompts))]


@pytest.mark.parametrize("ops", ["fused", "reference", "fused_overlapped", "fused_onednn", "block_major"])
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("mode", ["batched", "chunked_small_budget", "unchunked", "join_mid_batch",
                                  "preempt_recompute"])
def test_greedy_matches_hf_generate(model, mode, ops, request):
    """`fused`: the C++ small ops (the default on CPU fp32); `reference`: one torch op per step of HF's math;
    `fused_overlapped`: with overlapped scheduling (each step planned while the one before runs); `fused_onednn`:
    the linear layers on oneDNN's GEMM rather than the default (the panel GEMM on AVX-512 CPUs); `block_major`:
    the KV pool in CUDA's layout (a block of every layer contiguous, each layer's view strided), which the CPU's
    compiled kernels do not read, so the reference ops and SDPA run over it."""
    model_dir = request.getfixturevalue(model)
    prompts = _prompts()
    refs = _hf_reference_cached(str(model_dir), tuple(map(tuple, prompts)))
    kw = dict(fused=ops != "reference", overlap=ops == "fused_overlapped",
              gemm="onednn" if ops == "fused_onednn" else "auto",
              layout="block_major" if ops == "block_major" else "auto")
    if mode == "batched":
        engine, join = _engine(model_dir, **kw), None
    elif mode == "chunked_small_budget":
        engine, join = _engine(model_dir, budget=16, block_size=8, **kw), None
    elif mode == "unchunked":
        engine, join = _engine(model_dir, budget=128, chunked=False, **kw), None
    elif mode == "join_mid_batch":
        engine, join = _engine(model_dir, budget=32, **kw), {2: 5, 3: 9, 4: 17}
    else:  # a pool too small for all streams at full length: recompute preemption must happen
        engine, join = _engine(model_dir, blocks=14, block_size=8, budget=64, **kw), None
    assert engine.runner.kv.block_major == (ops == "block_major")
    if ops == "block_major":
        assert engine.runner.backend.name == "sdpa" and not engine.runner.fused_ops
        assert not engine.runner.kv.layers[0][0].is_contiguous()  # strided over blocks, as on CUDA
    assert engine.runner.fused_ops == (ops not in ("reference", "block_major")) or not compiler_available()
    assert engine.runner.gemm == resolve_cpu_gemm(kw["gemm"])
    assert _run(engine, prompts, join) == refs


def test_seeded_sampling_is_batch_independent(tiny_llama_dir):
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=42)
    prompts = _prompts(4, seed=3)
    alone = _engine(tiny_llama_dir).generate([prompts[0]], sp)[0].token_ids
    batched = _engine(tiny_llama_dir).generate(prompts, [sp] + [SamplingParams(max_tokens=16, temperature=1.0)] * 3)
    assert batched[0].token_ids == alone


def test_embedded_model_text_roundtrip(embedded_dir):
    engine = _engine(embedded_dir)
    res = engine.generate(["Hello, wörld — 😀"], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert len(res.token_ids) == 40
    assert res.text.encode("utf-8").decode("utf-8") == res.text  # valid UTF-8, never a broken sequence
    assert engine.tokenizer.decode(list(res.prompt_token_ids), skip_special_tokens=True) == "Hello, wörld — 😀"


def test_stop_string_is_cut_and_blocks_freed(embedded_dir):
    engine = _engine(embedded_dir)
    full = engine.generate(["abc"], SamplingParams(max_tokens=30, ignore_eos=True))[0].text
    assert len(full) > 6
    stop = full[3:6]
    res = engine.generate(["abc"], SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))[0]
    assert res.finish_reason == "stop" and res.text == full[:full.index(stop)]
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="model"):
        _engine(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        _engine(tmp_path / "empty")


def test_prompt_longer_than_context_is_rejected(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, blocks=64)
    ok = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([5] * 600, SamplingParams(max_tokens=4))  # model context is 512
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.stream_id == ok for t in o.token_ids]
    assert len(tokens) == 4
