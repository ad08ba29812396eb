"""PatchGAN discriminator (pix2pix / taming NLayerDiscriminator: stride-2 convs, LeakyReLU 0.2, GroupNorm in
place of BatchNorm) — a separate module so a trainer can give it its own optimiser (paper §2: D and G alternate).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class PatchDiscriminator(nn.Module):
    def __init__(self, ndf: int = 64, n_layers: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, ndf, 4, 2, 1), nn.LeakyReLU(0.2)]
        c = ndf
        for i in range(1, n_layers + 1):
            c_out = ndf * min(2 ** i, 8)
            stride = 2 if i < n_layers else 1
            # GroupNorm rather than BatchNorm: why — per-sample statistics keep D independent of batch composition,
            # which matters when a data-parallel trainer splits batches unevenly.
            layers += [nn.Conv2d(c, c_out, 4, stride, 1), nn.GroupNorm(math.gcd(32, c_out), c_out), nn.LeakyReLU(0.2)]
            c = c_out
        layers.append(nn.Conv2d(c, 1, 4, 1, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, img_BCHW: torch.Tensor) -> torch.Tensor:
        """Per-patch real/fake logits, logits_B1hw."""
        return self.net(img_BCHW)
