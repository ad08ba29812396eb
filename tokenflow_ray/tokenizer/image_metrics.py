"""Reconstruction metrics, the one place evaluation, the experiment and benches take them from.

PSNR and SSIM are torchmetrics' (on [0, 1] pixels, per image; SSIM's Gaussian window sigma 1.5, 11 px, or the
largest odd size that fits a smaller image). rFID is torchmetrics' Frechet distance over a feature network that
loads from a local directory: any transformers vision model (CLIP, SigLIP, DINOv2, ViT), its pooled embedding as the
feature. Why not Inception: torchmetrics' and clean-fid's Inception path needs torch-fidelity / torchvision, whose
registry wheels do not load against this project's CPU torch; the Frechet distance is the same computation over
another embedding ("FD-CLIP"/"FD-DINOv2" in the literature), so figures are comparable across our runs, not with
Inception rFID tables. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def _unit(x_BCHW: torch.Tensor) -> torch.Tensor:
    return ((x_BCHW.clamp(-1, 1) + 1) / 2).float()


def psnr(recon_BCHW: torch.Tensor, target_BCHW: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB; inputs in [-1, 1]."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    return peak_signal_noise_ratio(_unit(recon_BCHW), _unit(target_BCHW), data_range=1.0, reduction="none",
                                   dim=(1, 2, 3))


def ssim(recon_BCHW: torch.Tensor, target_BCHW: torch.Tensor) -> torch.Tensor:
    """Per-image SSIM; inputs in [-1, 1]."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    side = min(recon_BCHW.shape[-2:])
    kernel = min(11, side - (1 - side % 2))  # odd, no larger than the image
    return structural_similarity_index_measure(_unit(recon_BCHW), _unit(target_BCHW), data_range=1.0,
                                               kernel_size=kernel, reduction="none")


class PooledVisionFeatures(nn.Module):
    """A local transformers vision model as an FID feature extractor: images in [0, 1] -> pooled embeddings."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        from transformers import AutoConfig

        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"FID feature network not found: {directory} has no config.json (eval.fid_features"
                                    " must be a local transformers vision model directory; nothing is downloaded)")
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        kind = config.model_type
        if kind in ("clip", "clip_vision_model"):
            from transformers import CLIPVisionModelWithProjection as cls
        elif kind in ("siglip", "siglip_vision_model"):
            from transformers import SiglipVisionModel as cls
        else:
            from transformers import AutoModel as cls
        self.model = cls.from_pretrained(directory, local_files_only=True).eval().requires_grad_(False)
        vision = getattr(self.model.config, "vision_config", self.model.config)
        self.side = int(getattr(vision, "image_size", 224))
        clip = kind.startswith("clip")
        mean, std = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)) if clip else \
            ((0.5,) * 3, (0.5,) * 3) if kind.startswith("siglip") else ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        with torch.no_grad():
            self.num_features = int(self(torch.zeros(1, 3, 8, 8)).shape[-1])

    @torch.no_grad()
    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        x = x_BCHW.float()
        if x.max() > 1.5:  # torchmetrics passes uint8-range images unless normalize=True; accept both
            x = x / 255.0
        x = nn.functional.interpolate(x, size=(self.side, self.side), mode="bicubic", align_corners=False)
        out = self.model(pixel_values=(x - self.mean) / self.std)
        for name in ("image_embeds", "pooler_output"):
            value = getattr(out, name, None)
            if value is not None:
                return value.flatten(1)
        return out.last_hidden_state.mean(1)


class RFID:
    """Accumulate real and reconstructed images (in [-1, 1]), then `compute()` the Frechet distance."""

    def __init__(self, feature_path: str | Path) -> None:
        from torchmetrics.image.fid import FrechetInceptionDistance

        self.metric = FrechetInceptionDistance(feature=PooledVisionFeatures(feature_path), normalize=True)

    def update(self, real_BCHW: torch.Tensor, recon_BCHW: torch.Tensor) -> None:
        self.metric.update(_unit(real_BCHW), real=True)
        self.metric.update(_unit(recon_BCHW), real=False)

    def compute(self) -> float:
        return float(self.metric.compute())
