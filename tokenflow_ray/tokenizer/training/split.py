"""The train / held-out split, decided once, by file: training reads only `train_files`, evaluation only
`eval_files`, so no evaluation image was ever a training image.

* Generated sources (digits, shapes) write two folders, `train` and `eval`; the digits' eval folder draws from held-out
  sklearn source drawings (every 5th), so an eval digit is a drawing training never saw, not a recolouring of one.
* parquet / images: `data.eval_path` when given; else the files whose name hashes (crc32) below
  `data.holdout_fraction` (at least one file, never all): stable when files are added, no list to keep.
Listing goes through pyarrow's filesystem layer, so local folders and s3:// / gs:// paths work alike.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

from tokenflow_ray.tokenizer.training.config import DataSettings

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "gif", "webp", "tif", "tiff")


@dataclass(frozen=True)
class Split:
    train_files: tuple[str, ...]
    eval_files: tuple[str, ...]


def list_files(path: str, extensions: tuple[str, ...]) -> list[str]:
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(),
                                                                     str(Path(path).expanduser().resolve()))
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        found = [root]
    elif info.type == pafs.FileType.Directory:
        found = [f.path for f in fs.get_file_info(pafs.FileSelector(root, recursive=True))
                 if f.type == pafs.FileType.File and f.path.rsplit(".", 1)[-1].lower() in extensions]
    else:
        raise FileNotFoundError(f"data path not found: {path}")
    prefix = path.split("://", 1)[0] + "://" if "://" in path else ""
    return sorted(prefix + p if prefix and not p.startswith(prefix) else p for p in found)


def _held_out(name: str, fraction: float) -> bool:
    return zlib.crc32(Path(name).name.encode()) / 2 ** 32 < fraction


def hash_split(files: list[str], fraction: float) -> Split:
    if len(files) < 2:
        raise ValueError(f"a held-out split by file needs >= 2 files, found {len(files)}: set data.eval_path")
    held = [f for f in files if _held_out(f, fraction)]
    if not held:  # at least one file: the one hashing lowest
        held = [min(files, key=lambda f: zlib.crc32(Path(f).name.encode()))]
    if len(held) == len(files):
        held = held[:-1] or held
    held_set = set(held)
    return Split(tuple(f for f in files if f not in held_set), tuple(held))


def resolve_split(cfg: DataSettings, storage_dir: str, image_size: int = 32) -> Split:
    exts = IMAGE_EXTENSIONS if cfg.source == "images" else ("parquet",)
    if cfg.source in ("digits", "shapes"):
        from tokenflow_ray.tokenizer.training.datasets import write_generated

        root = cfg.path or str(Path(storage_dir) / "datasets")
        side = max(32, image_size)  # generated at >= 32 px; crops resize down to the model's side
        train = write_generated(cfg.source, root, cfg.num_images, side=side, seed=cfg.seed, split="train")
        held = write_generated(cfg.source, root, cfg.num_eval_images, side=side, seed=cfg.seed, split="eval")
        return Split(tuple(list_files(str(train), exts)), tuple(list_files(str(held), exts)))
    files = list_files(cfg.path, exts)
    if cfg.eval_path:
        held = list_files(cfg.eval_path, exts)
        overlap = set(held) & set(files)
        if overlap:
            raise ValueError(f"data.eval_path shares {len(overlap)} files with data.path (e.g. {sorted(overlap)[0]})")
        return Split(tuple(files), tuple(held))
    return hash_split(files, cfg.holdout_fraction)
