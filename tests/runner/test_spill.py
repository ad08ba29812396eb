"""Real KV copies: streams paused to the host store and resumed (load or recompute) match HF token for token."""

from __future__ import annotations

import pytest
import torch

from tests.runner.test_parity import NEW_TOKENS, _hf_reference_cached, _prompts
from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.runner.factory import build_engine


def _engine(model_dir, overlap=True, write_through=True, host=256, resume="load", overlap_scheduling=False,
            layout="auto"):
    return build_engine(EngineConfig(
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


def _cuda_path_transfer(layout, dtype, seed):
    """A KVTransfer on the CUDA path (recording stand-ins; the batch call lands copies only when waited for, as a
    GPU's land after the call returns) over a pool that refuses numpy views, as a CUDA tensor does."""
    from tests.runner.fake_cuda import FakeCuda, NoNumpy, RecordingBatchMemcpy
    from tokenflow_ray.runner.kv_pool import KVPool
    from tokenflow_ray.runner.kv_transfer import KVTransfer

    cuda = FakeCuda()
    pool = KVPool(2, 16, 4, 2, 8, dtype, torch.device("cpu"), layout=layout)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    pool.tensor = pool.tensor.as_subclass(NoNumpy)
    transfer = KVTransfer(pool, 16, cuda=cuda, batch_memcpy=RecordingBatchMemcpy(cuda, pool.tensor, defer=True))
    assert transfer.copy_path == "batch"
    return transfer, pool, cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["block_major", "layer_major"])
def test_migration_moves_host_blocks_of_a_cuda_pool_after_the_copies_land(layout, dtype):
    """Export reads host blocks whose copies are still in flight and import writes host blocks that an earlier
    owner's copy is still writing: both settle first, so what moves is exact and nothing lands on top of it."""
    from tokenflow_ray.engine.plan import BlockCopy, StepPlan

    src, src_pool, src_cuda = _cuda_path_transfer(layout, dtype, 0)
    src.launch(StepPlan(0, write_through=(BlockCopy("a", 0, 3), BlockCopy("a", 1, 4)),
                        swap_out=(BlockCopy("a", 2, 5),)))  # not joined: in flight, as after a GPU step's join
    data = src.read_host_blocks([3, 4, 5])
    assert ("stream_sync", src._cuda.evict_stream.name) in src_cuda.log
    as_torch = torch.from_numpy(data).view(dtype) if dtype == torch.bfloat16 else torch.from_numpy(data)
    assert torch.equal(as_torch, src_pool.blocks(torch.tensor([0, 1, 2])))

    dst, dst_pool, _ = _cuda_path_transfer(layout, dtype, 1)
    dst.launch(StepPlan(0, write_through=(BlockCopy("old", 9, 7), BlockCopy("old", 10, 8))))  # a freed owner's
    dst.write_host_blocks([7, 8, 2], data)  # host blocks 7, 8 reused by the import while that copy is in flight
    dst.wait(dst.launch(StepPlan(1, swap_in=(BlockCopy("a", 12, 7), BlockCopy("a", 13, 8), BlockCopy("a", 14, 2)))))
    dst.settle()
    assert torch.equal(dst_pool.blocks(torch.tensor([12, 13, 14])), src_pool.blocks(torch.tensor([0, 1, 2])))
    with pytest.raises(ValueError, match="another model"):
        dst.write_host_blocks([1], data[:1, :1])
    src.close()
    dst.close()
