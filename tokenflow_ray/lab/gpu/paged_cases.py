"""Random paged attention batches and their float64 reference: decode, prefill, chunked prefill and mixed steps.

A case is the step's queries and new K/V (decodes first, then each prefill chunk, the runner's token layout), a
pool of random blocks, and block tables drawn without replacement from a shuffled pool (holes, no order), lengths
ragged (a last block partly filled). Everything is drawn in float32 on the CPU and cast to the dtype under test;
the reference works in float64 on the cast values, so it measures a backend's arithmetic, not the rounding of
its inputs. `metadata` builds what a backend reads, by name: SDPA a mask and int64 tables; the paged kernels
(flash, triton and the ones to come) int32 tables and int32 lengths, as the decode CUDA graphs feed them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tokenflow_ray.layers.attention import AttentionMetadata, PrefillSpan


@dataclass(frozen=True)
class Dims:
    block_size: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class CaseSpec:
    name: str
    decode_lens: tuple[int, ...]  # each decode's context, its new token included
    chunks: tuple[tuple[int, int], ...]  # (start_pos, tokens) per prefill chunk; start_pos > 0: chunked prefill


@dataclass
class Case:
    spec: CaseSpec
    dims: Dims
    q: torch.Tensor  # [T, H, D] float32 (cast to the dtype under test)
    k: torch.Tensor  # [T, KVH, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    tables: list[list[int]]  # per sequence (decodes, then chunks)
    positions: list[list[int]]  # per sequence, the positions of its tokens in this step

    @property
    def slots(self) -> list[int]:
        bs = self.dims.block_size
        return [t[p // bs] * bs + p % bs for t, ps in zip(self.tables, self.positions) for p in ps]


def make_case(spec: CaseSpec, dims: Dims, seed: int) -> Case:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bs = dims.block_size
    contexts = list(spec.decode_lens) + [s + n for s, n in spec.chunks]
    need = [-(-c // bs) for c in contexts]
    blocks = list(range(sum(need) + 8))  # spare blocks: not every block belongs to someone
    rng.shuffle(blocks)
    tables, at = [], 0
    for n in need:
        tables.append(blocks[at:at + n])
        at += n
    positions = [[n - 1] for n in spec.decode_lens] + [list(range(s, s + n)) for s, n in spec.chunks]
    T = sum(len(p) for p in positions)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    return Case(spec, dims, randn(T, dims.heads, dims.head_dim), randn(T, dims.kv_heads, dims.head_dim),
                randn(T, dims.kv_heads, dims.head_dim), randn(len(blocks), bs, dims.kv_heads, dims.head_dim),
                randn(len(blocks), bs, dims.kv_heads, dims.head_dim), tables, positions)


def cast(case: Case, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fresh copies (always: a backend writes into the pools, and the case must stay as drawn for the next one)."""
    return {name: getattr(case, name).to(device=device, dtype=dtype, copy=True)
            for name in ("q", "k", "v", "k_cache", "v_cache")}


def reference(case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, H, D], K pool, V pool after the step's write), float64 from the dtype-rounded inputs."""
    x = {k: t.to("cpu").double() for k, t in cast(case, torch.device("cpu"), dtype).items()}
    kc, vc = x["k_cache"].clone(), x["v_cache"].clone()
    slots = torch.tensor(case.slots)
    kc.view(-1, *kc.shape[2:])[slots] = x["k"]
    vc.view(-1, *vc.shape[2:])[slots] = x["v"]
    kvh, group = case.dims.kv_heads, case.dims.heads // case.dims.kv_heads
    scale = case.dims.head_dim ** -0.5
    out = torch.empty_like(x["q"])
    row = 0
    for table, pos in zip(case.tables, case.positions):
        ctx, C = pos[-1] + 1, len(pos)
        keys = kc[table].flatten(0, 1)[:ctx]  # [ctx, KVH, D]
        vals = vc[table].flatten(0, 1)[:ctx]
        q = x["q"][row:row + C].view(C, kvh, group, -1)  # query head h reads KV head h // group
        scores = torch.einsum("ckgd,lkd->kgcl", q, keys) * scale
        causal = torch.arange(ctx)[None, :] <= torch.tensor(pos)[:, None]  # [C, ctx]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[row:row + C] = torch.einsum("kgcl,lkd->ckgd", scores.softmax(-1), vals).reshape(C, kvh * group, -1)
        row += C
    return out, kc, vc


def metadata(case: Case, backend: str, device: torch.device) -> AttentionMetadata:
    bs = case.dims.block_size
    table_dtype = torch.long if backend in ("sdpa", "cpu_paged") else torch.int32
    D = len(case.spec.decode_lens)
    tables = lens = mask = None
    if D:
        width = max(len(t) for t in case.tables[:D])
        padded = [t + [t[0]] * (width - len(t)) for t in case.tables[:D]]  # padding is masked by the lengths
        tables = torch.tensor(padded, dtype=table_dtype, device=device)
        lens = torch.tensor(case.spec.decode_lens, dtype=torch.int32, device=device)
        if backend == "sdpa":
            mask = (torch.arange(width * bs, device=device)[None, :] < lens[:, None]).view(D, 1, 1, width * bs)
    spans, start = [], D
    for (start_pos, n), table in zip(case.spec.chunks, case.tables[D:]):
        spans.append(PrefillSpan(start, start + n, start_pos, torch.tensor(table, dtype=table_dtype, device=device)))
        start += n
    return AttentionMetadata(slot_mapping=torch.tensor(case.slots, dtype=torch.long, device=device), num_decodes=D,
                             decode_block_tables=tables, decode_seq_lens=lens, decode_mask=mask, prefills=spans,
                             scale=case.dims.head_dim ** -0.5)


def case_specs(mode: str) -> tuple[Dims, tuple[CaseSpec, ...]]:
    """Llama-3-8B's attention shape on the GPU (block 16, 32 heads, 8 KV heads, head_dim 128); tiny in a dry run."""
    rng = random.Random(0)
    if mode == "dry":
        dims = Dims(16, 4, 2, 64)
        return dims, (CaseSpec("decode", (1, 16, 17, 40), ()), CaseSpec("prefill", (), ((0, 19), (0, 5))),
                      CaseSpec("chunked_prefill", (), ((21, 12), (32, 16))),
                      CaseSpec("mixed", (3, 33), ((9, 7),)))
    # Edges (one token, a full block, one past it, the longest) and ragged lengths up to 2k.
    lens = (1, 16, 17, 2048) + tuple(rng.randint(2, 2047) for _ in range(28 if mode == "full" else 12))
    return Dims(16, 32, 8, 128), (
        CaseSpec("decode", lens, ()),
        CaseSpec("prefill", (), ((0, 300), (0, 77))),
        CaseSpec("chunked_prefill", (), ((1000, 512), (37, 16))),
        CaseSpec("mixed", lens[:16], ((200, 100),)),
    )
