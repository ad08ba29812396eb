"""Built-in generated datasets, written as parquet with a PNG-bytes column (what an image lake usually holds).

* digits: sklearn `load_digits` (bundled, nothing downloaded), upsampled and colourised with random foreground and
  background colours, so colour is the pixel nuisance and the digit the semantics (tokenizer paper §6).
* shapes: filled circles, squares and triangles of random size, position and colours.
Rows are split over several files so Ray Data reads them as several blocks (parallel reads, streaming split).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

SHAPES = ("circle", "square", "triangle")


def _png(rgb_HWC: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb_HWC).save(buf, format="PNG")
    return buf.getvalue()


HELD_OUT_EVERY = 5  # digits: every 5th sklearn source drawing is held out (only the eval split draws from them)


def digit_images(num_images: int, side: int, seed: int, split: str = "train") -> tuple[list[bytes], np.ndarray]:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    held = np.arange(len(digits.images)) % HELD_OUT_EVERY == 0
    sources = np.flatnonzero(held if split == "eval" else ~held)
    pick = sources[rng.integers(0, len(sources), num_images)]
    fg_N3 = rng.uniform(0, 1, (num_images, 3))
    bg_N3 = 1 - fg_N3 + rng.uniform(-0.2, 0.2, (num_images, 3))  # roughly complementary: the digit stays visible
    out = []
    for i, src in enumerate(pick):
        alpha = Image.fromarray((digits.images[src] * 255 / 16).astype(np.uint8)).resize((side, side), Image.BILINEAR)
        a_HW1 = np.asarray(alpha, dtype=np.float32)[..., None] / 255
        rgb = a_HW1 * fg_N3[i] + (1 - a_HW1) * np.clip(bg_N3[i], 0, 1)
        out.append(_png((rgb * 255).round().astype(np.uint8)))
    return out, digits.target[pick]


def shape_images(num_images: int, side: int, seed: int, split: str = "train") -> tuple[list[bytes], np.ndarray]:
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, 0 if split == "train" else 1])  # the eval split is another random stream
    out, labels = [], rng.integers(0, len(SHAPES), num_images)
    for kind in labels:
        bg, fg = (tuple(int(c) for c in rng.integers(0, 256, 3)) for _ in range(2))
        img = Image.new("RGB", (side, side), bg)
        r = rng.uniform(0.2, 0.45) * side
        cx, cy = rng.uniform(r, side - r, 2)
        draw = ImageDraw.Draw(img)
        if SHAPES[kind] == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
        elif SHAPES[kind] == "square":
            draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fg)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
        out.append(_png(np.asarray(img)))
    return out, labels


def write_generated(kind: str, directory: str | Path, num_images: int, side: int = 32, seed: int = 0,
                    rows_per_file: int = 128, split: str = "train") -> Path:
    """Write `num_images` generated images of one split ("train" or "eval") as parquet files (columns image: PNG
    bytes, label: int) and return the folder. An existing folder with the same spec is reused (generation is
    deterministic in its arguments)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    makers = {"digits": digit_images, "shapes": shape_images}
    if kind not in makers:
        raise ValueError(f"unknown generated dataset {kind!r}; choose from {sorted(makers)}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    folder = Path(directory) / f"{kind}-{split}-n{num_images}-s{side}-seed{seed}"
    done = folder / "_SUCCESS"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = makers[kind](num_images, side, seed, split)
    for part, start in enumerate(range(0, num_images, rows_per_file)):
        table = pa.table({"image": pa.array(images[start:start + rows_per_file], pa.binary()),
                          "label": pa.array(labels[start:start + rows_per_file].astype(np.int64))})
        pq.write_table(table, folder / f"part-{part:05d}.parquet")
    done.write_text("ok\n")  # why: a half-written folder from a killed run must not be mistaken for a finished one
    return folder
