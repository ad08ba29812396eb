"""A step's inputs in the varlen form the Triton backend reads, built from the persistent batch's host mirror.

Every value of the step is one int64 array on the host, moved with one copy (`StagingBuffer` on CUDA; on CPU a
zero-copy view of the array) and read through views:

    [ids n][positions n][slots n][table rows S][lengths S]  then, with prefill chunks, [query starts S + 1],
    then [sampled rows R] when not every row samples, [sampled streams' table rows R] (staged),
    [diff rows m][diff columns m][diff block ids m] (staged), [pending token index P][their sampled-at rows P].

A decode-only step has n = S: its first five segments, at offsets 0, n, 2n, 3n and 4n, are what a captured graph of
bucket n reads, so its inputs land straight in the graph's static buffers (padding rows past the step's decodes:
token 0 at position 0 in the scratch row, whose block no stream owns). Staged, the step's new table entries go up in
the same copy and are scattered on the device, and a PENDING input token (overlapped scheduling) is read on the
device from the token its stream sampled last step, which never went through the host.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import torch

from tokenflow_ray.engine.plan import PENDING_TOKEN, StepPlan
from tokenflow_ray.layers.attention import AttentionMetadata
from tokenflow_ray.runner.step_inputs import StepInputs, host_tensor

if TYPE_CHECKING:
    from tokenflow_ray.runner.step_state import PersistentBatch


def varlen_inputs(batch: PersistentBatch, plan: StepPlan, scale: float, pad_to: int | None = None) -> StepInputs:
    bs = batch.block_size
    staged = batch.staging is not None
    row_of, host_tables, last = batch.row_of, batch.host_tables, batch.last_sampled
    ids, pos, slots, rows, lens = array("q"), array("q"), array("q"), array("q"), array("q")
    pend_at: list[int] = []
    pend_row: list[int] = []
    sample_rows: list[int] = []
    sample_ids: list[str] = []
    D = len(plan.decodes)
    if D:
        sids, toks, dpos, _, _, samples = zip(*plan.decodes)
        drows = list(map(row_of.__getitem__, sids))
        tokens = [t[0] for t in toks]
        if PENDING_TOKEN in tokens:
            tokens = _pending(tokens, sids, 0, batch, pend_at, pend_row) if staged else \
                [last[sid] if t == PENDING_TOKEN else t for sid, t in zip(sids, tokens)]
        ids.extend(tokens)
        pos.extend(dpos)
        slots.extend([host_tables[r][p // bs] * bs + p % bs for r, p in zip(drows, dpos)])
        rows.extend(drows)
        lens.extend([p + 1 for p in dpos])
        if all(samples):
            sample_ids, sample_rows = list(sids), list(range(D))
        else:
            sample_ids = [sid for sid, smp in zip(sids, samples) if smp]
            sample_rows = [i for i, smp in enumerate(samples) if smp]
    starts = [0] if plan.prefills else None
    for c in plan.prefills:
        n = len(c.token_ids)
        row = row_of[c.stream_id]
        table = host_tables[row]
        offset = len(ids)
        tokens = c.token_ids
        if PENDING_TOKEN in tokens:
            tokens = _pending(list(tokens), [c.stream_id] * n, offset, batch, pend_at, pend_row) if staged else \
                [last[c.stream_id] if t == PENDING_TOKEN else t for t in tokens]
        ids.extend(tokens)
        p, end = c.start_pos, c.start_pos + n
        pos.extend(range(p, end))
        while p < end:  # one run of slots per block: C-speed extends, not a Python loop per token
            within = p % bs
            run = min(bs - within, end - p)
            base = table[p // bs] * bs + within
            slots.extend(range(base, base + run))
            p += run
        rows.append(row)
        lens.append(end)
        if c.sample:
            sample_rows.append(offset + n - 1)
            sample_ids.append(c.stream_id)
    if starts is not None:
        starts.extend([1] * D)
        starts.extend(len(c.token_ids) for c in plan.prefills)
        for i in range(1, len(starts)):
            starts[i] += starts[i - 1]
    T = len(ids)
    n = T
    if starts is None and pad_to is not None and pad_to > T:  # decode-only, run in a graph of pad_to rows
        if batch.scratch_block is None:
            raise RuntimeError("PersistentBatch: padding rows need a scratch block")
        n = pad_to
        extra = n - T
        ids.extend([0] * extra)
        pos.extend([0] * extra)
        slots.extend([batch.scratch_block * bs] * extra)
        rows.extend([0] * extra)
        lens.extend([1] * extra)
    S = len(rows)
    flat = ids
    for part in (pos, slots, rows, lens):
        flat.extend(part)
    if starts is not None:
        flat.extend(starts)
    gather = len(sample_rows) != len(sample_ids) or sample_rows != list(range(len(sample_rows)))
    at_sample = len(flat)
    if gather:
        flat.extend(sample_rows)
    at_rows = len(flat)
    if staged:
        flat.extend([row_of[sid] for sid in sample_ids])
    at_diff = len(flat)
    m = len(batch.pending_diff[0]) if staged else 0
    for part in batch.pending_diff if m else ():
        flat.extend(part)
    at_pend = len(flat)
    flat.extend(pend_at)
    flat.extend(pend_row)
    buf = batch.staging.stage(flat) if staged else host_tensor(flat, torch.long, batch.device)

    if m:
        batch.apply_pending_diff(buf[at_diff:at_pend], m)
    input_ids = buf[:n]
    if pend_at:
        P = len(pend_at)
        input_ids[buf[at_pend:at_pend + P]] = batch.last_tokens[buf[at_pend + P:at_pend + 2 * P]]
    seg = 3 * n
    meta = AttentionMetadata(
        slot_mapping=buf[2 * n:seg], num_decodes=D if starts is not None else S, decode_block_tables=None,
        decode_seq_lens=None, decode_mask=None, prefills=[], scale=scale, block_tables=batch.tables,
        seq_rows=buf[seg:seg + S], seq_lens=buf[seg + S:seg + 2 * S],
        query_start=buf[seg + 2 * S:seg + 3 * S + 1] if starts is not None else None,
        max_query_len=max(1, max((len(c.token_ids) for c in plan.prefills), default=1)), num_seqs=S)
    return StepInputs(input_ids, buf[n:2 * n], meta, sample_rows, sample_ids,
                      sample_index=buf[at_sample:at_rows] if gather else None,
                      sample_table_rows=buf[at_rows:at_diff] if staged else None)


def _pending(tokens: list[int], sids, offset: int, batch: PersistentBatch, pend_at: list[int],
             pend_row: list[int]) -> list[int]:
    """Staged: each PENDING token becomes 0 on the host and is filled on the device from the token its stream
    sampled last step, kept at the table row the stream had then (it may have a new row now: a recompute)."""
    sampled_row = batch.sampled_row
    for i, (sid, t) in enumerate(zip(sids, tokens)):
        if t == PENDING_TOKEN:
            pend_at.append(offset + i)
            pend_row.append(sampled_row[sid])
            tokens[i] = 0
    return tokens


def decode_views(batch: PersistentBatch, n: int, scale: float):
    """The static inputs a decode graph of bucket n reads: views of the staging buffer at a decode-only step's
    offsets, filled with padding rows first so that capture's warm-up runs on valid inputs."""
    if batch.staging is None or batch.scratch_block is None:
        raise RuntimeError("decode graphs need staged inputs and a scratch block")
    pad = array("q", [0] * (2 * n))
    pad.extend([batch.scratch_block * batch.block_size] * n)
    pad.extend([0] * n)
    pad.extend([1] * n)
    buf = batch.staging.stage(pad)
    meta = AttentionMetadata(
        slot_mapping=buf[2 * n:3 * n], num_decodes=n, decode_block_tables=None, decode_seq_lens=None,
        decode_mask=None, prefills=[], scale=scale, block_tables=batch.tables, seq_rows=buf[3 * n:4 * n],
        seq_lens=buf[4 * n:5 * n], query_start=None, max_query_len=1, num_seqs=n)
    return buf[:n], buf[n:2 * n], meta
