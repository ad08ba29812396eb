"""The device KV pool: one tensor for every layer's K and V, and the per-layer views attention reads.

Two layouts, one interface:
- layer-major `[layers, 2, blocks, block_size, kv_heads, head_dim]`: a layer's K (or V) is one contiguous
  `[blocks, block_size, kv_heads, head_dim]` tensor. The CPU default: the compiled CPU kernels and the numpy copy
  path read it in place.
- block-major `[blocks, layers, 2, block_size, kv_heads, head_dim]`: one block of every layer is one contiguous
  region (2 MiB for Llama-3-8B at 16 tokens), so a block moves to or from the host spill store as one DMA instead of
  `2 x layers` strided pieces gathered into a temporary (vLLM's offloading blocks, made contiguous across layers
  for the same reason). The CUDA default. A layer's K/V views are then strided over blocks; the attention backends
  that run on it take strides (torch indexing, the Triton kernels, flash-attn's paged kernel).

`CacheConfig.kv_layout` picks one (auto: by device), so CPU tests run the CUDA layout too.
"""

from __future__ import annotations

import torch

from tokenflow_ray.engine.config import KV_LAYOUTS


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, layout: str = "auto") -> None:
        if layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {layout!r}")
        self.block_major = layout == "block_major" or (layout == "auto" and device.type == "cuda")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        inner = (block_size, kv_heads, head_dim)
        shape = (num_blocks, num_layers, 2, *inner) if self.block_major else (num_layers, 2, num_blocks, *inner)
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        t = self.tensor
        # Made once: the model reads them every step (three view ops a layer a step otherwise).
        self.layers: tuple[tuple[torch.Tensor, torch.Tensor], ...] = tuple(
            (t[:, i, 0], t[:, i, 1]) if self.block_major else (t[i, 0], t[i, 1]) for i in range(num_layers))
        self.block_bytes = num_layers * 2 * block_size * kv_heads * head_dim * t.element_size()

    @property
    def layout(self) -> str:
        return "block_major" if self.block_major else "layer_major"

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def block(self, block: int) -> torch.Tensor:
        """One block of every layer, `[layers, 2, block_size, kv_heads, head_dim]` (contiguous when block-major)."""
        return self.tensor[block] if self.block_major else self.tensor[:, :, block]

    def blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """A copy of these blocks, block-major: `[n, layers, 2, block_size, kv_heads, head_dim]`."""
        if self.block_major:
            return self.tensor.index_select(0, ids)
        return self.tensor.index_select(2, ids).movedim(2, 0)
