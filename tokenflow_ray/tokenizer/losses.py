"""Loss terms as pure functions returning named results; nothing here logs or keeps state (paper §2). The module
that combines them with the teacher and LPIPS is criterion.py.

  L = sem_weight * L_sem + vq_weight * L_VQ + mse * ||x - x^||^2 + l1 * |x - x^| + lpips * LPIPS + lambda_G * L_G
L_sem: 1 - cos between the semantic decoder's output and the frozen teacher's features, per grid position.
L_G: hinge generator term -E[D(x^)], active from gan_start_step; the discriminator's own hinge loss is
`discriminator_loss`, so a trainer steps D with a separate optimiser (D and G alternate, as in the paper's code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow_ray.tokenizer.config import LossConfig


@dataclass(frozen=True)
class ReconLosses:
    mse: torch.Tensor
    l1: torch.Tensor
    lpips: torch.Tensor  # 0 when no LPIPS module is available


@dataclass(frozen=True)
class DiscriminatorLosses:
    loss: torch.Tensor  # 0.5 * (hinge_real + hinge_fake)
    logits_real: torch.Tensor  # mean D(x), for monitoring
    logits_fake: torch.Tensor  # mean D(x^)


def semantic_cosine_loss(pred_BFhw: torch.Tensor, target_BFhw: torch.Tensor) -> torch.Tensor:
    return (1 - F.cosine_similarity(pred_BFhw, target_BFhw.detach(), dim=1)).mean()


def reconstruction_losses(recon_BCHW: torch.Tensor, target_BCHW: torch.Tensor,
                          lpips: nn.Module | None = None) -> ReconLosses:
    zero = recon_BCHW.new_zeros(())
    return ReconLosses(mse=F.mse_loss(recon_BCHW, target_BCHW), l1=F.l1_loss(recon_BCHW, target_BCHW),
                       lpips=lpips(recon_BCHW, target_BCHW).mean() if lpips is not None else zero)


def gan_active(cfg: LossConfig, step: int) -> bool:
    return cfg.gan_weight > 0 and step >= cfg.gan_start_step


def generator_adv_loss(logits_fake: torch.Tensor) -> torch.Tensor:
    return -logits_fake.mean()


def discriminator_loss(disc: nn.Module, real_BCHW: torch.Tensor, fake_BCHW: torch.Tensor) -> DiscriminatorLosses:
    """Hinge loss for D; `fake` is detached here so the generator gets no gradient from D's step."""
    logits_real, logits_fake = disc(real_BCHW.detach()), disc(fake_BCHW.detach())
    loss = 0.5 * (F.relu(1 - logits_real).mean() + F.relu(1 + logits_fake).mean())
    return DiscriminatorLosses(loss=loss, logits_real=logits_real.mean().detach(),
                               logits_fake=logits_fake.mean().detach())
