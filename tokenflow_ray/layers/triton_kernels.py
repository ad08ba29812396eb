"""The Triton kernels of the paged attention backend (`triton_attention.py` launches them).

Imported only when that backend is built: `triton` is not a core dependency. The functions below are plain; `build`
wraps them once per mode, compiled (CUDA tensors) or interpreted (CPU tensors: the tests), so which one runs follows
the device, not the environment the module happened to be imported under.

- `write_kv_kernel`: a step's new K and V into the pool, one program per token, every KV head at once; slots are
  `block * block_size + offset`, so the pool's per-layer views may be strided over blocks (block-major pool).
- `paged_attention_kernel`: attention of a step's query tokens over their sequences' paged context, read through
  the block tables (`tables[seq_rows[s]]`) up to each sequence's length: the work follows the lengths, and no
  tensor shape depends on them. A program takes one KV head and a tile of rows, each row a (query token, query
  head of that KV head's group) pair, so a KV tile is loaded once for the whole group (GQA). Varlen mode: the
  rows are BLOCK_Q consecutive tokens of one sequence (found by binary search over the query starts), causal
  within the chunk, the prefix read from the pool. DECODE mode: one token per sequence, program = sequence, and
  optionally NUM_SPLITS programs per sequence over disjoint ranges of its KV tiles (split-KV, for batches too
  small to fill the GPU), each writing a partial output and its log-sum-exp that `reduce_splits_kernel` combines.

The kernels call no `@triton.jit` function of triton's standard library (tl.sum, tl.max, tl.cdiv, tl.zeros are
such functions, and a process that imported triton before TRITON_INTERPRET was set cannot call them from an
interpreted kernel): reductions go through tl.reduce with the library's own combine functions, which the
interpreter recognises and runs in numpy and the compiler inlines exactly as tl.sum and tl.max do.

Offsets that scale with a block id or a token index are int64: a block-major pool's block stride times a block id
passes 2^31 elements on a large pool.
"""

import functools
from dataclasses import dataclass

try:  # not a core dependency: CUDA torch ships it, the dev extra pins it for the interpreter tests
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
except ImportError as exc:  # only the triton backend imports this module; say how to get it
    raise ImportError("attention backend 'triton': the triton package is not installed (it comes with CUDA torch; "
                      "on CPU: pip install 'triton==3.6.*' and set TRITON_INTERPRET=1)") from exc

_SUM = tl.standard._sum_combine  # what tl.sum reduces with
_MAX = tl.standard._elementwise_max  # what tl.max reduces with (floats of 32 bits and more)


def write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + within * stride_kct + h * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + within * stride_vct + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_rows_ptr, seq_lens_ptr, query_start_ptr,
        part_out_ptr, part_lse_ptr, num_seqs, scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DECODE: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # one query token per sequence: program = sequence = token
        seq = pid
        q_start = pid.to(tl.int64)
        q_len = 1
        q_block = 0
    else:
        # Sequence s owns q-blocks [q_start_s // BLOCK_Q + s, ... + cdiv(q_len_s, BLOCK_Q)): disjoint for all s,
        # and the grid (T // BLOCK_Q + num_seqs) covers them without reading the lengths on the host.
        # (Starts counted from the first sequence's: a launch may take the sequences after the decodes.)
        q_base = tl.load(query_start_ptr)
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if (tl.load(query_start_ptr + mid) - q_base).to(tl.int32) // BLOCK_Q + mid <= pid:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_start = tl.load(query_start_ptr + seq)
        q_len = (tl.load(query_start_ptr + seq + 1) - q_start).to(tl.int32)
        q_block = pid - ((q_start - q_base).to(tl.int32) // BLOCK_Q + seq)
        if q_block * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    row = tl.load(seq_rows_ptr + seq).to(tl.int64)
    context = seq_len - q_len  # tokens before this step's chunk

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP  # the row's query token within its chunk
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    tok = q_start + q_idx.to(tl.int64)
    offs_d = tl.arange(0, DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context + q_idx  # absolute position: a row sees keys at positions <= q_pos

    # Keys this program can see: up to the last query of its tile (causal), within the sequence.
    kv_end = tl.minimum(seq_len, context + (q_block + 1) * BLOCK_Q)
    num_tiles = (kv_end + TILE - 1) // TILE
    if NUM_SPLITS > 1:
        per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
        t_lo = split * per_split
        t_hi = tl.minimum(t_lo + per_split, num_tiles)
    else:
        t_lo = 0
        t_hi = num_tiles

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_sum = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, DIM_PAD], 0.0, dtype=tl.float32)
    offs_t = tl.arange(0, TILE)
    table_row = tables_ptr + row * stride_table
    for j in range(t_lo, t_hi):
        k_pos = j * TILE + offs_t
        k_ok = k_pos < kv_end
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        within = (k_pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + within[:, None] * stride_kt + kv_head * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + within[:, None] * stride_vt + kv_head * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        # Every row sees key 0 of its first tile (split ranges hold only visible keys), so m is finite after it.
        s = tl.where(k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _MAX))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_sum[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # An empty split (a sequence shorter than NUM_SPLITS tiles) writes weight zero: lse -inf, output 0.
        has = l_sum > 0
        l_safe = tl.where(has, l_sum, 1.0)
        lse = tl.where(has, m + tl.log2(l_safe), float("-inf"))
        part = (tok * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * DIM_PAD + offs_d[None, :], acc / l_safe[:, None], mask=out_mask)
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


def reduce_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    """One (token, query head): the splits' outputs weighted by 2^(lse - max lse). Split 0 is never empty."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (tok * NUM_HEADS + head) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + base + offs_s)
    w = tl.exp2(lse - tl.reduce(lse, 0, _MAX))
    parts = tl.load(part_out_ptr + (base + offs_s)[:, None] * DIM_PAD + offs_d[None, :], mask=d_ok[None, :],
                    other=0.0)
    out = tl.reduce(parts * w[:, None], 0, _SUM) / tl.reduce(w, 0, _SUM)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class Kernels:
    write_kv: object
    attention: object
    reduce_splits: object


# Per-step values (the sequence count, the metadata pointers' offsets into the staging buffer) are not
# specialised on, so a new batch size or segment offset never compiles a new variant mid-run.
_ATTENTION_OPTIONS = dict(do_not_specialize=["num_seqs"],
                          do_not_specialize_on_alignment=["seq_rows_ptr", "seq_lens_ptr", "query_start_ptr"])


@functools.cache
def build(interpret: bool) -> Kernels:
    wrap = InterpretedFunction if interpret else JITFunction
    return Kernels(write_kv=wrap(write_kv_kernel, do_not_specialize_on_alignment=["slot_ptr"]),
                   attention=wrap(paged_attention_kernel, **_ATTENTION_OPTIONS),
                   reduce_splits=wrap(reduce_splits_kernel))
