"""Attention over the paged KV pool, behind one interface.

Token layout of a step: the D decode tokens first, then each prefill chunk's tokens. Every backend first writes the
step's new K/V into the pool slots (slot = block * block_size + offset), then attends over each stream's context
through its block table, so prefill, decode, chunked prefill and resumed streams all read the same pool.

- `SdpaPagedAttention`: torch SDPA (CPU, or GPU without flash-attn). Decodes are one batched call: query heads are
  grouped per KV head ([D, kv_heads, group, head_dim]), so GQA needs no KV repeat; blocks are gathered by index.
- `CpuPagedAttention`: SDPA for prefill chunks, and for decodes a C++ kernel that reads each stream's blocks in
  place (csrc/paged_decode_attention.cpp): decode attention is memory-bound, and the gather copy doubled its traffic.
- `FlashPagedAttention`: flash-attn's `flash_attn_with_kvcache` with block tables, no gather at all.
- `TritonPagedAttention` (triton_attention.py): Triton kernels over the block tables, the CUDA path without flash-attn.

Which one a runner gets: attention_select.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class PrefillSpan:
    start: int  # first token of the chunk in the step's flat batch
    end: int
    start_pos: int  # position of that token in its stream (tokens before it are already in the pool)
    block_table: torch.Tensor  # [blocks] long (int32 for flash)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks]
    decode_seq_lens: torch.Tensor | None  # [D] context length including the new token
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool (SDPA only)
    prefills: list[PrefillSpan]
    scale: float
    kv_written: bool = False  # the model already wrote the step's K/V into the pool (fused RoPE + KV write)
    # Set for the CPU paged kernel, which reads the persistent tables in place: `decode_block_tables` is then the
    # whole [rows, max_blocks] table, decode d's row in it decode_rows[d], its context decode_positions[d] + 1 tokens
    # (no gathered table and no lengths tensor to build each step; decode_seq_lens is None).
    decode_rows: torch.Tensor | None = None  # [D] int64
    decode_positions: torch.Tensor | None = None  # [D] int64
    # The varlen form (the Triton backend): sequences in token order (decodes first), all on the device. A
    # sequence's table is block_tables[seq_rows[s]] (the persistent tables, no per-step gather), its length after
    # this step seq_lens[s], its tokens query_start[s]:query_start[s + 1] (None when every sequence has one token).
    block_tables: torch.Tensor | None = None  # [rows, max_blocks] long
    seq_rows: torch.Tensor | None = None  # [S] long
    seq_lens: torch.Tensor | None = None  # [S] long
    query_start: torch.Tensor | None = None  # [S + 1] long
    max_query_len: int = 0  # host-side: picks the launch (decode-only when 1)
    num_seqs: int = 0


class AttentionBackend(Protocol):
    """k_THD and v_THD may be None when the step has no prefill chunks and `meta.kv_written`: every decode then
    reads its context, its new token included, from the pool."""

    name: str

    def forward(self, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


def write_kv(k_THD: torch.Tensor, v_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """k_cache/v_cache: [blocks, block_size, kv_heads, head_dim]. A layer-major pool flattens to one row per slot;
    a block-major pool's layer view is strided over blocks, so its slots are indexed as (block, offset)."""
    if meta.kv_written:
        return
    slot_mapping = meta.slot_mapping
    if k_cache.is_contiguous():
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k_THD)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v_THD)
        return
    bs = k_cache.shape[1]
    block, offset = slot_mapping // bs, slot_mapping % bs
    k_cache[block, offset] = k_THD
    v_cache[block, offset] = v_THD


class SdpaPagedAttention:
    name = "sdpa"

    def forward(self, q_THD, k_THD, v_THD, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if not q_THD.is_cuda:
            return self._forward(q_THD, k_THD, v_THD, k_cache, v_cache, meta)
        # On CUDA pinned to one kernel family: memory-efficient attention (math only for inputs it rejects),
        # never cuDNN, whose per-shape graph builds made every new batch size and gathered width a slow step.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return self._forward(q_THD, k_THD, v_THD, k_cache, v_cache, meta)

    def _forward(self, q_THD, k_THD, v_THD, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k_THD, v_THD, k_cache, v_cache, meta)
        T, H, Dh = q_THD.shape
        kvh = k_cache.shape[2]
        out_THD = torch.empty_like(q_THD)
        D = meta.num_decodes
        if D:
            q_DKGD = q_THD[:D].view(D, kvh, H // kvh, Dh)
            k_DKLD = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)
            v_DKLD = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)
            o = F.scaled_dot_product_attention(q_DKGD, k_DKLD, v_DKLD, attn_mask=meta.decode_mask, scale=meta.scale)
            out_THD[:D] = o.reshape(D, H, Dh)
        self._prefill(q_THD, k_THD, v_THD, k_cache, v_cache, meta, out_THD)
        return out_THD.view(T, H * Dh)

    @staticmethod
    def _prefill(q_THD, k_THD, v_THD, k_cache, v_cache, meta: AttentionMetadata, out_THD) -> None:
        """Each prefill chunk attends to its stream's context: the chunk itself, or the pool for later chunks."""
        for span in meta.prefills:
            C = span.end - span.start
            ctx = span.start_pos + C
            q_1HCD = q_THD[span.start:span.end].transpose(0, 1).unsqueeze(0)
            if span.start_pos == 0:  # whole context is this chunk: use it directly, plain causal mask
                k_ctx, v_ctx, mask, causal = k_THD[span.start:span.end], v_THD[span.start:span.end], None, True
            else:
                k_ctx = k_cache.index_select(0, span.block_table).flatten(0, 1)[:ctx]
                v_ctx = v_cache.index_select(0, span.block_table).flatten(0, 1)[:ctx]
                rows = torch.arange(span.start_pos, ctx, device=q_THD.device)
                mask = torch.arange(ctx, device=q_THD.device)[None, :] <= rows[:, None]
                causal = False
            o = F.scaled_dot_product_attention(q_1HCD, k_ctx.transpose(0, 1).unsqueeze(0),
                                               v_ctx.transpose(0, 1).unsqueeze(0), attn_mask=mask,
                                               is_causal=causal, scale=meta.scale, enable_gqa=True)
            out_THD[span.start:span.end] = o[0].transpose(0, 1)


class CpuPagedAttention(SdpaPagedAttention):
    """float32 on CPU: decodes through the compiled paged kernel, prefill chunks through SDPA."""

    name = "cpu_paged"

    def __init__(self, kernel) -> None:
        self._kernel = kernel

    def forward(self, q_THD, k_THD, v_THD, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        D = meta.num_decodes
        if not D:
            return super().forward(q_THD, k_THD, v_THD, k_cache, v_cache, meta)
        write_kv(k_THD, v_THD, k_cache, v_cache, meta)
        T, H, Dh = q_THD.shape
        if not meta.prefills:  # a decode-only step: the kernel's output is the whole result
            return self._decode(q_THD, k_cache, v_cache, meta).view(T, H * Dh)
        out_THD = torch.empty_like(q_THD)
        out_THD[:D] = self._decode(q_THD[:D], k_cache, v_cache, meta)
        self._prefill(q_THD, k_THD, v_THD, k_cache, v_cache, meta, out_THD)
        return out_THD.view(T, H * Dh)

    def _decode(self, q_DHD, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.decode_rows is not None:
            return self._kernel.paged_decode_attention_rows(q_DHD, k_cache, v_cache, meta.decode_block_tables,
                                                            meta.decode_rows, meta.decode_positions, meta.scale)
        return self._kernel.paged_decode_attention(q_DHD, k_cache, v_cache, meta.decode_block_tables,
                                                   meta.decode_seq_lens, meta.scale)


def _gather(cache: torch.Tensor, tables_DB: torch.Tensor) -> torch.Tensor:
    """[D, blocks * block_size, kv_heads, head_dim] from a block table. index_select on the flattened table is
    about 3x faster on CPU than advanced indexing (a contiguous row copy instead of the generic index kernel)."""
    D, B = tables_DB.shape
    return cache.index_select(0, tables_DB.reshape(-1)).view(D, B * cache.shape[1], *cache.shape[2:])


class FlashPagedAttention:
    """flash-attn 2 paged KV: block tables are read by the kernel; the pool's block size must suit the build."""

    name = "flash"

    def __init__(self) -> None:
        from flash_attn import flash_attn_with_kvcache

        self._fn = flash_attn_with_kvcache

    def forward(self, q_THD, k_THD, v_THD, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k_THD, v_THD, k_cache, v_cache, meta)
        T, H, Dh = q_THD.shape
        out_THD = torch.empty_like(q_THD)
        D = meta.num_decodes
        if D:
            out_THD[:D] = self._fn(q_THD[:D].unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.decode_seq_lens,
                                   block_table=meta.decode_block_tables, softmax_scale=meta.scale,
                                   causal=True)[:, 0]
        for span in meta.prefills:
            seqlen = torch.tensor([span.start_pos + span.end - span.start], dtype=torch.int32, device=q_THD.device)
            # causal=True aligns the chunk's queries to the end of the context: query i sees start_pos + i.
            out_THD[span.start:span.end] = self._fn(q_THD[span.start:span.end].unsqueeze(0), k_cache, v_cache,
                                                    cache_seqlens=seqlen, block_table=span.block_table[None],
                                                    softmax_scale=meta.scale, causal=True)[0]
        return out_THD.view(T, H * Dh)
