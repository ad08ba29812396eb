"""Ray Data pipelines: read (parquet image-bytes column, or a folder of image files) -> decode, crop, resize, flip,
normalise in `map_batches` on a bounded actor pool -> streamed into Ray Train workers with `iter_torch_batches`.

Corrupt or unreadable images never fail the job: the decode stage emits them with `valid = False` and a blank image,
and the training loop drops them and counts them (the count is all-reduced and reported). A folder is read with
`read_binary_files` rather than `read_images` because `read_images` decodes inside the read task, where one bad file
fails the whole read.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np

from .config import DataSettings

log = logging.getLogger(__name__)
IMAGE_EXTENSIONS = ["png", "jpg", "jpeg", "bmp", "gif", "webp", "tif", "tiff"]


class ImageDecoder:
    """Callable class for `map_batches`: bytes -> float32 N x 3 x S x S in [-1, 1] plus a `valid` flag per row."""

    def __init__(self, image_size: int, crop_scale_min: float, hflip: bool, max_pixels: int, seed: int) -> None:
        import os

        self.size, self.crop_min, self.hflip, self.max_pixels = image_size, crop_scale_min, hflip, max_pixels
        # Per-actor stream: two decode actors must not apply the same crops to different images in lockstep.
        self.rng = np.random.default_rng([seed, os.getpid()])

    def _decode(self, data: bytes) -> np.ndarray | None:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as img:
                if img.width * img.height > self.max_pixels:
                    return None
                rgb = img.convert("RGB")
                rgb.load()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            return None
        return self._augment(rgb)

    def _augment(self, rgb) -> np.ndarray:
        from PIL import Image

        w, h = rgb.size
        # Random-resized crop over a square window (paper §3: area 0.8-1.0), then resize and optional flip.
        side = min(w, h) * float(np.sqrt(self.rng.uniform(self.crop_min, 1.0)))
        x0, y0 = self.rng.uniform(0, w - side), self.rng.uniform(0, h - side)
        img = rgb.resize((self.size, self.size), Image.BICUBIC, box=(x0, y0, x0 + side, y0 + side))
        arr_HWC = np.asarray(img, dtype=np.float32)
        if self.hflip and self.rng.random() < 0.5:
            arr_HWC = arr_HWC[:, ::-1]
        return (arr_HWC.transpose(2, 0, 1) / 127.5 - 1.0).astype(np.float32)

    def __call__(self, batch: dict) -> dict:
        blank_CHW = np.zeros((3, self.size, self.size), np.float32)
        images, valid = [], []
        paths = batch.get("path")
        for i, data in enumerate(batch["bytes"]):
            arr = self._decode(bytes(data)) if data is not None else None
            if arr is None:
                log.warning("skipping undecodable image %s", paths[i] if paths is not None else f"row {i}")
            images.append(blank_CHW if arr is None else arr)
            valid.append(arr is not None)
        return {"image": np.stack(images) if images else np.zeros((0, 3, self.size, self.size), np.float32),
                "valid": np.array(valid, dtype=bool)}


def source_path(cfg: DataSettings, storage_dir: str) -> str:
    """Where the pipeline reads: the configured path, or the generated dataset's parquet folder (written here)."""
    if cfg.source in ("parquet", "images"):
        return cfg.path
    from .datasets import write_generated

    root = cfg.path or str(Path(storage_dir) / "datasets")
    return str(write_generated(cfg.source, root, cfg.num_images, side=max(cfg.image_size, 32), seed=cfg.seed))


def read_raw(cfg: DataSettings, path: str):
    """The unprocessed dataset with one `bytes` column (and `path` for folders)."""
    import ray.data

    # File order is shuffled (reseeded every epoch): with a fixed order the same tail rows would be the ones
    # drop_last discards every epoch, and each worker would always see the same files.
    shuffle = ray.data.FileShuffleConfig(seed=cfg.seed)
    # Read tasks default to 1 CPU each; on a 2-CPU node with 2 Train workers (0.5 each) and the decode actor that
    # never fits and fit() hangs (the deadlock in ray-notes §6.4), so reads get the same fraction as decoding.
    if cfg.source == "images":
        # include_paths adds a string column; the decode stage consumes it so iter_torch_batches never sees it.
        return ray.data.read_binary_files(path, include_paths=True, file_extensions=IMAGE_EXTENSIONS, shuffle=shuffle,
                                          num_cpus=cfg.map_cpus)
    ds = ray.data.read_parquet(path, file_extensions=["parquet"], shuffle=shuffle, num_cpus=cfg.map_cpus)
    ds = ds.select_columns([cfg.column])
    return ds.rename_columns({cfg.column: "bytes"})


def build_dataset(cfg: DataSettings, storage_dir: str):
    """The streaming training dataset: columns `image` (float32 3 x S x S in [-1, 1]) and `valid` (bool)."""
    import ray.data

    raw = read_raw(cfg, source_path(cfg, storage_dir))
    return raw.map_batches(
        ImageDecoder,
        fn_constructor_kwargs={"image_size": cfg.image_size, "crop_scale_min": cfg.crop_scale_min,
                               "hflip": cfg.hflip, "max_pixels": cfg.max_image_pixels, "seed": cfg.seed},
        batch_size=cfg.batch_size, batch_format="numpy", num_cpus=cfg.map_cpus,
        compute=ray.data.ActorPoolStrategy(size=cfg.map_workers))
