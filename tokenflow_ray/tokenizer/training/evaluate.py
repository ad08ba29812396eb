"""Reconstruction evaluation on the held-out split: PSNR, SSIM, rFID, codebook usage, and a PNG grid of samples.

The images are the split's held-out files (training/split.py: training never reads them), preprocessed exactly as
serving does (preprocess.center_crop_resize: centre square, bicubic to the model's side; no augmentation). Metrics
come from tokenizer/image_metrics.py (torchmetrics PSNR/SSIM; rFID via torchmetrics over a local feature network,
`eval.fid_features`, null when unset). Runs in one process (no Ray): evaluation sets are small next to training sets.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenflow_ray.tokenizer import image_metrics
from tokenflow_ray.tokenizer.training.config import DataSettings, TrainConfig


@dataclass(frozen=True)
class EvalResult:
    psnr: float
    ssim: float
    rfid: float | None  # None when no feature network is configured
    usage: float  # unique indices used over the evaluation set / K
    num_images: int
    files: list  # the held-out files the images came from
    grid_png: str | None  # originals (top) over reconstructions (bottom)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def save_grid(orig_BCHW: torch.Tensor, recon_BCHW: torch.Tensor, path: str | Path, max_images: int = 8) -> Path:
    from PIL import Image

    n = min(max_images, orig_BCHW.shape[0])
    rows = [torch.cat(list(t[:n]), dim=2) for t in (orig_BCHW, recon_BCHW)]  # each 3 x H x (n W)
    grid_CHW = torch.cat(rows, dim=1)
    arr = ((grid_CHW.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path


def load_eval_images(cfg: DataSettings, storage_dir: str, image_size: int, num_images: int,
                     max_pixels: int | None = None) -> tuple[torch.Tensor, list[str]]:
    """Up to `num_images` held-out images (centre-cropped, as served) and the files they came from."""
    import numpy as np

    from tokenflow_ray.tokenizer.preprocess import center_crop_resize, decode_rgb
    from tokenflow_ray.tokenizer.training.data import _read_rows
    from tokenflow_ray.tokenizer.training.split import resolve_split

    split = resolve_split(cfg, storage_dir, image_size)
    arrays, used = [], []
    for f in split.eval_files:
        for data in _read_rows((f,), cfg):
            if len(arrays) >= num_images:
                break
            try:
                arrays.append(center_crop_resize(decode_rgb(bytes(data), max_pixels or cfg.max_image_pixels),
                                                 image_size))
            except ValueError:
                continue  # a corrupt held-out image is skipped, as in training
        used.append(f)
        if len(arrays) >= num_images:
            break
    if not arrays:
        raise ValueError(f"no decodable held-out images in {list(split.eval_files)[:3]}")
    return torch.from_numpy(np.stack(arrays)), used


@torch.no_grad()
def evaluate_model(model, images_NCHW: torch.Tensor, batch_size: int = 64, grid_path: str | Path | None = None,
                   fid_features: str | None = None, files: list | None = None) -> EvalResult:
    model.eval()
    psnrs, ssims, used, recons = [], [], set(), []
    rfid = image_metrics.RFID(fid_features) if fid_features else None
    for start in range(0, images_NCHW.shape[0], batch_size):
        x = images_NCHW[start:start + batch_size]
        enc = model.encode(x)
        recon = model.decode(enc.idx_per_scale).clamp(-1, 1)
        psnrs.append(image_metrics.psnr(recon, x))
        ssims.append(image_metrics.ssim(recon, x))
        if rfid is not None:
            rfid.update(x, recon)
        for idx in enc.idx_per_scale:
            used.update(idx.flatten().tolist())
        recons.append(recon)
    grid = save_grid(images_NCHW, torch.cat(recons), grid_path) if grid_path else None
    return EvalResult(psnr=float(torch.cat(psnrs).mean()), ssim=float(torch.cat(ssims).mean()),
                      rfid=rfid.compute() if rfid is not None else None,
                      usage=len(used) / model.config.quantizer.codebook_size, num_images=int(images_NCHW.shape[0]),
                      files=list(files or []), grid_png=str(grid) if grid else None)


def evaluate_checkpoint(checkpoint: str | Path, out_dir: str | Path, num_images: int | None = None,
                        use_ema: bool = True, fid_features: str | None = None) -> EvalResult:
    """Evaluate a training checkpoint (or a run folder: its latest checkpoint) on its held-out split; writes
    metrics.json + samples.png. `num_images` / `fid_features` default to the run's eval section."""
    from tokenflow_ray.tokenizer.training.checkpoint import (
        latest_checkpoint_dir,
        load_state,
        model_from_state,
    )

    state = load_state(latest_checkpoint_dir(checkpoint))
    cfg = TrainConfig.from_dict(state.config)
    model = model_from_state(state, use_ema=use_ema)
    images, files = load_eval_images(cfg.data, cfg.run.storage_dir, cfg.model.image_size,
                                     num_images or cfg.eval.num_images)
    out = Path(out_dir)
    result = evaluate_model(model, images, batch_size=cfg.eval.batch_size, grid_path=out / "samples.png",
                            fid_features=fid_features or cfg.eval.fid_features, files=files)
    (out / "metrics.json").write_text(json.dumps({**result.to_dict(), "step": state.step}, indent=2))
    return result
