"""The decode CUDA graphs' logic on CPU, with an eager stand-in for capture: a step of D decodes runs the
smallest captured batch >= D, gives the eager forward's hidden states for its D rows, and its padding rows touch
only the scratch block. (Capturing real graphs needs a GPU: jobs/gpu_check.py.)"""

from __future__ import annotations

import pytest
import torch

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig
from tokenflow_ray.runner.attention import AttentionMetadata
from tokenflow_ray.runner.cuda_graphs import DecodeGraphs, eager_capture
from tokenflow_ray.runner.model_runner import TorchModelRunner


def _decode_batch(d: int, bs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3 * bs, (d,), generator=g)
    width = int(max(-(-int(n) // bs) for n in lens))
    tables = (torch.randperm(31, generator=g)[:d * width] + 1).view(d, width)  # block 0 is the scratch block
    pos = lens - 1
    slots = tables.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=d, decode_block_tables=tables,
                             decode_seq_lens=lens.int(), decode_mask=None, prefills=[], scale=0.25)
    return torch.randint(0, 256, (d,), generator=g), pos, meta


@pytest.mark.parametrize("d", [1, 3, 5, 8])
def test_padded_graph_step_equals_the_eager_step(tiny_llama_dir, d):
    bs = 4
    runner = TorchModelRunner(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32",
                                                             device="cpu"),
                                           cache=CacheConfig(block_size=bs, num_device_blocks=32)))
    torch.manual_seed(0)
    runner.kv.tensor.normal_()
    kv_ref = runner.kv.tensor.clone()
    ref_layers = tuple((kv_ref[i, 0], kv_ref[i, 1]) for i in range(kv_ref.shape[0]))  # layer-major on CPU
    model, backend = runner.model, runner.backend

    def forward(ids, pos, meta, kv=runner.kv.layers):
        return model(ids, pos, kv, meta, backend)

    with torch.inference_mode():
        graphs = DecodeGraphs(forward, sizes=(2, 4, 8), max_blocks_per_seq=8, block_size=bs, scratch_block=0,
                              device=torch.device("cpu"), scale=0.25, table_dtype=torch.long,
                              capture=eager_capture)
        runner.kv.tensor.copy_(kv_ref)  # capture's warm-up wrote the scratch block only; start both from one state
        ids, pos, meta = _decode_batch(d, bs, seed=d)
        want = forward(ids, pos, meta, kv=ref_layers)
        got = graphs.run(ids, pos, meta)
    assert graphs.padded_size(d) == next(b for b in (2, 4, 8) if b >= d)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    changed = (runner.kv.tensor != kv_ref).flatten(3).any(-1).any(0).any(0)  # [blocks, block_size]
    changed[0] = False  # the scratch block is the padding rows'
    assert not changed.any()
    assert graphs.padded_size(9) is None and graphs.run(*_decode_batch(9, bs, seed=9)) is None


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="graph sizes"):
        DecodeGraphs(lambda *a: None, sizes=(), max_blocks_per_seq=4, block_size=4, scratch_block=0,
                     device=torch.device("cpu"), scale=1.0, capture=eager_capture)


def test_gpu_defaults_pick_a_flash_block_size_and_keep_the_pool():
    from tokenflow_ray.runner.model_runner import FLASH_BLOCK_SIZE, gpu_cache_defaults

    base = EngineConfig(cache=CacheConfig(num_device_blocks=1024, num_host_blocks=100))
    gpu = gpu_cache_defaults(base, cuda=True, flash=True)
    assert gpu.cache.block_size == FLASH_BLOCK_SIZE
    assert gpu.cache.num_device_blocks * FLASH_BLOCK_SIZE == 1024 * 16  # same tokens on the device
    assert gpu.cache.num_host_blocks * FLASH_BLOCK_SIZE >= 100 * 16
    assert gpu_cache_defaults(base, cuda=False, flash=True) is base  # CPU: unchanged
    assert gpu_cache_defaults(base, cuda=True, flash=False) is base  # no flash-attn: SDPA at 16
    manual = EngineConfig(cache=CacheConfig(block_size=32))
    assert gpu_cache_defaults(manual, cuda=True, flash=True) is manual  # a block size set by hand stays
    sdpa = EngineConfig(model=ModelConfig(attention_backend="sdpa"))
    assert gpu_cache_defaults(sdpa, cuda=True, flash=True) is sdpa
