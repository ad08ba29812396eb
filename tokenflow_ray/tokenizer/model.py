"""DualCodebookTokenizer: semantic + pixel encoders, shared-index multi-scale VQ, semantic + pixel decoders.

Converter-style API (images in [-1, 1], B x 3 x H x W, square, side a multiple of config.side_multiple):
  encode(img_BCHW)              -> EncodeResult: indices per scale (idx_Bhw; separate mode idx_Bhw2)
  decode(idx_per_scale)         -> img_BCHW
  indices_to_codes(idx)         -> f_hat_BChw, the 40-d sum over scales at the final grid (the LLM's input)
  indices_to_semantic(idx)      -> teacher-space features from the semantic decoder
  forward(img_BCHW)             -> ModelForward: reconstruction, semantic prediction, the quantiser's result
The model holds the tokenizer only. What exists only for training (the frozen teacher and the LPIPS network) lives
in the loss module (criterion.py `TokenizerLoss`), so neither is in a checkpoint or a safetensors export.
Save/load: save_pretrained(dir) / from_pretrained(dir) write and read config.json + model.safetensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow_ray.tokenizer.config import TokenizerConfig
from tokenflow_ray.tokenizer.decoders import SemanticDecoder
from tokenflow_ray.tokenizer.multiscale import MultiScaleQuantizer, MultiScaleResult
from tokenflow_ray.tokenizer.pixel import PixelDecoder, PixelEncoder
from tokenflow_ray.tokenizer.semantic import SemanticEncoder, build_tower

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


@dataclass(frozen=True)
class EncodeResult:
    idx_per_scale: tuple[torch.Tensor, ...]  # idx_Bhw per scale, coarse to fine (separate mode: idx_Bhw2)
    scales: tuple[int, ...]
    f_hat_BCHW: torch.Tensor  # quantised [sem; pix] sum at the final grid


@dataclass(frozen=True)
class ModelForward:
    recon_BCHW: torch.Tensor
    sem_pred_BFhw: torch.Tensor | None  # semantic decoder output (teacher space); None when not asked for
    quant: MultiScaleResult
    sem_input_BCHW: torch.Tensor  # the image at the semantic branch's side (what the teacher must see)


class DualCodebookTokenizer(nn.Module):
    def __init__(self, config: TokenizerConfig, semantic_tower: nn.Module | None = None,
                 _hf_tower_config: dict | None = None) -> None:
        super().__init__()
        self.config = config
        tower = semantic_tower if semantic_tower is not None else build_tower(config.semantic, _hf_tower_config)
        self.sem_encoder = SemanticEncoder(config.semantic, tower)
        self.pix_encoder = PixelEncoder(config.pixel)
        self.pix_decoder = PixelDecoder(config.pixel)
        self.quantizer = MultiScaleQuantizer(config.quantizer, config.scales, config.scale_drop_prob)
        self.sem_decoder = SemanticDecoder(config.sem_decoder, config.semantic.code_dim, tower.feature_dim,
                                           config.grid)

    # ---- input checks and branch geometry ----
    def _grid_for(self, img_BCHW: torch.Tensor) -> int:
        c = self.config
        if not torch.is_tensor(img_BCHW) or img_BCHW.ndim != 4:
            raise ValueError(f"images must be a 4-d tensor B x 3 x H x W, got {getattr(img_BCHW, 'shape', None)}")
        b, ch, h, w = img_BCHW.shape
        if ch != 3:
            raise ValueError(f"images must have 3 channels (RGB), got {ch} channels (shape {tuple(img_BCHW.shape)})")
        if h != w:
            raise ValueError(f"images must be square, got H={h} W={w}")
        if h % c.side_multiple:
            raise ValueError(f"image side {h} is not divisible by {c.side_multiple}; the token grid would not be "
                             f"whole (grid {c.grid} at image_size {c.image_size})")
        if not img_BCHW.is_floating_point() or not torch.isfinite(img_BCHW).all():
            raise ValueError("images must be finite floats in [-1, 1] (found NaN/inf or a non-float dtype)")
        return h * c.grid // c.image_size

    @staticmethod
    def _resize(img_BCHW: torch.Tensor, side: int) -> torch.Tensor:
        if img_BCHW.shape[-1] == side:
            return img_BCHW
        return F.interpolate(img_BCHW, size=(side, side), mode="bicubic", antialias=True, align_corners=False)

    def _branch_codes(self, img_BCHW: torch.Tensor, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        z_sem = self.sem_encoder(self._resize(img_BCHW, grid * c.semantic.patch_size))
        z_pix = self.pix_encoder(self._resize(img_BCHW, grid * c.pixel.downsample))
        return z_sem, z_pix

    # ---- inference path ----
    @torch.no_grad()
    def encode(self, img_BCHW: torch.Tensor) -> EncodeResult:
        grid = self._grid_for(img_BCHW)
        was_training = self.training
        self.eval()  # why: scale drop and usage recording are training-only; encode must be deterministic
        try:
            q = self.quantizer(*self._branch_codes(img_BCHW, grid))
        finally:
            self.train(was_training)
        return EncodeResult(idx_per_scale=q.idx_per_scale, scales=q.scales, f_hat_BCHW=q.f_hat_BCHW)

    def indices_to_codes(self, idx_per_scale) -> torch.Tensor:
        idx_per_scale = tuple(idx_per_scale)
        if not idx_per_scale:
            raise ValueError("indices must hold at least one scale")
        for idx in idx_per_scale:
            spatial = idx.shape[1:3]
            if idx.ndim < 3 or spatial[0] != spatial[1]:
                raise ValueError(f"each scale's indices must be B x s x s, got shape {tuple(idx.shape)}")
        return self.quantizer.indices_to_fhat(idx_per_scale, int(idx_per_scale[-1].shape[1]))

    def codes_to_img(self, f_hat_BCHW: torch.Tensor) -> torch.Tensor:
        c = self.config
        img = self.pix_decoder(f_hat_BCHW[:, c.quantizer.sem_dim:])
        return self._resize(img, f_hat_BCHW.shape[-1] * c.image_size // c.grid)

    def codes_to_semantic(self, f_hat_BCHW: torch.Tensor) -> torch.Tensor:
        return self.sem_decoder(f_hat_BCHW[:, :self.config.quantizer.sem_dim])

    @torch.no_grad()
    def decode(self, idx_per_scale) -> torch.Tensor:
        return self.codes_to_img(self.indices_to_codes(idx_per_scale))

    @torch.no_grad()
    def indices_to_semantic(self, idx_per_scale) -> torch.Tensor:
        return self.codes_to_semantic(self.indices_to_codes(idx_per_scale))

    # ---- training path ----
    def forward(self, img_BCHW: torch.Tensor, generator: torch.Generator | None = None,
                with_semantic: bool = True) -> ModelForward:
        """One training pass: losses are the loss module's job (criterion.py), which calls this."""
        grid = self._grid_for(img_BCHW)
        sem_in = self._resize(img_BCHW, grid * self.config.semantic.patch_size)
        z_sem = self.sem_encoder(sem_in)
        z_pix = self.pix_encoder(self._resize(img_BCHW, grid * self.config.pixel.downsample))
        q = self.quantizer(z_sem, z_pix, generator=generator)
        sem_pred = self.codes_to_semantic(q.f_hat_BCHW) if with_semantic else None
        return ModelForward(recon_BCHW=self.codes_to_img(q.f_hat_BCHW), sem_pred_BFhw=sem_pred, quant=q,
                            sem_input_BCHW=sem_in)

    @torch.no_grad()
    def restart_dead_codes(self, img_BCHW: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """Re-initialise dead codes from this batch's final-grid encoder outputs; returns how many."""
        z_sem, z_pix = self._branch_codes(img_BCHW, self._grid_for(img_BCHW))
        flat = lambda z: z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])  # noqa: E731
        return self.quantizer.codebook.restart_dead_codes(flat(z_sem), flat(z_pix), generator=generator)

    # ---- persistence ----
    def save_pretrained(self, directory: str | Path) -> None:
        from safetensors.torch import save_model

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        meta = {"tokenizer": self.config.to_dict(), "semantic_tower": self.sem_encoder.tower.hf_config_dict()}
        (path / CONFIG_NAME).write_text(json.dumps(meta, indent=2))
        save_model(self, str(path / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> DualCodebookTokenizer:
        from safetensors.torch import load_model

        path = Path(directory)
        if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"{path} must contain {CONFIG_NAME} and {WEIGHTS_NAME}")
        meta = json.loads((path / CONFIG_NAME).read_text())
        config = TokenizerConfig.from_dict(meta["tokenizer"])
        check_tower_geometry(config, meta.get("semantic_tower"), str(path))
        model = cls(config, _hf_tower_config=meta.get("semantic_tower"))
        load_model(model, str(path / WEIGHTS_NAME), strict=True)
        return model


def check_tower_geometry(config: TokenizerConfig, hf_config: dict | None, where: str) -> None:
    """A tower whose patch or image size differs from the config would give another token grid than the config's
    scales (or silently interpolate position embeddings): refuse it with the two values."""
    if not hf_config:
        return
    sem = config.semantic
    for key in ("patch_size", "image_size"):
        if key in hf_config and int(hf_config[key]) != getattr(sem, key):
            raise ValueError(f"{where}: the semantic tower has {key} {hf_config[key]} but the config says "
                             f"semantic.{key} {getattr(sem, key)}")
