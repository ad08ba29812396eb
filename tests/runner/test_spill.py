"""Real KV copies: streams paused to the host store and resumed (load or recompute) match HF token for token."""

from __future__ import annotations

import pytest
import torch

from tests.runner.test_parity import NEW_TOKENS, _hf_reference_cached, _prompts
from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.sampling import SamplingParams


def _engine(model_dir, overlap=True, write_through=True, host=256, resume="load", overlap_scheduling=False,
            layout="auto"):
    return LLMEngine.from_config(EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=8, num_device_blocks=96, num_host_blocks=host, overlap_copies=overlap,
                          write_through=write_through, resume_mode=resume, kv_layout=layout),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, policy="tokenflow"),
        overlap_scheduling=overlap_scheduling))


@pytest.mark.parametrize("mode", ["reload_overlap", "reload_blocking", "write_on_preempt", "recompute",
                                  "reload_overlap_scheduling", "recompute_overlap_scheduling",
                                  "reload_block_major"])
def test_paused_and_resumed_streams_match_hf(tiny_llama_dir, mode):
    """`*_overlap_scheduling`: pauses land between calls while a step is in flight (overlapped scheduling);
    `reload_block_major`: the pool and the host store in CUDA's block-major layout (one contiguous region a block)."""
    prompts = _prompts()
    refs = _hf_reference_cached(str(tiny_llama_dir), tuple(map(tuple, prompts)))
    engine = _engine(tiny_llama_dir, overlap=mode != "reload_blocking", write_through=mode != "write_on_preempt",
                     resume="recompute" if mode.startswith("recompute") else "load",
                     overlap_scheduling=mode.endswith("overlap_scheduling"),
                     layout="block_major" if mode.endswith("block_major") else "auto")
    sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, sp, rate=5.0) for p in prompts]
    tokens: dict[str, list[int]] = {}
    for step in range(2000):
        if not engine.has_unfinished():
            break
        if step % 3 == 2:
            for sid in ids[::2]:  # pause every other stream every third step
                engine.scheduler.preempt(sid, engine.clock.now())
        for out in engine.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
        engine.check_integrity()
    assert [tokens[i] for i in ids] == refs
    assert (engine.scheduler.bytes_from_host == 0) == mode.startswith("recompute")
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.scheduler.kv.host.num_free == engine.scheduler.kv.host.num_blocks
    assert engine.scheduler.bytes_to_host > 0


def test_write_through_copies_real_kv(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    sid = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=4, ignore_eos=True), rate=5.0)
    engine.step()  # prefill: 39 tokens, 4 full blocks of 8
    stream = engine.scheduler.streams[sid]
    engine.step()  # write-through of the full blocks runs beside this decode step
    assert stream.num_host_tokens >= 32
    runner = engine.runner
    for i in range(stream.num_host_tokens // 8):
        dev = runner.kv.block(stream.block_ids[i])
        host = runner.transfer.host_block(stream.host_block_ids[i])
        assert torch.equal(dev, host) and host.abs().sum() > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_kv_transfer_roundtrip_of_the_gpu_check_runs_on_cpu(overlap):
    from tokenflow_ray.runner.gpu_check import kv_transfer_roundtrip

    result = kv_transfer_roundtrip("cpu", overlap=overlap)
    assert result["max_abs"] == 0.0 and result["tails_timed"] == ["a", "b"] and result["blocks"] == 5
