"""Pixel branch: the VQGAN/LlamaGen CNN encoder and decoder (paper §1), sized by PixelConfig.

Encoder: conv_in, per level `num_res_blocks` ResBlocks then a stride-2 downsample (none after the last level),
a mid block (ResBlock, optional attention, ResBlock), GroupNorm-SiLU-conv to z_channels, then a 1x1 conv to the 8-d
pixel code. Decoder mirrors it from the 8-d code with `dec_num_res_blocks` per level and nearest-neighbour upsampling.
Modified from taming-transformers / LlamaGen (architecture only; written fresh here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow_ray.tokenizer.config import PixelConfig


def _norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, c) if c % min(32, c) == 0 else 1, c, eps=1e-6)


class ResBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(_norm(c_in), nn.SiLU(), nn.Conv2d(c_in, c_out, 3, 1, 1),
                                   _norm(c_out), nn.SiLU(), nn.Conv2d(c_out, c_out, 3, 1, 1))
        self.skip = nn.Identity() if c_in == c_out else nn.Conv2d(c_in, c_out, 1)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self.skip(x_BCHW) + self.block(x_BCHW)


class AttnBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = _norm(c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x_BCHW.shape
        q, k, v = self.qkv(self.norm(x_BCHW)).reshape(b, 3, c, h * w).transpose(-1, -2).unbind(1)
        out_BLC = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)).squeeze(1)
        return x_BCHW + self.proj(out_BLC.transpose(1, 2).reshape(b, c, h, w))


def _mid(c: int, attn: bool) -> nn.Sequential:
    return nn.Sequential(ResBlock(c, c), AttnBlock(c) if attn else nn.Identity(), ResBlock(c, c))


class PixelEncoder(nn.Module):
    def __init__(self, cfg: PixelConfig) -> None:
        super().__init__()
        chans = [cfg.ch * m for m in cfg.ch_mult]
        layers: list[nn.Module] = [nn.Conv2d(3, cfg.ch, 3, 1, 1)]
        c = cfg.ch
        for level, c_out in enumerate(chans):
            for _ in range(cfg.num_res_blocks):
                layers.append(ResBlock(c, c_out))
                c = c_out
            if level < len(chans) - 1:
                layers.append(nn.Conv2d(c, c, 3, 2, 1))  # stride-2 downsample
        layers += [_mid(c, cfg.attn_at_lowest), _norm(c), nn.SiLU(), nn.Conv2d(c, cfg.z_channels, 3, 1, 1),
                   nn.Conv2d(cfg.z_channels, cfg.code_dim, 1)]  # the last 1x1 conv is the quant_conv to 8-d
        self.net = nn.Sequential(*layers)

    def forward(self, img_BCHW: torch.Tensor) -> torch.Tensor:
        return self.net(img_BCHW)


class PixelDecoder(nn.Module):
    def __init__(self, cfg: PixelConfig) -> None:
        super().__init__()
        chans = [cfg.ch * m for m in cfg.ch_mult][::-1]
        c = chans[0]
        layers: list[nn.Module] = [nn.Conv2d(cfg.code_dim, cfg.z_channels, 1), nn.Conv2d(cfg.z_channels, c, 3, 1, 1),
                                   _mid(c, cfg.attn_at_lowest)]
        for level, c_out in enumerate(chans):
            for _ in range(cfg.dec_num_res_blocks):
                layers.append(ResBlock(c, c_out))
                c = c_out
            if level < len(chans) - 1:
                layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c, c, 3, 1, 1)]
        layers += [_norm(c), nn.SiLU(), nn.Conv2d(c, 3, 3, 1, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, code_BCHW: torch.Tensor) -> torch.Tensor:
        return self.net(code_BCHW)
