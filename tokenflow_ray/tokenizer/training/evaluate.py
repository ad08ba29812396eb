"""Reconstruction evaluation: PSNR and SSIM over a held-out set, codebook usage, and a PNG grid of samples.

Runs in one process (no Ray): evaluation sets are small next to training sets, and the job stays debuggable.
PSNR and SSIM are on [0, 1] pixels; SSIM is the standard Gaussian-window form (sigma 1.5, window <= 11, smaller on
tiny images), averaged over channels.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import DataSettings, TrainConfig


@dataclass(frozen=True)
class EvalResult:
    psnr: float
    ssim: float
    usage: float  # unique indices used over the evaluation set / K
    num_images: int
    grid_png: str | None  # originals (top) over reconstructions (bottom)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def psnr(x_BCHW: torch.Tensor, y_BCHW: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB for images in [-1, 1]."""
    mse_B = (((x_BCHW - y_BCHW) / 2) ** 2).flatten(1).mean(1).clamp_min(1e-10)
    return 10 * torch.log10(1 / mse_B)


def ssim(x_BCHW: torch.Tensor, y_BCHW: torch.Tensor) -> torch.Tensor:
    """Per-image SSIM for images in [-1, 1]."""
    x, y = (x_BCHW + 1) / 2, (y_BCHW + 1) / 2
    size = min(11, x.shape[-1] - (1 - x.shape[-1] % 2))  # odd, no larger than the image
    coords = torch.arange(size, dtype=x.dtype) - size // 2
    g = torch.exp(-coords ** 2 / (2 * 1.5 ** 2))
    g = g / g.sum()
    win = (g[:, None] * g[None, :]).expand(x.shape[1], 1, size, size)
    blur = lambda t: F.conv2d(t, win, groups=x.shape[1])  # noqa: E731
    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y, cov = blur(x * x) - mu_x ** 2, blur(y * y) - mu_y ** 2, blur(x * y) - mu_x * mu_y
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
    return s.flatten(1).mean(1)


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


def load_eval_images(cfg: DataSettings, storage_dir: str, num_images: int) -> torch.Tensor:
    """Held-out images, decoded without augmentation. Generated sources use another seed (unseen drawings)."""
    import numpy as np
    import pyarrow.parquet as pq

    from .data import IMAGE_EXTENSIONS, ImageDecoder, source_path

    if cfg.source in ("digits", "shapes"):
        cfg = dataclasses.replace(cfg, seed=cfg.seed + 1000, num_images=num_images)
    folder = Path(source_path(cfg, storage_dir))
    if cfg.source == "images":
        files = sorted(p for p in folder.rglob("*") if p.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS)
        blobs = [p.read_bytes() for p in files[:num_images]]
    else:
        blobs = []
        for f in sorted(folder.glob("*.parquet")):
            blobs += pq.read_table(f, columns=[cfg.column]).column(cfg.column).to_pylist()
            if len(blobs) >= num_images:
                break
    decoder = ImageDecoder(cfg.image_size, 1.0, False, cfg.max_image_pixels, cfg.seed)
    out = decoder({"bytes": np.array(blobs[:num_images], dtype=object)})
    return torch.from_numpy(out["image"][out["valid"]])


@torch.no_grad()
def evaluate_model(model, images_NCHW: torch.Tensor, batch_size: int = 64, grid_path: str | Path | None = None):
    model.eval()
    psnrs, ssims, used, recons = [], [], set(), []
    for start in range(0, images_NCHW.shape[0], batch_size):
        x = images_NCHW[start:start + batch_size]
        enc = model.encode(x)
        recon = model.decode(enc.idx_per_scale).clamp(-1, 1)
        psnrs.append(psnr(recon, x))
        ssims.append(ssim(recon, x))
        for idx in enc.idx_per_scale:
            used.update(idx.flatten().tolist())
        recons.append(recon)
    grid = save_grid(images_NCHW, torch.cat(recons), grid_path) if grid_path else None
    return EvalResult(psnr=float(torch.cat(psnrs).mean()), ssim=float(torch.cat(ssims).mean()),
                      usage=len(used) / model.config.quantizer.codebook_size, num_images=int(images_NCHW.shape[0]),
                      grid_png=str(grid) if grid else None)


def evaluate_checkpoint(checkpoint: str | Path, out_dir: str | Path, num_images: int = 256,
                        use_ema: bool = True) -> EvalResult:
    """Evaluate a training checkpoint (or a run folder: its latest checkpoint); writes metrics.json + samples.png."""
    from .checkpoint import latest_checkpoint_dir, load_state, model_from_state

    state = load_state(latest_checkpoint_dir(checkpoint))
    cfg = TrainConfig.from_dict(state.config)
    model = model_from_state(state, use_ema=use_ema)
    images = load_eval_images(cfg.data, cfg.run.storage_dir, num_images)
    out = Path(out_dir)
    result = evaluate_model(model, images, grid_path=out / "samples.png")
    (out / "metrics.json").write_text(json.dumps({**result.to_dict(), "step": state.step}, indent=2))
    return result
