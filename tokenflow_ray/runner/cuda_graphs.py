"""CUDA graphs of the decode-only forward, one per batch size on a ladder (vLLM, nano-vllm): a decode step of a
small batch is a few hundred kernel launches whose launch cost exceeds their work; a graph replays them at once.

A graph reads static inputs (input ids, positions, slots, block tables or table rows, sequence lengths) sized for
its batch; a step of D decodes runs the smallest captured size B >= D, its first D rows the step's, the rest
padding: token 0 at position 0, writing its KV into a scratch block no stream owns, attending to that block only.
Graphs need a backend whose kernels read lengths and tables from tensors (flash-attn's paged kernel, the Triton
kernels); prefill and mixed steps run eagerly. Where the static inputs live is the caller's:
- Triton: views of the step staging buffer at a decode-only step's offsets (`varlen_inputs.decode_views`): the
  step's one host->device copy lands in them, nothing is copied at replay;
- flash-attn: `CopyInInputs`, buffers the step's tensors are copied into (and padded) before replay.
`capture` is `torch.cuda.graph`-like and `make_graph` `torch.cuda.CUDAGraph`-like; tests pass eager stand-ins to
check the padding and slicing on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tokenflow_ray.layers.attention import AttentionMetadata

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

StaticInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]


def ladder(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: the default ladder below max_num_seqs, and max_num_seqs itself."""
    return [b for b in DEFAULT_SIZES if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 sizes: Sequence[int], static_inputs: Callable[[int], StaticInputs],
                 capture: Callable | None = None) -> None:
        """forward(input_ids, positions, meta) -> hidden [T, H]; static_inputs(b): the tensors the graph of
        batch b reads (filled with valid padding rows); capture(fn, pool) -> (graph, output, pool): `cuda_capture`
        by default."""
        if not sizes or min(sizes) <= 0:
            raise ValueError("cuda graph sizes: need positive batch sizes")
        self.sizes = sorted(set(sizes))
        self._graphs: dict[int, tuple[object, torch.Tensor]] = {}
        capture = capture or cuda_capture
        pool = None
        for b in reversed(self.sizes):  # largest first: the smaller graphs share its memory pool
            ids, pos, meta = static_inputs(b)

            def fn(ids=ids, pos=pos, meta=meta) -> torch.Tensor:
                return forward(ids, pos, meta)

            fn()  # warm-up outside the graph (lazy initialisation, kernel compilation)
            graph, out, pool = capture(fn, pool)
            self._graphs[b] = (graph, out)

    def padded_size(self, num_decodes: int) -> int | None:
        """The graph a step of this many decodes runs in; None: larger than any, run eagerly."""
        return next((b for b in self.sizes if b >= num_decodes), None)

    def replay(self, b: int) -> torch.Tensor:
        """Run the graph of batch b on what its static inputs hold now: its hidden states, [b, H]."""
        graph, out = self._graphs[b]
        graph.replay()
        return out


class CopyInInputs:
    """flash-attn's static inputs: buffers for the largest batch; a step's tensors are copied in and padded."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, block_size: int, scratch_block: int,
                 device: torch.device, scale: float, table_dtype: torch.dtype = torch.int32) -> None:
        n = max_size
        self.block_size, self.scratch_block, self.scale = block_size, scratch_block, scale
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), scratch_block * block_size, dtype=torch.long, device=device)
        self.tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=table_dtype, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)

    def views(self, b: int) -> StaticInputs:
        meta = AttentionMetadata(slot_mapping=self.slots[:b], num_decodes=b, decode_block_tables=self.tables[:b],
                                 decode_seq_lens=self.seq_lens[:b], decode_mask=None, prefills=[], scale=self.scale)
        return self.input_ids[:b], self.positions[:b], meta

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, b: int) -> bool:
        """Copy a decode-only step into the first rows and pad up to b; False if its tables are too wide."""
        d = meta.num_decodes
        tables = meta.decode_block_tables
        w = tables.shape[1]
        if w > self.tables.shape[1]:
            return False
        self.input_ids[:d].copy_(input_ids)
        self.positions[:d].copy_(positions)
        self.slots[:d].copy_(meta.slot_mapping)
        self.seq_lens[:d].copy_(meta.decode_seq_lens)
        self.tables[:d, :w].copy_(tables)
        # Rows past this step's (padding now, or real rows of a larger earlier step): token 0 at position 0 into
        # the scratch block, so no stream's KV is touched and every row attends to a valid context.
        self.input_ids[d:b].zero_()
        self.positions[d:b].zero_()
        self.slots[d:b].fill_(self.scratch_block * self.block_size)
        self.seq_lens[d:b].fill_(1)
        self.tables[d:b, 0].fill_(self.scratch_block)
        return True


def run_copied_in(graphs: DecodeGraphs, inputs: CopyInInputs, input_ids: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor | None:
    """Hidden states of a decode-only step through its graph (flash-attn form), or None if it fits none."""
    d = meta.num_decodes
    b = graphs.padded_size(d)
    if b is None or meta.prefills or d != input_ids.shape[0] or not inputs.load(input_ids, positions, meta, b):
        return None
    return graphs.replay(b)[:d]


def cuda_capture(fn: Callable[[], torch.Tensor], pool=None):
    graph = torch.cuda.CUDAGraph()
    # thread_local: a capture (at start, or again on the runner thread when the tables grow) is not broken by CUDA
    # calls other threads make meanwhile (the KV copy streams are enqueued from the runner thread only).
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out, graph.pool()


class EagerGraph:
    """A stand-in for a captured graph on CPU: replay re-runs the function into the same output (tests)."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.out = fn()
        self.replays = 0

    def replay(self) -> None:
        self.out.copy_(self.fn())
        self.replays += 1


def eager_capture(fn: Callable[[], torch.Tensor], pool=None):
    graph = EagerGraph(fn)
    return graph, graph.out, pool
