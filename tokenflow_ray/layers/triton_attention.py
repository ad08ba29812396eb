"""Paged attention in Triton (`attention_backend: triton`): the CUDA path when flash-attn is not importable.

One step is at most three launches a layer, whatever its mix: the KV write (slot mapping -> pool), then attention
over every sequence of the step, reading the block tables and lengths from tensors (kernels in
`triton_kernels.py`):
- a decode-only step: the DECODE kernel, one program per (sequence, KV head, split); when batch x KV heads is too
  small to fill the GPU the KV range is split (`decode_splits`) and a reduce combines the splits;
- a step with prefill chunks: one varlen launch for all of them (decodes too when the tiles are small), causal
  within each chunk, the prefix read through the table (vLLM's unified attention does the same); with large
  tiles the decodes take their own DECODE launch, so they do not pay for 64-row tiles.
Nothing here reads a tensor on the host, so a decode step can be captured in a CUDA graph (`cuda_graphs.py`); the
split count follows the batch size only, fixed for each captured size.

Metadata: the persistent block tables (`block_tables`, one row per stream), each sequence's row (`seq_rows`),
its length after this step (`seq_lens`) and where its tokens start (`query_start`), all on the device
(`step_state.py` builds them). `ensure_varlen` derives them from the older per-step form (gathered decode tables
and prefill spans) for tests and device checks.

On CPU it runs only under the Triton interpreter (TRITON_INTERPRET=1, fp32/fp16), as the tests do.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from tokenflow_ray.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
TILE = 64  # keys per inner-loop step (a multiple of 16 for tl.dot; independent of the block size)
LARGE_BLOCK_M = 64  # rows per program for long prefill chunks (query tokens x group heads)
SMALL_BLOCK_M = 16  # the smallest tl.dot tile: decodes and short chunks
PROGRAMS_PER_SM = 4  # split decode KV until about this many programs per SM are in flight
NUM_WARPS = 4
NUM_STAGES = 2


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def load_kernels(device: torch.device):
    """The kernels for this device: compiled for CUDA tensors, interpreted for CPU ones (opt-in)."""
    if device.type == "cpu" and not interpreter_requested():
        raise ValueError("attention_backend: triton runs on CPU only under the Triton interpreter "
                         "(set TRITON_INTERPRET=1); use sdpa or cpu_paged on CPU")
    if not triton_available():
        raise ValueError("attention_backend: triton is not installed (it ships with CUDA builds of torch)")
    from tokenflow_ray.layers.triton_kernels import build

    return build(interpret=device.type == "cpu")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonPagedAttention:
    name = "triton"

    def __init__(self, device: torch.device, decode_splits: int | None = None) -> None:
        """decode_splits: None picks the split count from the batch and the GPU's SM count; a number forces
        it (tests, tuning)."""
        self._k = load_kernels(device)
        self.device = device
        self._num_sms: int | None = None
        if decode_splits is not None and (decode_splits < 1 or decode_splits > MAX_SPLITS
                                          or decode_splits & (decode_splits - 1)):
            raise ValueError(f"decode_splits: a power of two in [1, {MAX_SPLITS}], got {decode_splits}")
        self.decode_splits = decode_splits

    @property
    def num_sms(self) -> int:
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
                if self.device.type == "cuda" else 1
        return self._num_sms

    @num_sms.setter
    def num_sms(self, value: int) -> None:
        self._num_sms = value

    def splits_for(self, num_seqs: int, kv_heads: int) -> int:
        """Split-KV factor of a decode-only launch: a function of the batch only (a captured graph keeps it)."""
        if self.decode_splits is not None:
            return self.decode_splits
        programs = num_seqs * kv_heads
        target = PROGRAMS_PER_SM * self.num_sms
        if programs >= target:
            return 1
        return min(MAX_SPLITS, _pow2(-(-target // programs)))

    def forward(self, q_THD, k_THD, v_THD, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        ensure_varlen(meta)
        if not meta.kv_written:
            self.write_kv(k_THD, v_THD, k_cache, v_cache, meta.slot_mapping)
        T, H, Dh = q_THD.shape
        out = torch.empty((T, H, Dh), dtype=q_THD.dtype, device=q_THD.device)
        if T:
            self.attend(q_THD, k_cache, v_cache, meta, out)
        return out.view(T, H * Dh)

    # ---- launches -----------------------------------------------------------------------------------------------
    def write_kv(self, k_THD, v_THD, k_cache, v_cache, slot_mapping) -> None:
        T, kvh, Dh = k_THD.shape
        if not T:
            return
        _check_inner(k_THD, v_THD, k_cache, v_cache)
        self._k.write_kv[(T,)](
            k_THD, v_THD, k_cache, v_cache, slot_mapping, k_THD.stride(0), k_THD.stride(1), v_THD.stride(0),
            v_THD.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2), KV_HEADS=kvh, HEAD_DIM=Dh, BLOCK_SIZE=k_cache.shape[1],
            HEADS_PAD=_pow2(kvh), DIM_PAD=_pow2(Dh), num_warps=NUM_WARPS)

    def attend(self, q_THD, k_cache, v_cache, meta: AttentionMetadata, out) -> None:
        T, H, _ = q_THD.shape
        kvh = k_cache.shape[2]
        group = H // kvh
        S, D = meta.num_seqs, meta.num_decodes
        if meta.max_query_len <= 1:  # decode-only: every sequence one token, token i of sequence i
            self._launch(q_THD, k_cache, v_cache, meta, out, 0, S, None, self.splits_for(S, kvh))
            return
        block_m = LARGE_BLOCK_M if meta.max_query_len * group >= LARGE_BLOCK_M else SMALL_BLOCK_M
        block_m = max(block_m, _pow2(group))
        if D and block_m > max(SMALL_BLOCK_M, _pow2(group)):
            self._launch(q_THD, k_cache, v_cache, meta, out, 0, D, None, 1)
            self._launch(q_THD, k_cache, v_cache, meta, out, D, S, block_m, 1)
        else:
            self._launch(q_THD, k_cache, v_cache, meta, out, 0, S, block_m, 1)

    def _launch(self, q, k_cache, v_cache, meta: AttentionMetadata, out, first: int, end: int,
                block_m: int | None, splits: int) -> None:
        """Sequences [first, end) of the step; block_m None: DECODE mode (their tokens are first..end-1)."""
        num_seqs = end - first
        if num_seqs <= 0:
            return
        T, H, Dh = q.shape
        kvh = k_cache.shape[2]
        group = H // kvh
        _check_inner(q, out, k_cache, v_cache)
        dim_pad = max(16, _pow2(Dh))
        decode = block_m is None
        if decode:
            block_m, block_q, grid0, qs = max(SMALL_BLOCK_M, _pow2(group)), 1, num_seqs, meta.seq_rows
        else:
            block_q = block_m // group
            qs = meta.query_start[first:]
            # Query tokens of these sequences: T - first (the decodes before them have one each).
            grid0 = (T - first) // block_q + num_seqs
        if splits > 1:
            part_out = torch.empty((T, H, splits, dim_pad), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
        else:
            part_out = part_lse = out  # never touched (NUM_SPLITS == 1)
        tables = meta.block_tables
        self._k.attention[(grid0, kvh, splits)](
            out, q, k_cache, v_cache, tables, meta.seq_rows[first:], meta.seq_lens[first:], qs, part_out,
            part_lse, num_seqs, meta.scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2), NUM_HEADS=H, GROUP=group, HEAD_DIM=Dh, DIM_PAD=dim_pad,
            BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q, TILE=TILE, NUM_SPLITS=splits,
            DECODE=decode, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS,
            num_stages=NUM_STAGES)
        if splits > 1:
            self._k.reduce_splits[(num_seqs, H)](
                out, part_out, part_lse, out.stride(0), out.stride(1), NUM_HEADS=H, HEAD_DIM=Dh,
                DIM_PAD=dim_pad, NUM_SPLITS=splits, num_warps=NUM_WARPS)


def _check_inner(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("triton attention: head_dim must be the innermost, contiguous dimension")


def ensure_varlen(meta: AttentionMetadata) -> None:
    """Fill the varlen fields from the per-step form (decode tables gathered [D, W], lengths, prefill spans),
    in place, once (the layers share one metadata object). Reads lengths on the host: tests and device checks,
    not the engine's path (the persistent batch builds the varlen form directly)."""
    if meta.block_tables is not None:
        return
    D = meta.num_decodes
    if D and meta.decode_seq_lens is None:
        raise ValueError("triton attention: decodes need decode_seq_lens (the per-row table form is for cpu_paged)")
    tables = [meta.decode_block_tables[i] for i in range(D)] + [span.block_table for span in meta.prefills]
    lens = (meta.decode_seq_lens.tolist() if D else []) + [s.start_pos + s.end - s.start for s in meta.prefills]
    q_lens = [1] * D + [s.end - s.start for s in meta.prefills]
    S = len(tables)
    dev = meta.slot_mapping.device
    width = max((t.shape[0] for t in tables), default=1)
    block_tables = torch.zeros((max(S, 1), max(width, 1)), dtype=torch.long, device=dev)
    for i, t in enumerate(tables):
        block_tables[i, :t.shape[0]] = t.long()
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta.block_tables = block_tables
    meta.seq_rows = torch.arange(S, device=dev)
    meta.seq_lens = torch.tensor(lens, dtype=torch.long, device=dev)
    meta.query_start = torch.tensor(starts, dtype=torch.long, device=dev)
    meta.max_query_len = max(q_lens, default=0)
    meta.num_seqs = S
