"""Persistent step state of the torch runner: every scheduled stream's block table in one preallocated tensor,
updated by the plans' diffs, and a step's attention metadata built from it with a handful of tensor ops.

As in vLLM's persistent batch, nothing is rebuilt from Python lists of whole tables: a stream joining gets a row,
a new block is one element written, a stream leaving frees its row. Per step the decode metadata is
`tables[rows, :width]` and one tensor of rows, positions, KV slots and tokens; the only per-stream Python is reading
each chunk's row, position, slot (from a host mirror of the tables, kept by the same diffs) and token into lists.
"""

from __future__ import annotations

import itertools
from array import array

import torch

from tokenflow_ray.engine.plan import PENDING_TOKEN, StepPlan
from tokenflow_ray.layers.attention import AttentionMetadata, PrefillSpan
from tokenflow_ray.runner.step_inputs import StepInputs, host_tensor
from tokenflow_ray.runner.step_staging import StagingBuffer

_ARRAY_CODES = {torch.long: "q", torch.int32: "i"}  # the table dtypes' array typecodes (8 and 4 bytes)


class PersistentBatch:
    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 table_dtype: torch.dtype = torch.long, sdpa_mask: bool = False, tables_by_row: bool = False,
                 varlen: bool = False, staging: StagingBuffer | None = None,
                 scratch_block: int | None = None) -> None:
        """varlen: build the Triton backend's form (`varlen_inputs.py`). staging: every step's inputs and table
        diffs go up in one copy through it, and sampled tokens stay on the device (CUDA). scratch_block: a pool
        block no stream owns; row 0 of the tables is then reserved for padding rows (graphs, warm-up), every
        entry that block."""
        self.block_size = block_size
        self.device = device
        self.table_dtype = table_dtype
        self.sdpa_mask = sdpa_mask  # the SDPA backend wants a [D, 1, 1, L] mask; the paged kernels read seq_lens
        # The CPU paged kernel reads these tables by row and each length from its position: a decode step then
        # builds one tensor, not a gathered table and a lengths tensor (each op costs tens of µs after the model).
        self.tables_by_row = tables_by_row
        if sdpa_mask + tables_by_row + varlen > 1:
            raise ValueError("PersistentBatch: sdpa_mask, tables_by_row and varlen are for different backends")
        if staging is not None and not varlen:
            raise ValueError("PersistentBatch: staged inputs are built in the varlen form")
        self.varlen, self.staging, self.scratch_block = varlen, staging, scratch_block
        self.tables = torch.zeros((max_rows, max_blocks_per_seq), dtype=table_dtype, device=device)
        self.tables_version = 0  # bumped when the tables tensor is replaced (grown): captured graphs read it
        # The same tables on the host, kept by the same diffs: a decode's KV slot is then one Python lookup, and a
        # decode step's inputs one tensor built from lists, not a chain of small device ops (vLLM keeps a numpy
        # mirror of its block table for the same reason). A row's length is the blocks it holds (widths, checks).
        self.host_tables: list[list[int]] = [[] for _ in range(max_rows)]
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.last_sampled: dict[str, int] = {}  # each stream's latest sampled token (for PENDING_TOKEN inputs)
        if scratch_block is not None:
            self.tables[0].fill_(scratch_block)
            self._free_rows.pop()  # row 0
        # Staged: the step's new table entries go up with its inputs (rows, columns, block ids), and each
        # stream's latest sampled token stays on the device, at the table row it had when sampled.
        self.pending_diff: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.last_tokens = torch.zeros(max_rows, dtype=torch.long, device=device) if staging is not None else None
        self.sampled_row: dict[str, int] = {}

    # ---- diffs --------------------------------------------------------------------------------------------------
    def apply(self, plan: StepPlan) -> None:
        """Leavers first (their rows may be reused by this plan's joiners), then each chunk's new blocks."""
        for sid in plan.finished:
            self.last_sampled.pop(sid, None)
            self.sampled_row.pop(sid, None)
            self._drop(sid)
        for sid in plan.preempted:
            self._drop(sid)
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        row_of, host_tables, width = self.row_of, self.host_tables, self.tables.shape[1]
        # Every scheduled stream, every step: chunks unpack as tuples, and a decode without a new block (most of
        # them) costs one lookup and one length check.
        for sid, _, _, new_blocks, first, _ in itertools.chain(plan.decodes, plan.prefills):
            if first == 0:
                self._drop(sid)
                row = row_of[sid] = self._take_row()
            else:
                row = row_of.get(sid)
                if row is None or len(host_tables[row]) != first:
                    raise RuntimeError(f"{sid}: block-table diff starts at {first}, the runner holds "
                                       f"{None if row is None else len(host_tables[row])} blocks")
            if new_blocks:
                n = len(new_blocks)
                if first + n > width:
                    raise RuntimeError(f"{sid}: block table outgrows {width} blocks")
                rows.extend([row] * n)
                cols.extend(range(first, first + n))
                vals.extend(new_blocks)
                host_tables[row].extend(new_blocks)  # holds `first` blocks: checked above
        if rows and self.staging is not None:  # goes up with the step's inputs (varlen_inputs.py)
            diff = self.pending_diff
            diff[0].extend(rows)
            diff[1].extend(cols)
            diff[2].extend(vals)
        elif rows:  # one scatter for the whole step's new blocks
            idx = array("q", rows)
            idx.extend(cols)
            idx_t = host_tensor(idx, torch.long, self.device).view(2, -1)
            self.tables[idx_t[0], idx_t[1]] = host_tensor(array(_ARRAY_CODES[self.table_dtype], vals), self.table_dtype,
                                                      self.device)

    def _drop(self, sid: str) -> None:
        row = self.row_of.pop(sid, None)
        if row is not None:
            self.host_tables[row] = []
            self._free_rows.append(row)

    def _take_row(self) -> int:
        if not self._free_rows:  # more live streams than planned for: grow (rare; keeps any batch correct)
            old = self.tables.shape[0]
            self.tables = torch.cat([self.tables, torch.zeros_like(self.tables)])
            if self.last_tokens is not None:
                self.last_tokens = torch.cat([self.last_tokens, torch.zeros_like(self.last_tokens)])
            self.tables_version += 1
            self.host_tables.extend([] for _ in range(old))
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def table(self, sid: str) -> list[int]:
        if self.pending_diff[0]:  # staged diffs not yet sent with a step (tests read tables between steps)
            self.apply_pending_diff(host_tensor(array("q", [v for part in self.pending_diff for v in part]),
                                            torch.long, self.device), len(self.pending_diff[0]))
        row = self.row_of[sid]
        return self.tables[row, :len(self.host_tables[row])].tolist()

    def apply_pending_diff(self, packed: torch.Tensor, n: int) -> None:
        """The staged diffs, now on the device as [rows n | columns n | block ids n], into the tables."""
        self.tables[packed[:n], packed[n:2 * n]] = packed[2 * n:3 * n].to(self.table_dtype)
        for part in self.pending_diff:
            part.clear()

    def record_sampled(self, tokens: torch.Tensor, step: StepInputs) -> None:
        """Staged: the step's sampled tokens into their streams' device slots (read by the next step's PENDING
        inputs), on the device; the rows they were sampled at, on the host."""
        if self.last_tokens is None or step.sample_table_rows is None:
            return
        self.last_tokens[step.sample_table_rows] = tokens
        row_of, sampled_row = self.row_of, self.sampled_row
        for sid in step.sample_ids:
            sampled_row[sid] = row_of[sid]

    # ---- one step's inputs -------------------------------------------------------------------------------------
    def inputs(self, plan: StepPlan, scale: float, pad_to: int | None = None) -> StepInputs:
        """pad_to: a decode-only step's graph bucket (varlen form only): rows past the step's are padding."""
        if self.varlen:
            from tokenflow_ray.runner.varlen_inputs import varlen_inputs

            return varlen_inputs(self, plan, scale, pad_to)
        dev, bs = self.device, self.block_size
        decodes = plan.decodes
        D = len(decodes)
        tokens: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        last = self.last_sampled
        tables = lens = mask = rows_t = pos_t = None
        slots = []
        pos_parts = []
        packed = None
        if D:
            # Rows, positions, KV slots and input tokens: the chunks transposed once (zip), each field a map or a
            # comprehension, and one [4, D] tensor over their values.
            row_of, host_tables = self.row_of, self.host_tables
            sids, toks, pos, _, _, samples = zip(*decodes)
            rows = list(map(row_of.__getitem__, sids))
            dslots = [host_tables[r][p // bs] * bs + p % bs for r, p in zip(rows, pos)]
            tokens = [t[0] for t in toks]
            if PENDING_TOKEN in tokens:  # overlapped scheduling: the runner's own sampled tokens go in
                tokens = [last[sid] if t == PENDING_TOKEN else t for sid, t in zip(sids, tokens)]
            # A decode samples unless the step's token budget cut a longer chunk to one token.
            if all(samples):
                sample_ids, sample_rows = list(sids), list(range(D))
            else:
                sample_ids = [sid for sid, smp in zip(sids, samples) if smp]
                sample_rows = [i for i, smp in enumerate(samples) if smp]
            flat = array("q", rows)
            flat.extend(pos)
            flat.extend(dslots)
            flat.extend(tokens)
            packed = host_tensor(flat, torch.long, dev).view(4, D).unbind(0)  # rows, positions, slots, tokens
            pos_t = packed[1]
            slots.append(packed[2])
            pos_parts.append(pos_t)
            if self.tables_by_row:
                tables, rows_t = self.tables, packed[0]
            else:
                width = max(pos) // bs + 1
                tables = self.tables[:, :width].index_select(0, packed[0])  # [D, width], contiguous
                lens = (pos_t + 1).to(torch.int32)
            if self.sdpa_mask:
                mask = (torch.arange(width * bs, device=dev)[None, :] < lens[:, None]).view(D, 1, 1, width * bs)
        spans = []
        offset = D
        for c in plan.prefills:
            n = len(c.token_ids)
            row = self.row_of[c.stream_id]
            table = self.tables[row, :len(self.host_tables[row])]
            p = torch.arange(c.start_pos, c.start_pos + n, device=dev)
            slots.append(table[p // bs].long() * bs + p % bs)
            pos_parts.append(p)
            spans.append(PrefillSpan(offset, offset + n, c.start_pos, table))
            tokens.extend(last[c.stream_id] if t == PENDING_TOKEN else t for t in c.token_ids)
            if c.sample:
                sample_rows.append(offset + n - 1)
                sample_ids.append(c.stream_id)
            offset += n
        positions = pos_parts[0] if len(pos_parts) == 1 else torch.cat(pos_parts)
        slot_mapping = slots[0] if len(slots) == 1 else torch.cat(slots)
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decodes=D, decode_block_tables=tables,
                                 decode_seq_lens=lens, decode_mask=mask, prefills=spans, scale=scale,
                                 decode_rows=rows_t, decode_positions=pos_t if self.tables_by_row else None)
        input_ids = packed[3] if packed is not None and not plan.prefills else \
            torch.tensor(tokens, dtype=torch.long, device=dev)
        return StepInputs(input_ids, positions, meta, sample_rows, sample_ids)
