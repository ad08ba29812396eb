"""Semantic branch: a vision tower (transformers CLIP/SigLIP, or a small CNN for the CPU experiment), its frozen
teacher copy, and the Linear-Tanh-Linear projection to the semantic code (BEiT-v2 VQ-KD design, paper §1).

Towers map an image already resized to grid * patch_size to two things on the token grid:
  * `tokens_BDhw`: what the trainable encoder projects to the semantic code (patch tokens only; the last hidden
    state, or with `use_penultimate` the penultimate one, as the official SigLIP encoder reads it);
  * `target_BFhw`: what the frozen teacher supplies to the cosine loss (CLIP: ln_post(patch) @ proj, SigLIP-XL: the
    penultimate hidden state, CNN: the final feature map).
Weights load only from a local directory (`local_files_only=True`): nothing is downloaded at runtime.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from tokenflow_ray.tokenizer.config import SemanticConfig

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _tokens_to_map(tokens_BLD: torch.Tensor) -> torch.Tensor:
    b, n, d = tokens_BLD.shape
    side = math.isqrt(n)
    return tokens_BLD.transpose(1, 2).reshape(b, d, side, side)


class HFTower(nn.Module):
    """A transformers CLIP or SigLIP vision model, built from a small config or loaded from a local checkpoint."""

    def __init__(self, cfg: SemanticConfig, hf_config: dict | None = None) -> None:
        super().__init__()
        from transformers import (
            CLIPVisionConfig,
            CLIPVisionModelWithProjection,
            SiglipVisionConfig,
            SiglipVisionModel,
        )

        self.kind, self.use_penultimate = cfg.kind, cfg.use_penultimate
        model_cls, config_cls = ((CLIPVisionModelWithProjection, CLIPVisionConfig) if cfg.kind == "clip"
                                 else (SiglipVisionModel, SiglipVisionConfig))
        if hf_config is not None:  # from_pretrained of a saved tokenizer: architecture known, weights come later
            self.model = model_cls(config_cls(**hf_config))
        elif cfg.pretrained_path is not None:
            self.model = model_cls.from_pretrained(cfg.pretrained_path, local_files_only=True)
            for key in ("patch_size", "image_size"):  # another geometry would change the token grid
                if getattr(self.model.config, key) != getattr(cfg, key):
                    raise ValueError(f"semantic.pretrained_path {cfg.pretrained_path}: the checkpoint has {key} "
                                     f"{getattr(self.model.config, key)}, the config semantic.{key} "
                                     f"{getattr(cfg, key)}")
        else:
            extra = {"projection_dim": cfg.feature_dim} if cfg.kind == "clip" else {}
            self.model = model_cls(config_cls(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                                              num_attention_heads=cfg.num_heads,
                                              intermediate_size=cfg.intermediate_size, image_size=cfg.image_size,
                                              patch_size=cfg.patch_size, **extra))
        mean, std = (_CLIP_MEAN, _CLIP_STD) if cfg.kind == "clip" else ((0.5,) * 3, (0.5,) * 3)
        self.register_buffer("mean_C", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std_C", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def feature_dim(self) -> int:
        return self.model.config.projection_dim if self.kind == "clip" else self.model.config.hidden_size

    def hf_config_dict(self) -> dict:
        return self.model.config.to_dict()

    def _run(self, img_BCHW: torch.Tensor, hidden_states: bool):
        pixels = ((img_BCHW + 1) / 2 - self.mean_C) / self.std_C  # [-1, 1] -> the tower's own normalisation
        native = img_BCHW.shape[-1] == self.model.config.image_size
        return self.model(pixel_values=pixels, output_hidden_states=hidden_states,
                          interpolate_pos_encoding=not native)

    def _patches(self, h_BLD: torch.Tensor) -> torch.Tensor:
        return h_BLD[:, 1:] if self.kind == "clip" else h_BLD  # CLIP prepends a CLS token; SigLIP has none

    def tokens(self, img_BCHW: torch.Tensor) -> torch.Tensor:
        out = self._run(img_BCHW, self.use_penultimate)
        h_BLD = out.hidden_states[-2] if self.use_penultimate else out.last_hidden_state
        return _tokens_to_map(self._patches(h_BLD))

    def target(self, img_BCHW: torch.Tensor) -> torch.Tensor:
        out = self._run(img_BCHW, self.use_penultimate)
        if self.kind == "clip":
            vm = self.model.vision_model
            t_BLD = self.model.visual_projection(vm.post_layernorm(self._patches(out.last_hidden_state)))
        else:
            t_BLD = out.hidden_states[-2] if self.use_penultimate else out.last_hidden_state
        return _tokens_to_map(t_BLD)


class CNNTower(nn.Module):
    """Small conv net (the §6 teacher): log2(patch_size) stride-2 stages, hidden_size channels, GroupNorm + SiLU."""

    def __init__(self, cfg: SemanticConfig) -> None:
        super().__init__()
        width, layers, c_in = cfg.hidden_size, [], 3
        n_down = int(math.log2(cfg.patch_size))
        for i in range(max(cfg.num_layers, n_down)):
            stride = 2 if i < n_down else 1
            layers += [nn.Conv2d(c_in, width, 3, stride, 1), nn.GroupNorm(min(8, width), width), nn.SiLU()]
            c_in = width
        self.net = nn.Sequential(*layers)
        self.out = nn.Conv2d(width, cfg.feature_dim, 1)
        self.hidden_size, self.feature_dim = width, cfg.feature_dim

    def hf_config_dict(self) -> None:
        return None

    def tokens(self, img_BCHW: torch.Tensor) -> torch.Tensor:
        return self.net(img_BCHW)

    def target(self, img_BCHW: torch.Tensor) -> torch.Tensor:
        return self.out(self.net(img_BCHW))


def build_tower(cfg: SemanticConfig, hf_config: dict | None = None) -> nn.Module:
    return CNNTower(cfg) if cfg.kind == "cnn" else HFTower(cfg, hf_config)


class FrozenTeacher(nn.Module):
    """A frozen copy of the tower; `train()` cannot switch it out of eval mode."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.tower = copy.deepcopy(tower).requires_grad_(False).eval()

    def train(self, mode: bool = True) -> FrozenTeacher:
        super().train(False)
        return self

    @torch.no_grad()
    def forward(self, img_BCHW: torch.Tensor) -> torch.Tensor:
        return self.tower.target(img_BCHW)


class SemanticEncoder(nn.Module):
    """Trainable tower + Linear-Tanh-Linear head to code_dim, applied per grid position."""

    def __init__(self, cfg: SemanticConfig, tower: nn.Module) -> None:
        super().__init__()
        self.tower = tower
        d = tower.hidden_size
        self.head = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, cfg.code_dim))

    def forward(self, img_BCHW: torch.Tensor) -> torch.Tensor:
        tok_BDhw = self.tower.tokens(img_BCHW)
        return self.head(tok_BDhw.movedim(1, -1)).movedim(-1, 1)
