"""The KV pool's two layouts hold the same blocks: a block-major block is one contiguous region, each layer's view is
the same [blocks, block_size, kv_heads, head_dim] tensor whichever the layout, and the config refuses other names."""

from __future__ import annotations

import pytest
import torch

from tokenflow_ray.engine.config import CacheConfig
from tokenflow_ray.runner.kv_pool import KVPool


def _fill(pool: KVPool) -> None:
    """Every element names its (layer, K/V, block, offset, head, dim) through the layer views only."""
    for i, (k, v) in enumerate(pool.layers):
        for kv, t in ((0, k), (1, v)):
            t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1e6 * (2 * i + kv))


@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_layouts_hold_the_same_blocks(layout):
    ref = KVPool(3, 5, 4, 2, 8, torch.float32, torch.device("cpu"), layout="layer_major")
    pool = KVPool(3, 5, 4, 2, 8, torch.float32, torch.device("cpu"), layout=layout)
    _fill(ref), _fill(pool)
    assert pool.layout == layout and pool.block_major == (layout == "block_major")
    for b in range(5):
        assert torch.equal(pool.block(b), ref.block(b))
        assert pool.block(b).shape == (3, 2, 4, 2, 8)
        assert pool.block(b).is_contiguous() == pool.block_major  # one DMA a block on CUDA
    ids = torch.tensor([4, 0, 2])
    assert torch.equal(pool.blocks(ids), torch.stack([ref.block(4), ref.block(0), ref.block(2)]))
    assert pool.block_bytes == 3 * 2 * 4 * 2 * 8 * 4
    for (k, v), (rk, rv) in zip(pool.layers, ref.layers):
        assert k.shape == (5, 4, 2, 8) and torch.equal(k, rk) and torch.equal(v, rv)


def test_auto_layout_follows_the_device():
    assert not KVPool(1, 2, 4, 1, 8, torch.float32, torch.device("cpu")).block_major
    with pytest.raises(ValueError, match="kv_layout"):
        KVPool(1, 2, 4, 1, 8, torch.float32, torch.device("cpu"), layout="rows")
    with pytest.raises(ValueError, match="kv_layout"):
        CacheConfig(kv_layout="rows")
