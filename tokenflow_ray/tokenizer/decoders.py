"""Semantic decoder: a shallow ViT over the quantised semantic codes that regresses the teacher's features
(BEiT-v2 VQ-KD decoder, paper §1: depth 3, then a Linear-Tanh-Linear head out to the teacher width).

The pixel decoder is the VQGAN CNN in pixel.py; the PatchGAN discriminator is its own module in discriminator.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow_ray.tokenizer.config import SemDecoderConfig


class SemanticDecoder(nn.Module):
    def __init__(self, cfg: SemDecoderConfig, code_dim: int, feature_dim: int, grid: int) -> None:
        super().__init__()
        self.grid = grid
        self.embed = nn.Linear(code_dim, cfg.width)
        self.pos_1LD = nn.Parameter(torch.zeros(1, grid * grid, cfg.width).normal_(std=0.02))
        layer = nn.TransformerEncoderLayer(cfg.width, cfg.num_heads, 4 * cfg.width, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, cfg.depth, enable_nested_tensor=False) if cfg.depth else None
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.Tanh(), nn.Linear(cfg.width, feature_dim))

    def _pos(self, h: int, w: int) -> torch.Tensor:
        if (h, w) == (self.grid, self.grid):
            return self.pos_1LD
        # Other resolutions: bicubic-resize the learned grid of position embeddings, as ViTs do.
        pos_1DHW = self.pos_1LD.transpose(1, 2).reshape(1, -1, self.grid, self.grid)
        return F.interpolate(pos_1DHW, size=(h, w), mode="bicubic").flatten(2).transpose(1, 2)

    def forward(self, code_BCHW: torch.Tensor) -> torch.Tensor:
        b, _, h, w = code_BCHW.shape
        x_BLD = self.embed(code_BCHW.flatten(2).transpose(1, 2)) + self._pos(h, w)
        if self.blocks is not None:
            x_BLD = self.blocks(x_BLD)
        out_BLF = self.head(self.norm(x_BLD))
        return out_BLF.transpose(1, 2).reshape(b, -1, h, w)
