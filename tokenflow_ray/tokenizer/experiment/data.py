"""Colourised sklearn digits (bundled with scikit-learn; nothing is downloaded).

Each 8x8 digit becomes an intensity map a in [0, 1] (bilinear-upsampled to `side`, shifted by up to 1 px), and the
image is a * fg + (1 - a) * bg with fg/bg drawn from a palette (distinct, plus small jitter). Colour is then the pixel
nuisance and the digit the semantics (§6: plain digits would make pixel codes look semantic). Colour label = fg * P + bg.
Splits are by *source image*, so no digit drawing appears in two splits: A trains teacher and tokenizers, B trains the
probes, C is the test split for everything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

PALETTE = np.array([[0.9, 0.1, 0.1], [0.1, 0.7, 0.1], [0.15, 0.25, 0.95], [0.95, 0.85, 0.1], [0.1, 0.85, 0.85],
                    [0.85, 0.2, 0.85]], dtype=np.float32)


@dataclass(frozen=True)
class DigitSplit:
    images_NCHW: torch.Tensor  # float32 in [-1, 1]
    alpha_N1HW: torch.Tensor  # the intensity map, kept so the teacher can recolour for its augmentation
    digit_N: np.ndarray
    colour_N: np.ndarray
    source_N: np.ndarray


@dataclass(frozen=True)
class DigitData:
    a: DigitSplit
    b: DigitSplit
    c: DigitSplit


def colourise(alpha_N1HW: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, np.ndarray]:
    n, p = alpha_N1HW.shape[0], len(PALETTE)
    fg = rng.integers(0, p, n)
    bg = (fg + rng.integers(1, p, n)) % p  # distinct from fg
    jitter = lambda: rng.uniform(-0.08, 0.08, (n, 3)).astype(np.float32)  # noqa: E731
    fg_c = torch.from_numpy(np.clip(PALETTE[fg] + jitter(), 0, 1))[:, :, None, None]
    bg_c = torch.from_numpy(np.clip(PALETTE[bg] + jitter(), 0, 1))[:, :, None, None]
    img = alpha_N1HW * fg_c + (1 - alpha_N1HW) * bg_c
    return img * 2 - 1, fg * p + bg


def _split(alpha, digits, sources, rng) -> DigitSplit:
    images, colour = colourise(alpha, rng)
    return DigitSplit(images, alpha, digits, colour, sources)


def make_digit_data(seed: int, copies: int = 6, side: int = 16, fractions=(0.6, 0.2)) -> DigitData:
    from sklearn.datasets import load_digits

    if side % 8:
        raise ValueError(f"side must be a multiple of 8, got {side}")
    digits = load_digits()
    rng = np.random.default_rng(seed)
    base = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]  # 1797 x 1 x 8 x 8
    base = F.interpolate(base, size=(side, side), mode="bilinear", align_corners=False).clamp(0, 1)
    order = rng.permutation(len(base))
    n_a, n_b = int(fractions[0] * len(base)), int(fractions[1] * len(base))
    parts = {"a": order[:n_a], "b": order[n_a:n_a + n_b], "c": order[n_a + n_b:]}
    out = {}
    for name, src in parts.items():
        src = np.repeat(src, copies)
        alpha = base[src]
        shifts = rng.integers(-1, 2, (len(src), 2))
        alpha = torch.stack([torch.roll(a, (int(dy), int(dx)), dims=(1, 2)) for a, (dy, dx) in zip(alpha, shifts)])
        out[name] = _split(alpha, digits.target[src], src, rng)
    return DigitData(**out)
