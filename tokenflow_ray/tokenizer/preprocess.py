"""Image bytes -> model input, in one place: training's random crop, and the deterministic centre crop that
evaluation and serving share (so a served image is tokenized exactly as the evaluation scored it).

Arrays are float32 3 x S x S in [-1, 1]. Decoding refuses images over `max_pixels` (decompression bombs) before
the pixels are read.
"""

from __future__ import annotations

import io

import numpy as np


class ImageTooLarge(ValueError):
    def __init__(self, width: int, height: int, max_pixels: int) -> None:
        super().__init__(f"image is {width}x{height} pixels; the limit is {max_pixels} pixels")
        self.width, self.height = width, height


def decode_rgb(data: bytes, max_pixels: int):
    """A loaded RGB PIL image; ImageTooLarge past max_pixels (read from the header); ValueError if undecodable."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > max_pixels:
                raise ImageTooLarge(img.width, img.height, max_pixels)
            rgb = img.convert("RGB")
            rgb.load()
            return rgb
    except ImageTooLarge:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ValueError(f"cannot decode image ({type(exc).__name__})") from None


def _to_array(img, flip: bool = False) -> np.ndarray:
    arr_HWC = np.asarray(img, dtype=np.float32)
    if flip:
        arr_HWC = arr_HWC[:, ::-1]
    return (arr_HWC.transpose(2, 0, 1) / 127.5 - 1.0).astype(np.float32)


def center_crop_resize(rgb, side: int) -> np.ndarray:
    """The central square (the shorter side), bicubic-resized to side x side: evaluation's and serving's input."""
    from PIL import Image

    w, h = rgb.size
    s = min(w, h)
    x0, y0 = (w - s) / 2, (h - s) / 2
    return _to_array(rgb.resize((side, side), Image.BICUBIC, box=(x0, y0, x0 + s, y0 + s)))


def random_crop_resize(rgb, side: int, u4, crop_scale_min: float, hflip: bool) -> np.ndarray:
    """Random-resized square crop (paper §3: area fraction in [crop_scale_min, 1]), resize, optional flip, from four
    uniforms in [0, 1) (area, x, y, flip): the caller owns the randomness, so a sample's crop can be a pure function
    of its id."""
    from PIL import Image

    w, h = rgb.size
    s = min(w, h) * float(np.sqrt(crop_scale_min + (1.0 - crop_scale_min) * u4[0]))
    x0, y0 = u4[1] * (w - s), u4[2] * (h - s)
    img = rgb.resize((side, side), Image.BICUBIC, box=(x0, y0, x0 + s, y0 + s))
    return _to_array(img, flip=hflip and u4[3] < 0.5)


def sample_uniforms(seed: int, samples: np.ndarray, k: int = 4) -> np.ndarray:
    """len(samples) x k uniforms in [0, 1), a pure function of (seed, sample id): splitmix64 over the ids, vectorised
    (a Generator per sample costs ~20 us, as much as the crop itself)."""
    with np.errstate(over="ignore"):
        x = (np.asarray(samples, dtype=np.uint64)[:, None] * np.uint64(k) + np.arange(k, dtype=np.uint64)[None]
             + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
