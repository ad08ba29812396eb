"""Scores for one trained tokenizer: PSNR/SSIM, probes (trained on B, tested on C), codebook statistics, NMI.

Probes are logistic regressions on (a) token ids, one-hot per grid position, and (b) code embeddings, the flattened
quantised 40-d map; each predicts the digit and the colour. Codebook statistics are taken on split C's tokens.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def psnr_per_image(recon_NCHW: torch.Tensor, target_NCHW: torch.Tensor) -> torch.Tensor:
    """PSNR in dB on [0, 1] pixels (inputs are [-1, 1])."""
    mse = (((recon_NCHW.clamp(-1, 1) - target_NCHW) / 2) ** 2).flatten(1).mean(1)
    return 10 * torch.log10(1.0 / mse.clamp_min(1e-10))


def ssim_per_image(recon_NCHW: torch.Tensor, target_NCHW: torch.Tensor, window: int = 7) -> torch.Tensor:
    """SSIM (Wang et al. 2004) with a Gaussian window (sigma 1.5), per channel, averaged; on [0, 1] pixels."""
    x, y = (recon_NCHW.clamp(-1, 1) + 1) / 2, (target_NCHW + 1) / 2
    coords = torch.arange(window, dtype=x.dtype) - window // 2
    g = torch.exp(-(coords ** 2) / (2 * 1.5 ** 2))
    g = (g / g.sum())
    kernel = (g[:, None] * g[None, :]).expand(3, 1, window, window)
    blur = lambda t: F.conv2d(t, kernel, padding=window // 2, groups=3)  # noqa: E731
    mu_x, mu_y = blur(x), blur(y)
    var_x, var_y, cov = blur(x * x) - mu_x ** 2, blur(y * y) - mu_y ** 2, blur(x * y) - mu_x * mu_y
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    ssim = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))
    return ssim.flatten(1).mean(1)


def token_ids_N(idx_NHW: np.ndarray, k: int) -> np.ndarray:
    """One code id per token; separate-mode pairs (sem, pix) become one id in [0, K^2) for the statistics."""
    if idx_NHW.ndim == 4:
        return idx_NHW[..., 0] * k + idx_NHW[..., 1]
    return idx_NHW


def onehot_positions(idx: np.ndarray, k: int):
    """Sparse one-hot of (grid position, code) per image: the 'token id' probe features."""
    from scipy.sparse import csr_matrix

    flat = idx.reshape(idx.shape[0], -1)  # separate mode: both streams flatten into twice the positions
    n, slots = flat.shape
    cols = (np.arange(slots)[None, :] * k + flat).ravel()
    rows = np.repeat(np.arange(n), slots)
    return csr_matrix((np.ones(n * slots, dtype=np.float32), (rows, cols)), shape=(n, slots * k))


def probe_accuracy(train_x, train_y, test_x, test_y, dense: bool) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    # max_iter 100 / tol 1e-3: why — the probes dominate runtime on 2 cores; accuracy moves < 1 point past this.
    clf = LogisticRegression(max_iter=100, tol=1e-3, C=1.0)
    model = make_pipeline(StandardScaler(), clf) if dense else clf
    model.fit(train_x, train_y)
    return float((model.predict(test_x) == test_y).mean())


def codebook_stats(ids_N: np.ndarray, k: int, streams: int) -> dict:
    counts = np.bincount(ids_N.ravel(), minlength=k ** streams if streams == 2 else k)
    p = counts[counts > 0] / counts.sum()
    return {"perplexity": float(np.exp(-(p * np.log(p)).sum())), "cluster_sizes": np.sort(counts)[::-1]}


def usage_fraction(idx: np.ndarray, k: int) -> float:
    """Unique codes / K, averaged over the index streams (TF-sep has two tables)."""
    if idx.ndim == 4:
        return float(np.mean([len(np.unique(idx[..., s])) / k for s in range(idx.shape[-1])]))
    return len(np.unique(idx)) / k


def nmi_tokens(ids_N: np.ndarray, labels_img: np.ndarray) -> float:
    """NMI between each token's code and its image's label (every token inherits the label)."""
    from sklearn.metrics import normalized_mutual_info_score

    per_img = ids_N.reshape(ids_N.shape[0], -1)
    return float(normalized_mutual_info_score(np.repeat(labels_img, per_img.shape[1]), per_img.ravel()))
