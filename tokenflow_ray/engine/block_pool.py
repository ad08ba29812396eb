"""Paged KV block accounting: which device (or host) blocks are free and how many owners each has.

Plain Python on purpose: the scheduler, the simulator and the CPU tests run this exact code. Reference counts are
kept so that blocks can be shared later (prefix caching, fork) without changing the interface.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    pass


class BlockIntegrityError(AssertionError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("BlockPool: num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self._refs[b] <= 0:
                raise BlockIntegrityError(f"incref of free block {b}")
            self._refs[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self._refs[b] <= 0:
                raise BlockIntegrityError(f"double free of block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def check_integrity(self, owners: Iterable[Sequence[int]]) -> None:
        """Every block is either free (0 refs, in the free list once) or referenced exactly by its owners."""
        counts: Counter[int] = Counter()
        for blocks in owners:
            counts.update(blocks)
        free_counts = Counter(self._free)
        if any(c > 1 for c in free_counts.values()):
            raise BlockIntegrityError("a block is in the free list twice")
        for b in range(self.num_blocks):
            if self._refs[b] != counts.get(b, 0):
                raise BlockIntegrityError(f"block {b}: refcount {self._refs[b]} but {counts.get(b, 0)} owners")
            if (self._refs[b] == 0) != (b in free_counts):
                raise BlockIntegrityError(f"block {b}: refcount {self._refs[b]} disagrees with the free list")
