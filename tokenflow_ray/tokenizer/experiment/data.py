"""Colourised sklearn digits (bundled with scikit-learn; nothing is downloaded), and colourised synthetic shapes.

Each 8x8 digit becomes an intensity map a in [0, 1] (bilinear-upsampled to `side`, shifted by up to 1 px), and the
image is a * fg + (1 - a) * bg with fg/bg drawn from a palette (distinct, plus small jitter). Colour is then the pixel
nuisance and the digit the semantics (§6: plain digits would make pixel codes look semantic). Colour label = fg * P + bg.
Splits are by *source image*, so no digit drawing appears in two splits: A trains teacher and tokenizers, B trains the
probes, C is the test split for everything.

Shapes (`make_shape_data`): the same recipe with a different semantics: 1800 source masks, each one of 4 shapes
(circle, square, triangle, cross) at a random size (35-85% of the side), position and rotation, antialiased (drawn at
4x and box-downsampled); the class is the shape. `digit_N` then holds the shape class.
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


SHAPES = ("circle", "square", "triangle", "cross")
DATASETS = ("digits", "shapes")


def shape_masks(n: int, side: int, rng: np.random.Generator) -> tuple[torch.Tensor, np.ndarray]:
    """n antialiased shape masks in [0, 1] (N x 1 x side x side) and their classes."""
    from PIL import Image, ImageDraw

    big = side * 4
    labels = rng.integers(0, len(SHAPES), n)
    out = np.zeros((n, side, side), np.float32)
    for i, kind in enumerate(labels):
        img = Image.new("L", (big, big), 0)
        draw = ImageDraw.Draw(img)
        r = rng.uniform(0.35, 0.85) * big / 2
        cx, cy = rng.uniform(r, big - r, 2)
        theta = rng.uniform(0, 2 * np.pi)
        def ring(k, rad, cx=cx, cy=cy, theta=theta):
            return [(cx + rad * np.cos(theta + 2 * np.pi * j / k), cy + rad * np.sin(theta + 2 * np.pi * j / k))
                    for j in range(k)]

        if SHAPES[kind] == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
        elif SHAPES[kind] == "square":
            draw.polygon(ring(4, r), fill=255)
        elif SHAPES[kind] == "triangle":
            draw.polygon(ring(3, r), fill=255)
        else:
            w = r / 3
            for a in (theta, theta + np.pi / 2):
                dx, dy, px, py = r * np.cos(a), r * np.sin(a), w * -np.sin(a), w * np.cos(a)
                draw.polygon([(cx - dx + px, cy - dy + py), (cx + dx + px, cy + dy + py),
                              (cx + dx - px, cy + dy - py), (cx - dx - px, cy - dy - py)], fill=255)
        out[i] = np.asarray(img.resize((side, side), Image.BOX), dtype=np.float32) / 255
    return torch.from_numpy(out)[:, None], labels


def make_data(dataset: str, seed: int, copies: int = 6, side: int = 16, fractions=(0.6, 0.2)) -> DigitData:
    if dataset == "digits":
        return make_digit_data(seed, copies, side, fractions)
    if dataset == "shapes":
        return make_shape_data(seed, copies, side, fractions)
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")


def make_shape_data(seed: int, copies: int = 6, side: int = 16, fractions=(0.6, 0.2), sources: int = 1800):
    rng = np.random.default_rng([seed, 5])
    base, labels = shape_masks(sources, side, rng)
    return _splits(base, labels, rng, copies, fractions, shift=False)


def make_digit_data(seed: int, copies: int = 6, side: int = 16, fractions=(0.6, 0.2)) -> DigitData:
    from sklearn.datasets import load_digits

    if side % 8:
        raise ValueError(f"side must be a multiple of 8, got {side}")
    digits = load_digits()
    rng = np.random.default_rng(seed)
    base = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]  # 1797 x 1 x 8 x 8
    base = F.interpolate(base, size=(side, side), mode="bilinear", align_corners=False).clamp(0, 1)
    return _splits(base, digits.target, rng, copies, fractions, shift=True)


def _splits(base: torch.Tensor, targets: np.ndarray, rng, copies: int, fractions, shift: bool) -> DigitData:
    order = rng.permutation(len(base))
    n_a, n_b = int(fractions[0] * len(base)), int(fractions[1] * len(base))
    parts = {"a": order[:n_a], "b": order[n_a:n_a + n_b], "c": order[n_a + n_b:]}
    out = {}
    for name, src in parts.items():
        src = np.repeat(src, copies)
        alpha = base[src]
        if shift:
            shifts = rng.integers(-1, 2, (len(src), 2))
            alpha = torch.stack([torch.roll(a, (int(dy), int(dx)), dims=(1, 2))
                                 for a, (dy, dx) in zip(alpha, shifts)])
        out[name] = _split(alpha, targets[src], src, rng)
    return DigitData(**out)
