"""Shared-index dual codebook: two tables (K x sem_dim, K x pix_dim), one index rule, chunked search, usage tracking.

The rule (paper §1, Fig. 3): with per-branch L2-normalised queries and codewords,

    i* = argmin_i  w_sem * ||q_sem - e_sem,i||^2 + w_dis * ||q_pix - e_pix,i||^2

Because every vector is unit length, ||q - e||^2 = 2 - 2 q.e, so the argmin is the argmax of one dot product between
the query [w_sem q_sem; w_dis q_pix] and the codeword [e_sem,i; e_pix,i]. That is what the search computes, in blocks
of at most query_chunk x search_chunk scores, so K = 32768 never materialises an N x K distance matrix.

"separate" mode (the TF-sep arm) searches each table on its own: two indices per token, stacked on a trailing dim of 2
(sem, pix). The multi-scale residual procedure and the VQ losses live in multiscale.py; this file is the codebook.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenflow_ray.tokenizer.config import QuantizerConfig

_EPS = 1e-8


def l2n(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return F.normalize(x, dim=dim, eps=_EPS)


def chunked_argmax_dot(q_NC: torch.Tensor, e_KC: torch.Tensor, query_chunk: int, search_chunk: int) -> torch.Tensor:
    """argmax_k q_n . e_k for every row n, scoring at most query_chunk x search_chunk pairs at a time.

    Ties resolve to the lowest k (a strict > across blocks; torch.max keeps the first within a block), the same
    answer argmin over a full distance matrix gives. One score buffer is allocated up front and reused: why —
    a fresh multi-MiB block per step is mmap'd and page-faulted each time, which costs more than the matmul.
    """
    n, k = q_NC.shape[0], e_KC.shape[0]
    qc, sc = min(query_chunk, n), min(search_chunk, k)
    eT_CK = e_KC.T.contiguous()
    buf = q_NC.new_empty(qc * sc)
    val_n, arg_n = q_NC.new_empty(qc), torch.empty(qc, dtype=torch.long, device=q_NC.device)
    idx_N = torch.empty(n, dtype=torch.long, device=q_NC.device)
    for n0 in range(0, n, qc):
        q_nC = q_NC[n0:n0 + qc]
        rows = q_nC.shape[0]
        best_val_n = torch.full((rows,), float("-inf"), dtype=q_NC.dtype, device=q_NC.device)
        best_idx_n = torch.zeros(rows, dtype=torch.long, device=q_NC.device)
        for k0 in range(0, k, sc):
            cols = min(sc, k - k0)
            score_nk = buf[:rows * cols].view(rows, cols)  # the only distance block: <= query x search chunk
            torch.mm(q_nC, eT_CK[:, k0:k0 + cols], out=score_nk)
            torch.max(score_nk, dim=1, out=(val_n[:rows], arg_n[:rows]))
            better_n = val_n[:rows] > best_val_n
            best_val_n = torch.where(better_n, val_n[:rows], best_val_n)
            best_idx_n = torch.where(better_n, arg_n[:rows] + k0, best_idx_n)
        idx_N[n0:n0 + rows] = best_idx_n
    return idx_N


class SharedIndexCodebook(nn.Module):
    """The two codebooks, the index rule, lookup, and codebook bookkeeping (usage window, dead-code restart)."""

    def __init__(self, cfg: QuantizerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        k = cfg.codebook_size
        # Paper init: Uniform(-1/K, 1/K) per entry; normalisation happens at use, so the scale is irrelevant here.
        self.embed_sem_KC = nn.Parameter(torch.empty(k, cfg.sem_dim).uniform_(-1.0 / k, 1.0 / k))
        self.embed_pix_KC = nn.Parameter(torch.empty(k, cfg.pix_dim).uniform_(-1.0 / k, 1.0 / k))
        # Rolling window of recent indices, one row per index stream; `recorded` counts how many were ever written,
        # so the valid part is the first min(recorded, W) slots (no -1 sentinels).
        self.register_buffer("recent_idx_GW", torch.zeros(self.num_streams, cfg.usage_window, dtype=torch.long))
        self.register_buffer("recorded", torch.zeros((), dtype=torch.long))

    @property
    def num_streams(self) -> int:
        return 2 if self.cfg.index_mode == "separate" else 1

    def extra_repr(self) -> str:
        c = self.cfg
        return f"K={c.codebook_size}, sem_dim={c.sem_dim}, pix_dim={c.pix_dim}, w_sem={c.w_sem}, " \
               f"w_dis={c.w_dis}, mode={c.index_mode}"

    # ---- index rule (training and inference) ----
    def normalized_codebook_KC(self) -> torch.Tensor:
        return torch.cat([l2n(self.embed_sem_KC), l2n(self.embed_pix_KC)], dim=1)

    def search(self, q_sem_NC: torch.Tensor, q_pix_NC: torch.Tensor) -> torch.Tensor:
        """Indices for unnormalised queries: idx_N (shared) or idx_N2 (separate: sem, pix)."""
        c = self.cfg
        q_sem_NC, q_pix_NC = l2n(q_sem_NC.detach()), l2n(q_pix_NC.detach())
        with torch.no_grad():
            if c.index_mode == "separate":
                idx_sem = chunked_argmax_dot(q_sem_NC, l2n(self.embed_sem_KC), c.query_chunk, c.search_chunk)
                idx_pix = chunked_argmax_dot(q_pix_NC, l2n(self.embed_pix_KC), c.query_chunk, c.search_chunk)
                return torch.stack([idx_sem, idx_pix], dim=-1)
            # Scale the query, not the codebook: argmax of [w_sem q_sem; w_dis q_pix] . [e_sem; e_pix].
            q_NC = torch.cat([c.w_sem * q_sem_NC, c.w_dis * q_pix_NC], dim=1)
            return chunked_argmax_dot(q_NC, self.normalized_codebook_KC(), c.query_chunk, c.search_chunk)

    def lookup(self, idx: torch.Tensor) -> torch.Tensor:
        """Codewords [n(e_sem); n(e_pix)] for idx_* (shared) or idx_*2 (separate); output shape idx.shape[:...] + (C,)."""
        self.check_indices(idx)
        if self.cfg.index_mode == "separate":
            return torch.cat([l2n(self.embed_sem_KC)[idx[..., 0]], l2n(self.embed_pix_KC)[idx[..., 1]]], dim=-1)
        return torch.cat([l2n(self.embed_sem_KC)[idx], l2n(self.embed_pix_KC)[idx]], dim=-1)

    def check_indices(self, idx: torch.Tensor) -> None:
        if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"indices must be an integer tensor, got {idx.dtype}")
        if self.cfg.index_mode == "separate" and (idx.ndim == 0 or idx.shape[-1] != 2):
            raise ValueError(f"separate-index mode expects a trailing dim of 2 (sem, pix), got shape {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.cfg.codebook_size):
            raise ValueError(f"indices must lie in [0, {self.cfg.codebook_size}) (codebook size K), "
                             f"got min {int(idx.min())} max {int(idx.max())}")

    # ---- bookkeeping (training) ----
    @torch.no_grad()
    def record_usage(self, idx: torch.Tensor) -> None:
        idx_GN = idx.reshape(-1, self.num_streams).T
        w = self.cfg.usage_window
        n = idx_GN.shape[1]
        if n >= w:  # a batch bigger than the window fills it alone
            self.recent_idx_GW.copy_(idx_GN[:, -w:])
        else:
            pos = int(self.recorded) % w
            first = min(n, w - pos)
            self.recent_idx_GW[:, pos:pos + first] = idx_GN[:, :first]
            self.recent_idx_GW[:, :n - first] = idx_GN[:, first:]
        self.recorded += n

    def usage_counts_GK(self) -> torch.Tensor:
        valid = min(int(self.recorded), self.cfg.usage_window)
        counts = torch.zeros(self.num_streams, self.cfg.codebook_size, dtype=torch.long, device=self.recorded.device)
        if valid:
            counts.scatter_add_(1, self.recent_idx_GW[:, :valid], torch.ones_like(self.recent_idx_GW[:, :valid]))
        return counts

    def usage(self) -> float:
        """Paper statistic: unique indices in the window / K (mean over index streams)."""
        return float((self.usage_counts_GK() > 0).float().mean())

    @torch.no_grad()
    def restart_dead_codes(self, z_sem_NC: torch.Tensor, z_pix_NC: torch.Tensor, generator=None) -> int:
        """Re-initialise codes absent from a full usage window with random recent encoder outputs.

        Why: on small data most of a large codebook never wins a search, so it never gets a gradient (the dead-code
        pitfall in §6). Waiting for a full window avoids restarting codes that merely have not had a chance yet.
        In shared mode a dead row i is reset in both tables from the same token, so the pair stays coherent.
        """
        if int(self.recorded) < self.cfg.usage_window or z_sem_NC.shape[0] == 0:
            return 0
        dead_GK = self.usage_counts_GK() == 0
        tables = [(self.embed_sem_KC, z_sem_NC), (self.embed_pix_KC, z_pix_NC)]
        restarted = 0
        for g in range(self.num_streams):
            dead_rows = dead_GK[g].nonzero().squeeze(1)
            if dead_rows.numel() == 0:
                continue
            pick = torch.randint(0, z_sem_NC.shape[0], (dead_rows.numel(),), generator=generator,
                                 device=z_sem_NC.device)
            targets = tables if self.num_streams == 1 else [tables[g]]
            for table_KC, z_NC in targets:
                table_KC[dead_rows] = l2n(z_NC[pick].to(table_KC.dtype))
            restarted += dead_rows.numel()
        # The window is kept: a restarted code that still wins nothing is simply restarted again next time.
        return restarted
