"""Paged KV block accounting: which device (or host) blocks are free, how many owners each has, and which hold a
cached prefix (prefix caching).

Plain Python on purpose: the scheduler, the simulator and the CPU tests run this exact code.

Prefix caching (vLLM's automatic prefix caching, SGLang's radix cache): a full block's content is named by a key
chained over its tokens and its parent's key (`block_keys`), so equal keys mean equal prefixes. A block whose last
owner lets go keeps its content and its key, and stays findable (`lookup`) as a *cached free* block: it counts as
free, and is reused only when no plain free block is left, least recently freed first. Taking it back (`take`)
makes it owned again. Blocks with owners are never freed, evicted or handed out, and a stream writes only blocks
past its computed prefix, which are its own.
"""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

from tokenflow_ray.engine.plan import PENDING_TOKEN

ROOT_KEY = 0  # the parent key of a stream's first block


class NoFreeBlocksError(RuntimeError):
    pass


class BlockIntegrityError(AssertionError):
    pass


def block_keys(tokens: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """Keys of the full blocks of `tokens` (which start at a block boundary), chained from `parent`: the key of
    the block before them, or ROOT_KEY. A block holding a token not sampled yet (PENDING_TOKEN) ends the list.

    Python's hash of a tuple of ints is deterministic across processes (no hash seed for ints); a collision of
    two different prefixes would need equal 64-bit chains, and `lookup` also compares a hit's own tokens."""
    keys: list[int] = []
    for b in range(len(tokens) // block_size):
        block = tuple(tokens[b * block_size:(b + 1) * block_size])
        if PENDING_TOKEN in block:
            break
        parent = hash((parent, block))
        keys.append(parent)
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("BlockPool: num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free: deque[int] = deque(range(num_blocks))  # free blocks with no cached content
        self._refs = [0] * num_blocks
        # Prefix caching: the key and tokens of each block holding a cached full block, the block of each key,
        # and the cached blocks no one owns, least recently freed first.
        self._key: list[int | None] = [None] * num_blocks
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._by_key: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0  # cached blocks handed out for new content

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones and cached ones no one owns."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a findable cached prefix block, owned or not."""
        return len(self._by_key)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n blocks for new content: plain free ones first, then the least recently freed cached ones (their
        content is forgotten)."""
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        free, refs = self._free, self._refs
        if n <= len(free):  # the common case, and every case without caching
            ids = [free.popleft() for _ in range(n)]
        else:
            ids = [free.popleft() for _ in range(len(free))]
            while len(ids) < n:
                b, _ = self._evictable.popitem(last=False)
                self._forget(b)
                self.evictions += 1
                ids.append(b)
        for b in ids:
            refs[b] = 1
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self._refs[b] <= 0:
                raise BlockIntegrityError(f"incref of free block {b}")
            self._refs[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner of each block. A block left without owners is free; with cached content it stays
        findable, as the most recently freed (give a stream's blocks last-first, so its tail goes first)."""
        refs, key = self._refs, self._key
        for b in block_ids:
            if refs[b] <= 0:
                raise BlockIntegrityError(f"double free of block {b}")
            refs[b] -= 1
            if refs[b] == 0:
                if key[b] is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None

    # ---- prefix caching ---------------------------------------------------------------------------------------
    def cache(self, block: int, key: int, tokens: tuple[int, ...]) -> bool:
        """Make an owned full block findable under `key`. False if the key is cached already (by another block:
        the first stays, this one is plain) or caching is off."""
        if not self.caching or key in self._by_key or self._key[block] is not None:
            return False
        if self._refs[block] <= 0:
            raise BlockIntegrityError(f"cache of free block {block}")
        self._key[block] = key
        self._tokens[block] = tokens
        self._by_key[key] = block
        return True

    def lookup(self, keys: Sequence[int], tokens: Sequence[int] = ()) -> list[int]:
        """The blocks of the longest cached prefix of `keys` (owned or not); with `tokens`, each hit's content is
        also compared with the stream's (a hash collision is a miss)."""
        if not self._by_key:
            return []
        hits: list[int] = []
        bs = self.block_size
        for i, k in enumerate(keys):
            b = self._by_key.get(k)
            if b is None or (tokens and self._tokens[b] != tuple(tokens[i * bs:(i + 1) * bs])):
                break
            hits.append(b)
        return hits

    def take(self, blocks: Iterable[int]) -> None:
        """One more owner of each cached block (found by `lookup`): an unowned one leaves the evictable set."""
        refs = self._refs
        for b in blocks:
            if self._key[b] is None:
                raise BlockIntegrityError(f"take of block {b}, which holds no cached content")
            if refs[b] == 0:
                del self._evictable[b]
            refs[b] += 1

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def key_of(self, block: int) -> int | None:
        return self._key[block]

    def keys_of(self, blocks: Sequence[int]) -> list[int | None]:
        return list(map(self._key.__getitem__, blocks))

    def _forget(self, b: int) -> None:
        key = self._key[b]
        if key is not None:
            del self._by_key[key]
            del self._tokens[b]
            self._key[b] = None

    # ---- invariants -------------------------------------------------------------------------------------------
    def check_integrity(self, owners: Iterable[Sequence[int]]) -> None:
        """Every block is either free (0 refs: in the free list or, with cached content, the evictable set, once)
        or referenced exactly by its owners; the key maps agree.

        Tests call this after every step of pools of thousands of blocks, so the common case (all well) is checked
        in bulk (map over C getters, list counts); only a failure walks the blocks one by one, to name the first
        bad one."""
        counts: Counter[int] = Counter()
        for blocks in owners:
            counts.update(blocks)
        if not self._integrity_holds(counts):
            self._name_the_broken_block(counts)
            raise BlockIntegrityError("the block pool's books disagree")  # the walk names what it finds first

    def _integrity_holds(self, counts: Counter[int]) -> bool:
        refs, key, free, evictable, by_key = self._refs, self._key, self._free, self._evictable, self._by_key
        n = self.num_blocks
        if counts and (min(counts) < 0 or max(counts) >= n):
            return False
        zeros = refs.count(0)
        # Owned blocks: each counted block's refcount is its owner count, and no other block has owners.
        if n - zeros != len(counts) or not all(map(operator.eq, map(refs.__getitem__, counts), counts.values())):
            return False
        # Free blocks: the free list and the evictable set are disjoint, without repeats, and are the zero-ref
        # blocks (their sizes add up to the zero count and each has no refs).
        if len(free) + len(evictable) != zeros or len(set(free)) != len(free) or not evictable.keys().isdisjoint(free):
            return False
        if any(map(refs.__getitem__, free)) or any(map(refs.__getitem__, evictable)):
            return False
        # Keys: free blocks hold none, evictable ones do; each key finds its block, and those are all the keyed
        # blocks (the map's values are distinct, as each block has one key).
        if list(map(key.__getitem__, free)).count(None) != len(free) or None in map(key.__getitem__, evictable):
            return False
        if len(by_key) != n - key.count(None) or len(self._tokens) != len(by_key):
            return False
        return all(map(operator.eq, map(key.__getitem__, by_key.values()), by_key.keys())) and \
            self._tokens.keys() == set(by_key.values())

    def _name_the_broken_block(self, counts: Counter[int]) -> None:
        if any(b < 0 or b >= self.num_blocks for b in counts):
            raise BlockIntegrityError(f"an owner holds a block out of range: {sorted(counts)[:3]}...")
        free_counts = Counter(self._free)
        if any(c > 1 for c in free_counts.values()):
            raise BlockIntegrityError("a block is in the free list twice")
        for b in range(self.num_blocks):
            refs = self._refs[b]
            if refs != counts.get(b, 0):
                raise BlockIntegrityError(f"block {b}: refcount {refs} but {counts.get(b, 0)} owners")
            in_free, in_evictable = b in free_counts, b in self._evictable
            if (refs == 0) != (in_free or in_evictable) or (in_free and in_evictable):
                raise BlockIntegrityError(f"block {b}: refcount {refs} disagrees with the free lists")
            key = self._key[b]
            if in_free and key is not None or in_evictable and key is None:
                raise BlockIntegrityError(f"block {b}: free with cached content, or evictable without")
            if key is not None and (self._by_key.get(key) != b or b not in self._tokens):
                raise BlockIntegrityError(f"block {b}: its key does not find it")
        if len(self._by_key) != sum(k is not None for k in self._key) or len(self._tokens) != len(self._by_key):
            raise BlockIntegrityError("the key maps disagree with the blocks' keys")
