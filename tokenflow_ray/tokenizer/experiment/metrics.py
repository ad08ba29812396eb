"""Scores for one trained tokenizer: PSNR/SSIM, probes (trained on B, tested on C), codebook statistics, NMI.

Probes are logistic regressions on (a) token ids, one-hot per grid position, and (b) code embeddings, the flattened
quantised 40-d map; each predicts the digit and the colour. Codebook statistics are taken on split C's tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenflow_ray.tokenizer import image_metrics


def psnr_per_image(recon_NCHW: torch.Tensor, target_NCHW: torch.Tensor) -> torch.Tensor:
    """PSNR in dB on [0, 1] pixels (inputs are [-1, 1]); the shared definition (tokenizer/image_metrics.py)."""
    return image_metrics.psnr(recon_NCHW, target_NCHW)


def ssim_per_image(recon_NCHW: torch.Tensor, target_NCHW: torch.Tensor) -> torch.Tensor:
    """SSIM per image; the shared definition (tokenizer/image_metrics.py)."""
    return image_metrics.ssim(recon_NCHW, target_NCHW)


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
