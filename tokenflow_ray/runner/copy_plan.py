"""Which bytes a step's block copies move: shared by the CPU copy path (kv_transfer.py) and the CUDA one
(cuda_copies.py), so neither imports the other.

A KV block is `pieces` contiguous segments of `piece_bytes` in a pool: one segment in the block-major layout (a block
of every layer is one region), `2 x layers` in the layer-major one (a layer's K or V of the block). `descriptors`
turns block ids into (destination, source, size) triples, one per segment, merging runs of consecutive blocks on
both sides into one triple (a plan's blocks are often allocated together), so a whole step's copies in one direction
are one batched call with as few, as large, triples as the ids allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenflow_ray.engine.plan import BlockCopy


@dataclass(frozen=True)
class CopyTiming:
    copy_s: float  # the job's own duration
    swap_out_done: dict[str, float]  # preempted stream -> perf_counter time when its tail was on the host
    num_blocks: int


def by_stream_shortest_first(copies: tuple[BlockCopy, ...]) -> list[tuple[str, list[BlockCopy]]]:
    """One stream's tail after another, shortest first (the mean wait for freed blocks is then least)."""
    by_stream: dict[str, list[BlockCopy]] = {}
    for c in copies:
        by_stream.setdefault(c.stream_id, []).append(c)
    return sorted(by_stream.items(), key=lambda item: len(item[1]))


@dataclass(frozen=True)
class BlockLayout:
    """Where a block's bytes lie: piece j of block b starts at base + b * block_stride + j * piece_stride."""

    base: int  # address of block 0's first piece
    num_blocks: int
    pieces: int
    piece_bytes: int
    block_stride: int
    piece_stride: int

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.pieces <= 0 or self.piece_bytes <= 0:
            raise ValueError(f"BlockLayout: blocks, pieces and piece bytes must be positive ({self})")

    @property
    def block_bytes(self) -> int:
        return self.pieces * self.piece_bytes

    @property
    def whole_blocks(self) -> bool:
        """A block is one segment and the next block follows it: runs of blocks are one segment."""
        return self.pieces == 1 and self.block_stride == self.piece_bytes

    @classmethod
    def of(cls, tensor, block_major: bool, pieces: int | None = None) -> BlockLayout:
        """The layout of a contiguous pool tensor: `[blocks, layers, 2, ...]` (block-major) or `[layers, 2, blocks,
        ...]` (layer-major). `pieces` splits a block-major block into that many segments (to pair with a layer-major
        pool's segments; default 1)."""
        if not tensor.is_contiguous():
            raise ValueError("BlockLayout: the pool must be contiguous")
        size = tensor.element_size()
        if block_major:
            n = tensor.shape[0]
            block_bytes = tensor[0].numel() * size
            k = pieces or 1
            if block_bytes % k:
                raise ValueError(f"BlockLayout: {block_bytes} bytes a block do not split in {k} pieces")
            return cls(tensor.data_ptr(), n, k, block_bytes // k, block_bytes, block_bytes // k)
        n = tensor.shape[2]
        piece = tensor[0, 0, 0].numel() * size
        return cls(tensor.data_ptr(), n, tensor.shape[0] * tensor.shape[1], piece, piece, n * piece)


@dataclass(frozen=True)
class Descriptors:
    """A batch of copies: dsts[i] <- srcs[i], sizes[i] bytes (uint64 arrays, what cuMemcpyBatchAsync takes)."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())


def block_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src starts, dst starts, lengths) of the runs where both sides' ids go up by one, in the given order."""
    if len(src_ids) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src_ids)])))
    return src_ids[starts], dst_ids[starts], lengths


def descriptors(dst: BlockLayout, dst_ids, src: BlockLayout, src_ids) -> Descriptors:
    """The triples that copy block src_ids[i] of `src` to block dst_ids[i] of `dst`, every segment.

    Raises ValueError for ids out of range, a destination block named twice (copies within one batch run in no
    set order) or layouts whose segments do not pair up."""
    src_ids = np.asarray(src_ids, dtype=np.int64)
    dst_ids = np.asarray(dst_ids, dtype=np.int64)
    if src_ids.shape != dst_ids.shape or src_ids.ndim != 1:
        raise ValueError("descriptors: one source block per destination block")
    if src.pieces != dst.pieces or src.piece_bytes != dst.piece_bytes:
        raise ValueError(f"descriptors: segments differ ({src.pieces} x {src.piece_bytes} B vs "
                         f"{dst.pieces} x {dst.piece_bytes} B)")
    for ids, layout, side in ((src_ids, src, "source"), (dst_ids, dst, "destination")):
        if len(ids) and (ids.min() < 0 or ids.max() >= layout.num_blocks):
            raise ValueError(f"descriptors: a {side} block id is outside [0, {layout.num_blocks})")
    if len(np.unique(dst_ids)) != len(dst_ids):
        raise ValueError("descriptors: a destination block is written twice in one batch")
    if src.whole_blocks and dst.whole_blocks:
        s0, d0, n = block_runs(src_ids, dst_ids)
        srcs = src.base + s0 * src.block_stride
        dsts = dst.base + d0 * dst.block_stride
        sizes = n * src.piece_bytes
    else:
        j = np.arange(src.pieces, dtype=np.int64)[None, :]
        srcs = (src.base + src_ids[:, None] * src.block_stride + j * src.piece_stride).ravel()
        dsts = (dst.base + dst_ids[:, None] * dst.block_stride + j * dst.piece_stride).ravel()
        sizes = np.full(len(srcs), src.piece_bytes, dtype=np.int64)
    return Descriptors(dsts.astype(np.uint64), srcs.astype(np.uint64), sizes.astype(np.uint64))
