"""Ray Data pipelines that feed Ray Train workers: one pipeline for the whole run, every epoch inside it.

Indexed pipeline (training splits up to `data.materialize_max_mb`, which covers every dataset this box trains on):
the split's encoded bytes are read once into the object store; the dataset is `range(samples the run still needs)`
-> `map_batches(SampleDecoder)` on a bounded actor pool. Global sample s is row perm_e[s mod N] of epoch
e = s div N (a fresh permutation per epoch from data.seed), cropped and flipped by an RNG seeded with (seed, s). So
epochs cost nothing at their boundary (no pipeline restart), and the data position is one number: a resumed run
builds the pipeline from the checkpoint's sample count and continues with exactly the samples it had not seen, with
the same augmentation, without reading and dropping any.

Streaming pipeline (larger splits, e.g. a LAION-scale parquet lake): read (parquet image-bytes column, or a folder of
image files, file order reshuffled per epoch) -> decode in `map_batches`. It is built once per epoch by the loop; a
resume skips the epoch's consumed batches (documented departure: a lake cannot be indexed row by row cheaply).

Corrupt or unreadable images never fail the job: the decode stage emits them with `valid = False` and a blank image,
and the training loop drops them and counts them. A folder is read with `read_binary_files` rather than
`read_images` because `read_images` decodes inside the read task, where one bad file fails the whole read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from tokenflow_ray.tokenizer.preprocess import decode_rgb, random_crop_resize, sample_uniforms
from tokenflow_ray.tokenizer.training.config import DataSettings
from tokenflow_ray.tokenizer.training.split import IMAGE_EXTENSIONS, resolve_split

log = logging.getLogger(__name__)


def _decode_rgb(data, max_pixels: int):
    if data is None:
        return None
    try:
        return decode_rgb(bytes(data), max_pixels)
    except ValueError:  # undecodable, or over max_pixels (ImageTooLarge is a ValueError): counted as corrupt
        return None


def _decode_one(data, size: int, max_pixels: int, u4, crop_min: float, hflip: bool) -> np.ndarray | None:
    rgb = _decode_rgb(data, max_pixels)
    return None if rgb is None else random_crop_resize(rgb, size, u4, crop_min, hflip)


def _stack(images: list, valid: list, size: int, extra: dict | None = None) -> dict:
    blank = np.zeros((3, size, size), np.float32)
    out = {"image": np.stack([blank if a is None else a for a in images]) if images
           else np.zeros((0, 3, size, size), np.float32), "valid": np.array(valid, dtype=bool)}
    out.update(extra or {})
    return out


class ImageDecoder:
    """Streaming pipeline stage: bytes -> float32 N x 3 x S x S in [-1, 1] plus a `valid` flag per row."""

    def __init__(self, image_size: int, crop_scale_min: float, hflip: bool, max_pixels: int, seed: int) -> None:
        import os

        self.size, self.crop_min, self.hflip, self.max_pixels = image_size, crop_scale_min, hflip, max_pixels
        # Per-actor stream: two decode actors must not apply the same crops to different images in lockstep.
        self.rng = np.random.default_rng([seed, os.getpid()])

    def __call__(self, batch: dict) -> dict:
        images = [_decode_one(d, self.size, self.max_pixels, self.rng.random(4), self.crop_min, self.hflip)
                  for d in batch["bytes"]]
        paths = batch.get("path")
        for i, a in enumerate(images):
            if a is None:
                log.warning("skipping undecodable image %s", paths[i] if paths is not None else f"row {i}")
        return _stack(images, [a is not None for a in images], self.size)


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 7]).permutation(n)


class SampleDecoder:
    """Indexed pipeline stage: sample ids -> images; deterministic in (seed, sample id) alone. Each row is decoded
    once per actor and kept (up to `cache_mb` of pixels): later epochs only crop and resize."""

    def __init__(self, rows, num_rows: int, offset: int, image_size: int, crop_scale_min: float, hflip: bool,
                 max_pixels: int, seed: int, cache_mb: int = 1024) -> None:
        import ray

        # The bytes arrive as [ObjectRef] (a bare ref in kwargs would not be resolved); every actor shares one copy.
        self.rows = ray.get(rows[0]) if isinstance(rows, list) else rows
        self.n, self.offset, self.size, self.crop_min, self.hflip = num_rows, offset, image_size, crop_scale_min, hflip
        self.max_pixels, self.seed = max_pixels, seed
        self._perm: tuple[int, np.ndarray] | None = None
        self._cache: dict[int, object] = {}
        self._cache_left = cache_mb << 20

    def _rgb(self, row: int):
        from PIL import Image

        data = self.rows[row]
        if isinstance(data, np.ndarray):  # decoded on the driver (predecode): nothing to decode here
            return Image.fromarray(data) if data.size else None
        if row in self._cache:
            return self._cache[row]
        rgb = _decode_rgb(data, self.max_pixels)
        size = 3 * rgb.width * rgb.height if rgb is not None else 0
        if size <= self._cache_left:
            self._cache[row], self._cache_left = rgb, self._cache_left - size
        return rgb

    def _row(self, sample: int) -> int:
        epoch, pos = divmod(sample, self.n)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, epoch_permutation(self.seed, epoch, self.n))
        return int(self._perm[1][pos])

    def __call__(self, batch: dict) -> dict:
        samples = batch["id"].astype(np.int64) + self.offset
        u = sample_uniforms(self.seed, samples)
        images = []
        for s, u4 in zip(samples, u):
            rgb = self._rgb(self._row(int(s)))
            images.append(None if rgb is None else random_crop_resize(rgb, self.size, u4, self.crop_min, self.hflip))
        return _stack(images, [a is not None for a in images], self.size, {"sample": samples})


@dataclass(frozen=True)
class TrainData:
    dataset: object  # ray.data.Dataset
    indexed: bool  # True: one pipeline for the whole run (epochs inside it); False: the loop rebuilds per epoch
    num_rows: int | None  # rows of the training split (indexed only)
    offset: int  # first global sample id of this pipeline (the resumed data position)


def _read_rows(files: tuple[str, ...], cfg: DataSettings) -> list:
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    if cfg.source == "images":
        out = []
        for f in files:
            fs, p = pafs.FileSystem.from_uri(f) if "://" in f else (pafs.LocalFileSystem(), f)
            with fs.open_input_file(p) as handle:
                out.append(handle.read())
        return out
    column = "image" if cfg.source in ("digits", "shapes") else cfg.column
    out = []
    for f in files:
        out += pq.read_table(f, columns=[column]).column(column).to_pylist()
    return out


def predecode(rows: list, max_pixels: int, budget_bytes: int) -> np.ndarray:
    """The rows as decoded uint8 H x W x 3 arrays when they fit the budget (a corrupt row: an empty array), else
    the encoded bytes unchanged. Decoding once here takes PNG/JPEG decoding off the training cores for every epoch;
    the decode actors then only crop and resize."""
    out, used = np.empty(len(rows), dtype=object), 0
    for i, data in enumerate(rows):
        rgb = _decode_rgb(data, max_pixels)
        arr = np.asarray(rgb, dtype=np.uint8) if rgb is not None else np.zeros((0, 0, 3), np.uint8)
        used += arr.nbytes
        if used > budget_bytes:
            log.info("training split too large to keep decoded (%d MiB budget): decoding per sample", budget_bytes >> 20)
            fallback = np.empty(len(rows), dtype=object)
            fallback[:] = rows
            return fallback
        out[i] = arr
    return out


def split_bytes(files: tuple[str, ...], cfg: DataSettings) -> int:
    import pyarrow.fs as pafs

    total = 0
    for f in files:
        fs, p = pafs.FileSystem.from_uri(f) if "://" in f else (pafs.LocalFileSystem(), f)
        total += fs.get_file_info(p).size or 0
    return total


def build_train_data(cfg: DataSettings, storage_dir: str, image_size: int, samples_needed: int,
                     offset: int = 0) -> TrainData:
    """The training pipeline for `samples_needed` more samples from global sample `offset` (the data position)."""
    import ray
    import ray.data

    split = resolve_split(cfg, storage_dir, image_size)
    if split_bytes(split.train_files, cfg) > cfg.materialize_max_mb * 2 ** 20:
        return TrainData(_streaming(cfg, split.train_files, image_size), indexed=False, num_rows=None, offset=0)
    rows = _read_rows(split.train_files, cfg)
    if not rows:
        raise ValueError(f"the training split of data.source {cfg.source!r} is empty")
    ref = ray.put(predecode(rows, cfg.max_image_pixels, cfg.materialize_max_mb << 20))
    ds = ray.data.range(samples_needed, override_num_blocks=max(1, min(64, samples_needed // (4 * cfg.batch_size))))
    ds = ds.map_batches(
        SampleDecoder, fn_constructor_kwargs={"rows": [ref], "num_rows": len(rows), "offset": offset,
                                              **_decoder_kwargs(cfg, image_size)},
        batch_size=cfg.batch_size, batch_format="numpy", num_cpus=cfg.map_cpus,
        compute=ray.data.ActorPoolStrategy(size=cfg.map_workers))
    return TrainData(ds, indexed=True, num_rows=len(rows), offset=offset)


def _decoder_kwargs(cfg: DataSettings, image_size: int) -> dict:
    return {"image_size": image_size, "crop_scale_min": cfg.crop_scale_min, "hflip": cfg.hflip,
            "max_pixels": cfg.max_image_pixels, "seed": cfg.seed}


def read_raw(cfg: DataSettings, paths: list[str]):
    """The unprocessed dataset with one `bytes` column (and `path` for folders), over the given files."""
    import ray.data

    # File order is shuffled (reseeded every epoch): with a fixed order the same tail rows would be the ones
    # drop_last discards every epoch, and each worker would always see the same files.
    shuffle = ray.data.FileShuffleConfig(seed=cfg.seed)
    # Read tasks default to 1 CPU each; on a 2-CPU node with 2 Train workers (0.5 each) and the decode actor that
    # never fits and fit() hangs (the deadlock in ray-notes §6.4), so reads get the same fraction as decoding.
    if cfg.source == "images":
        # include_paths adds a string column; the decode stage consumes it so iter_torch_batches never sees it.
        return ray.data.read_binary_files(paths, include_paths=True, file_extensions=list(IMAGE_EXTENSIONS),
                                          shuffle=shuffle, num_cpus=cfg.map_cpus)
    column = "image" if cfg.source in ("digits", "shapes") else cfg.column
    ds = ray.data.read_parquet(paths, file_extensions=["parquet"], shuffle=shuffle, num_cpus=cfg.map_cpus)
    return ds.select_columns([column]).rename_columns({column: "bytes"})


def build_dataset(cfg: DataSettings, storage_dir: str, image_size: int):
    """The streaming pipeline over the training split: columns `image` (float32 3 x S x S) and `valid` (bool)."""
    return _streaming(cfg, resolve_split(cfg, storage_dir, image_size).train_files, image_size)


def _streaming(cfg: DataSettings, files: tuple[str, ...], image_size: int):
    import ray.data

    return read_raw(cfg, list(files)).map_batches(
        ImageDecoder, fn_constructor_kwargs=_decoder_kwargs(cfg, image_size), batch_size=cfg.batch_size,
        batch_format="numpy", num_cpus=cfg.map_cpus, compute=ray.data.ActorPoolStrategy(size=cfg.map_workers))
