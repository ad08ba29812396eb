"""One experiment arm: build its tokenizer (same architecture and K for every arm; only the index rule differs),
train it on split A, and score it on B/C.

Arms (all share one codebook size K, so bits per token are equal except TF-sep, which spends two indices per token):
  P       w_sem = 0: the index depends on the pixel code only (pixel-only VQ)
  S       w_dis = 0: the index depends on the semantic code only; the pixel table still learns one pixel code per
          semantic cluster, which the pixel decoder reads (the §6 "S plus a pixel decoder on its codes")
  TF      w_sem = w_dis = 1: the shared index of the paper
  TF-sep  two independent indices (2x the tokens: an upper reference, not a bits-matched arm)
  TF(w)   the w sweep
Every arm trains the same losses (MSE + cosine to the teacher + VQ); LPIPS, GAN and multi-scale are off (§6 Tier B).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenflow_ray.tokenizer.config import (
    LossConfig,
    PixelConfig,
    QuantizerConfig,
    SemanticConfig,
    SemDecoderConfig,
    TokenizerConfig,
)
from tokenflow_ray.tokenizer.criterion import TokenizerLoss
from tokenflow_ray.tokenizer.experiment import metrics as M
from tokenflow_ray.tokenizer.experiment.data import DigitData
from tokenflow_ray.tokenizer.model import DualCodebookTokenizer


@dataclass(frozen=True)
class ArmSpec:
    name: str
    w_sem: float = 1.0
    w_dis: float = 1.0
    index_mode: str = "shared"


def teacher_semantic_config(side: int) -> SemanticConfig:
    return SemanticConfig(kind="cnn", image_size=side, patch_size=4, hidden_size=32, num_layers=3, feature_dim=32,
                          code_dim=32)


def arm_config(spec: ArmSpec, side: int, k: int, usage_window: int) -> TokenizerConfig:
    sem = teacher_semantic_config(side)
    return TokenizerConfig(
        image_size=side, semantic=sem,
        pixel=PixelConfig(ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, dec_num_res_blocks=1, z_channels=32,
                          code_dim=8, attn_at_lowest=False),
        quantizer=QuantizerConfig(codebook_size=k, w_sem=spec.w_sem, w_dis=spec.w_dis, index_mode=spec.index_mode,
                                  usage_window=usage_window),
        sem_decoder=SemDecoderConfig(width=64, depth=1, num_heads=4),
        loss=LossConfig(lpips_weight=0.0, gan_weight=0.0),
        scales=(sem.grid,), scale_drop_prob=0.0,
    )


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch: int = 64
    lr: float = 1e-3
    restart_every: int = 50  # dead-code restart cadence (§6 pitfall: dead codes on small data)


def train_arm(cfg: TokenizerConfig, tower: torch.nn.Module, data: DigitData, settings: TrainSettings,
              seed: int) -> DualCodebookTokenizer:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    # The semantic encoder starts from the teacher (a copy: the teacher itself stays frozen in the loss module).
    model = DualCodebookTokenizer(cfg, semantic_tower=copy.deepcopy(tower).train())
    criterion = TokenizerLoss(cfg, tower, None)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=settings.lr, betas=(0.9, 0.95))
    images = data.a.images_NCHW
    for step in range(settings.steps):
        batch = images[torch.randint(0, len(images), (settings.batch,), generator=gen)]
        out = criterion(model, batch, step=step)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % settings.restart_every == 0 and step + 1 < settings.steps:
            model.restart_dead_codes(batch, generator=gen)
    return model.eval()


@torch.no_grad()
def _tokens(model: DualCodebookTokenizer, images: torch.Tensor):
    idx, emb, recon = [], [], []
    for x in images.split(512):
        enc = model.encode(x)
        idx.append(enc.idx_per_scale[-1])
        emb.append(enc.f_hat_BCHW.flatten(1))
        recon.append(model.codes_to_img(enc.f_hat_BCHW))
    return torch.cat(idx).numpy(), torch.cat(emb).numpy(), torch.cat(recon)


def evaluate_arm(model: DualCodebookTokenizer, data: DigitData) -> dict:
    k = model.config.quantizer.codebook_size
    idx_b, emb_b, _ = _tokens(model, data.b.images_NCHW)
    idx_c, emb_c, recon_c = _tokens(model, data.c.images_NCHW)
    oh_b, oh_c = M.onehot_positions(idx_b, k), M.onehot_positions(idx_c, k)
    ids_c = M.token_ids_N(idx_c, k)
    streams = 2 if idx_c.ndim == 4 else 1
    stats = M.codebook_stats(ids_c, k, streams)
    return {
        "psnr": float(M.psnr_per_image(recon_c, data.c.images_NCHW).mean()),
        "ssim": float(M.ssim_per_image(recon_c, data.c.images_NCHW).mean()),
        "digit_acc": M.probe_accuracy(oh_b, data.b.digit_N, oh_c, data.c.digit_N, dense=False),
        "color_acc": M.probe_accuracy(oh_b, data.b.colour_N, oh_c, data.c.colour_N, dense=False),
        "digit_acc_emb": M.probe_accuracy(emb_b, data.b.digit_N, emb_c, data.c.digit_N, dense=True),
        "color_acc_emb": M.probe_accuracy(emb_b, data.b.colour_N, emb_c, data.c.colour_N, dense=True),
        "usage": M.usage_fraction(idx_c, k),
        "perplexity": stats["perplexity"],
        "nmi_digit": M.nmi_tokens(ids_c, data.c.digit_N),
        "nmi_color": M.nmi_tokens(ids_c, data.c.colour_N),
        "tokens_per_image": int(np.prod(idx_c.shape[1:])),
        "cluster_sizes": stats["cluster_sizes"][:k].tolist(),
    }


def run_arm(spec: ArmSpec, tower, data: DigitData, settings: TrainSettings, seed: int, side: int, k: int,
            usage_window: int) -> dict:
    t0 = time.perf_counter()
    model = train_arm(arm_config(spec, side, k, usage_window), tower, data, settings, seed)
    result = evaluate_arm(model, data)
    result["seconds"] = time.perf_counter() - t0
    return result
