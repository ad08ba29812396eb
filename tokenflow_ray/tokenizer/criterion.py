"""The training loss module: the parts that exist only for training, kept out of the tokenizer (paper §2).

  L = sem_weight * L_sem + vq_weight * L_VQ + mse * ||x - x^||^2 + l1 * |x - x^| + lpips * LPIPS + lambda_G * L_G

`TokenizerLoss` holds the frozen teacher (a copy of the semantic tower as it was before training: pretrained weights,
or the seeded random init in tests) and the LPIPS network (perceptual.py, local weights). Neither is a submodule of
`DualCodebookTokenizer`, so a checkpoint or export holds the tokenizer only and loads without them.
Build it with `TokenizerLoss.for_model(model)` *before* loading trained weights into the model (the teacher is the
initial tower, not the trained one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenflow_ray.tokenizer import losses as L
from tokenflow_ray.tokenizer.config import TokenizerConfig
from tokenflow_ray.tokenizer.perceptual import load_lpips
from tokenflow_ray.tokenizer.semantic import FrozenTeacher


@dataclass(frozen=True)
class TokenizerOutput:
    recon_BCHW: torch.Tensor
    loss: torch.Tensor  # weighted total for the generator step (the discriminator has its own loss)
    sem_loss: torch.Tensor
    vq_loss: torch.Tensor
    codebook_loss: torch.Tensor
    commit_loss: torch.Tensor
    mse_loss: torch.Tensor
    l1_loss: torch.Tensor
    lpips_loss: torch.Tensor
    gan_loss: torch.Tensor  # generator hinge term (0 before gan_start_step or without a discriminator)
    usage: float  # unique indices in the rolling window / K
    idx_per_scale: tuple[torch.Tensor, ...]
    f_hat_BCHW: torch.Tensor


class TokenizerLoss(nn.Module):
    def __init__(self, config: TokenizerConfig, teacher_tower: nn.Module | None, lpips: nn.Module | None) -> None:
        super().__init__()
        self.config = config
        self.teacher = FrozenTeacher(teacher_tower) if teacher_tower is not None else None
        self.lpips = lpips

    @classmethod
    def for_model(cls, model: nn.Module) -> TokenizerLoss:
        cfg = model.config
        tower = model.sem_encoder.tower if cfg.loss.sem_weight > 0 else None
        lpips = load_lpips(cfg.loss.lpips_path) if cfg.loss.lpips_weight > 0 else None
        if cfg.loss.lpips_weight > 0 and lpips is None:
            raise ValueError("model.loss.lpips_weight > 0 needs model.loss.lpips_path")
        return cls(cfg, tower, lpips)

    def forward(self, model: nn.Module, img_BCHW: torch.Tensor, step: int = 0,
                discriminator: nn.Module | None = None, generator: torch.Generator | None = None) -> TokenizerOutput:
        """`model` may be DDP-wrapped: it is called once, so DDP sees one forward per backward."""
        lc = self.config.loss
        use_sem = lc.sem_weight > 0 and self.teacher is not None
        out = model(img_BCHW, generator=generator, with_semantic=use_sem)
        recon, q = out.recon_BCHW, out.quant
        zero = recon.new_zeros(())
        # why: arms without a semantic objective skip the teacher pass entirely
        sem_loss = L.semantic_cosine_loss(out.sem_pred_BFhw, self.teacher(out.sem_input_BCHW)) if use_sem else zero
        rec = L.reconstruction_losses(recon, img_BCHW, self.lpips if lc.lpips_weight > 0 else None)
        gan = zero
        if discriminator is not None and L.gan_active(lc, step):
            gan = L.generator_adv_loss(discriminator(recon))
        total = (lc.sem_weight * sem_loss + lc.vq_weight * q.vq_loss + lc.mse_weight * rec.mse
                 + lc.l1_weight * rec.l1 + lc.lpips_weight * rec.lpips + lc.gan_weight * gan)
        raw = model.module if hasattr(model, "module") else model
        return TokenizerOutput(recon_BCHW=recon, loss=total, sem_loss=sem_loss, vq_loss=q.vq_loss,
                               codebook_loss=q.codebook_loss, commit_loss=q.commit_loss, mse_loss=rec.mse,
                               l1_loss=rec.l1, lpips_loss=rec.lpips, gan_loss=gan,
                               usage=raw.quantizer.codebook.usage(), idx_per_scale=q.idx_per_scale,
                               f_hat_BCHW=q.f_hat_BCHW)
