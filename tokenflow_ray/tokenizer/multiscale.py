"""VAR-style multi-scale residual VQ over the 40-d [sem; pix] map, one shared-index codebook for every scale.

Per scale (paper §1): area-downsample the residual, quantise it with the shared-index rule, bicubic-upsample, add to
the running sum, subtract from the residual. In training, with probability scale_drop_prob one non-first scale is
skipped for the step. Two variants (QuantizerConfig.residual):

* "official" (default; ByteFlow-AI/TokenFlow vq_model.py): the residual starts as the raw [z_sem; z_pix] and stays
  unnormalised; at each scale the downsampled residual is L2-normalised per branch, searched, and the VQ loss
  (codebook + beta * commitment) is taken between the unit codewords and that normalised residual; each scale's
  straight-through output is upsampled and summed with weight 1. Losses are averaged over scales.
* "var" (option): normalise [z_sem; z_pix] once; the loss is on the running sum after each scale; each scale after
  the first multiplies its codewords by a learned per-branch gain (init 0.5) [interpretation: unit codewords added at
  every scale overshoot a shrinking residual]. The gains are model weights, so indices alone still decode.
With one scale both are exactly the single-scale quantiser of §1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow_ray.tokenizer.config import QuantizerConfig
from tokenflow_ray.tokenizer.quantizer import SharedIndexCodebook, l2n


@dataclass(frozen=True)
class MultiScaleResult:
    f_hat_BCHW: torch.Tensor  # straight-through quantised map (the sum over scales), C = sem_dim + pix_dim
    idx_per_scale: tuple[torch.Tensor, ...]  # idx_Bhw per scale (separate mode: idx_Bhw2); dropped scales absent
    scales: tuple[int, ...]  # the sides actually used, aligned with idx_per_scale
    codebook_loss: torch.Tensor  # ||f_hat - sg(f)||^2, mean over scales
    commit_loss: torch.Tensor  # ||sg(f_hat) - f||^2, mean over scales
    vq_loss: torch.Tensor  # codebook_loss + beta * commit_loss


def scales_for_grid(configured: tuple[int, ...], grid: int) -> tuple[int, ...]:
    """The scale list at another resolution: configured sides below the grid, then the grid itself.

    This is the paper's `--infer_interpolate` rule (B at 256 px: [1..14] + [16]); smaller inputs drop the top sides.
    """
    return tuple(s for s in configured if s < grid) + (grid,)


class MultiScaleQuantizer(nn.Module):
    def __init__(self, cfg: QuantizerConfig, scales: tuple[int, ...], scale_drop_prob: float) -> None:
        super().__init__()
        self.cfg = cfg
        self.scales = tuple(scales)
        self.scale_drop_prob = scale_drop_prob
        self.codebook = SharedIndexCodebook(cfg)
        self.official = cfg.residual == "official"
        if not self.official:
            self.gain_S2 = nn.Parameter(torch.full((max(len(self.scales) - 1, 0), 2), 0.5))

    def extra_repr(self) -> str:
        return f"scales={self.scales}, scale_drop_prob={self.scale_drop_prob}"

    def _gain_C(self, side: int, position: int, device) -> torch.Tensor:
        """Per-channel multiplier for the codewords of one scale (1 for the first scale)."""
        c = self.cfg
        if position == 0 or self.official:
            return torch.ones(c.sem_dim + c.pix_dim, device=device)
        row = self.scales.index(side) - 1 if side in self.scales[1:] else len(self.scales) - 2
        row = max(row, 0)
        if self.gain_S2.shape[0] == 0:  # a 1-scale model asked for more scales at another resolution
            return torch.ones(c.sem_dim + c.pix_dim, device=device)
        g = self.gain_S2[row]
        return torch.cat([g[0].expand(c.sem_dim), g[1].expand(c.pix_dim)])

    def _split(self, x_NC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x_NC[:, :self.cfg.sem_dim], x_NC[:, self.cfg.sem_dim:]

    def indices_to_fhat(self, idx_per_scale: tuple[torch.Tensor, ...], grid: int) -> torch.Tensor:
        """Sum of all scales' codewords upsampled to the final grid (the 'last scale' LLM input of the paper)."""
        scales = tuple(int(i.shape[1]) for i in idx_per_scale)
        f_hat = None
        for pos, (side, idx) in enumerate(zip(scales, idx_per_scale)):
            h_BCss = self.codebook.lookup(idx).movedim(-1, 1) * self._gain_C(side, pos, idx.device)[None, :, None, None]
            h_BCHW = h_BCss if side == grid else F.interpolate(h_BCss, size=(grid, grid), mode="bicubic")
            f_hat = h_BCHW if f_hat is None else f_hat + h_BCHW
        return f_hat

    def forward(self, z_sem_BCHW: torch.Tensor, z_pix_BCHW: torch.Tensor, generator=None) -> MultiScaleResult:
        b, _, h, w = z_sem_BCHW.shape
        scales = self.scales if h == self.scales[-1] else scales_for_grid(self.scales, h)
        positions = list(range(len(scales)))
        if self.training and len(scales) > 1 and self.scale_drop_prob > 0:
            if float(torch.rand((), generator=generator)) < self.scale_drop_prob:
                drop = 1 + int(torch.randint(0, len(scales) - 1, (), generator=generator))
                positions.remove(drop)
        if self.official:
            return self._official(torch.cat([z_sem_BCHW, z_pix_BCHW], dim=1), scales, positions)
        f_BCHW = torch.cat([l2n(z_sem_BCHW, dim=1), l2n(z_pix_BCHW, dim=1)], dim=1)
        f_rest = f_BCHW.detach().clone()
        f_hat = torch.zeros_like(f_BCHW)
        codebook_loss = commit_loss = f_BCHW.new_zeros(())
        idx_list, used = [], []
        for pos in positions:
            side = scales[pos]
            rest_BCss = f_rest if side == h else F.interpolate(f_rest, size=(side, side), mode="area")
            rest_NC = rest_BCss.permute(0, 2, 3, 1).reshape(-1, f_BCHW.shape[1])
            idx = self.codebook.search(*self._split(rest_NC))
            idx = idx.reshape(b, side, side, *idx.shape[1:])
            h_BCss = self.codebook.lookup(idx).movedim(3, 1) * self._gain_C(side, pos, f_BCHW.device)[None, :, None,
                                                                                                        None]
            h_BCHW = h_BCss if side == h else F.interpolate(h_BCss, size=(h, w), mode="bicubic")
            f_hat = f_hat + h_BCHW
            f_rest = f_rest - h_BCHW.detach()
            codebook_loss = codebook_loss + F.mse_loss(f_hat, f_BCHW.detach())
            commit_loss = commit_loss + F.mse_loss(f_hat.detach(), f_BCHW)
            idx_list.append(idx)
            used.append(side)
            if self.training:
                self.codebook.record_usage(idx)
        n = len(positions)
        codebook_loss, commit_loss = codebook_loss / n, commit_loss / n
        f_hat_st = f_BCHW + (f_hat - f_BCHW).detach()  # straight-through: the encoders see d loss / d f_hat
        return MultiScaleResult(f_hat_BCHW=f_hat_st, idx_per_scale=tuple(idx_list), scales=tuple(used),
                                codebook_loss=codebook_loss, commit_loss=commit_loss,
                                vq_loss=codebook_loss + self.cfg.beta * commit_loss)

    def _branch_norm(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        d = self.cfg.sem_dim
        return torch.cat([l2n(x_BCHW[:, :d], dim=1), l2n(x_BCHW[:, d:], dim=1)], dim=1)

    def _official(self, h_BCHW: torch.Tensor, scales: tuple[int, ...], positions: list[int]) -> MultiScaleResult:
        b, c, h, w = h_BCHW.shape
        residual = h_BCHW
        f_hat = torch.zeros_like(h_BCHW)
        codebook_loss = commit_loss = h_BCHW.new_zeros(())
        idx_list, used = [], []
        for pos in positions:
            side = scales[pos]
            rest = residual if side == h else F.interpolate(residual, size=(side, side), mode="area")
            z_n = self._branch_norm(rest)  # this scale's residual, unit per branch (the official quantiser's input)
            z_NC = z_n.permute(0, 2, 3, 1).reshape(-1, c)
            idx = self.codebook.search(*self._split(z_NC))
            idx = idx.reshape(b, side, side, *idx.shape[1:])
            q_BCss = self.codebook.lookup(idx).movedim(3, 1)
            codebook_loss = codebook_loss + F.mse_loss(q_BCss, z_n.detach())
            commit_loss = commit_loss + F.mse_loss(q_BCss.detach(), z_n)
            q_st = z_n + (q_BCss - z_n).detach()  # straight-through at this scale
            up = q_st if side == h else F.interpolate(q_st, size=(h, w), mode="bicubic")
            f_hat = f_hat + up
            residual = residual - up.detach()
            idx_list.append(idx)
            used.append(side)
            if self.training:
                self.codebook.record_usage(idx)
        n = len(positions)
        codebook_loss, commit_loss = codebook_loss / n, commit_loss / n
        return MultiScaleResult(f_hat_BCHW=f_hat, idx_per_scale=tuple(idx_list), scales=tuple(used),
                                codebook_loss=codebook_loss, commit_loss=commit_loss,
                                vq_loss=codebook_loss + self.cfg.beta * commit_loss)
