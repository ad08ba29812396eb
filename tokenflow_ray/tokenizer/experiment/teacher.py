"""The §6 teacher: a small CNN classifier trained on split A with colour augmentation (every batch is recoloured),
so its stride-4 feature map is colour-invariant and plays CLIP's role for the semantic branch.

The step budget is per dataset (`TEACHER_STEPS`). Digits keep the 300 steps their recorded runs used. Shapes need
more: the class is a configuration that the mean-pooled head only reads once the tower has learnt it, and at 300
steps the teacher is still underfitting its own training split (0.54 on A, loss 1.08; 0.47 on C, crosses almost
never recognised). At 2000 steps it reaches 0.93-0.96 on C over seeds 0-2 (12 s on one thread); the errors left are
the smallest shapes (0.80-0.88 on the smallest area quartile, >= 0.99 on the two largest).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenflow_ray.tokenizer.config import SemanticConfig
from tokenflow_ray.tokenizer.experiment.data import DATASETS, DigitSplit, colourise
from tokenflow_ray.tokenizer.semantic import CNNTower

TEACHER_STEPS = {"digits": 300, "shapes": 2000}


def teacher_steps_for(dataset: str, steps: int | None) -> int:
    """The configured budget, or the dataset's default when it is None."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    return TEACHER_STEPS[dataset] if steps is None else steps


@dataclass(frozen=True)
class TeacherResult:
    tower: CNNTower
    acc_c: float  # class accuracy on split C (sanity: the teacher must actually know the classes)


def train_teacher(cfg: SemanticConfig, train: DigitSplit, test: DigitSplit, steps: int, seed: int,
                  batch: int = 128, lr: float = 3e-3) -> TeacherResult:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed + 1000)
    tower = CNNTower(cfg)
    head = nn.Linear(cfg.feature_dim, 10)
    opt = torch.optim.Adam([*tower.parameters(), *head.parameters()], lr=lr)
    labels = torch.from_numpy(train.digit_N).long()
    classify = lambda x: head(tower.target(x).mean(dim=(2, 3)))  # noqa: E731
    for _ in range(steps):
        pick = torch.from_numpy(rng.integers(0, len(labels), batch))
        images, _ = colourise(train.alpha_N1HW[pick], rng)  # fresh colours: colour carries no label information
        loss = F.cross_entropy(classify(images), labels[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
    tower.eval()
    with torch.no_grad():
        pred = torch.cat([classify(x).argmax(1) for x in test.images_NCHW.split(512)]).numpy()
    return TeacherResult(tower=tower, acc_c=float((pred == test.digit_N).mean()))
