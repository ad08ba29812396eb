from collections import Counter

import pytest

from tokenflow_ray.engine.block_pool import BlockIntegrityError, BlockPool, NoFreeBlocksError


def test_allocate_free_roundtrip():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert pool.num_free == 0 and len(set(a) | set(b)) == 8
    pool.check_integrity([a, b])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(a)
    pool.check_integrity([b])
    assert pool.num_free == 3


def test_refcounts_and_double_free():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    pool.incref(a)
    pool.free(a)
    assert pool.num_free == 2  # still referenced once
    pool.check_integrity([a])
    pool.free(a)
    assert pool.num_free == 4
    with pytest.raises(BlockIntegrityError):
        pool.free(a)


def test_integrity_catches_leak_and_double_owner():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    with pytest.raises(BlockIntegrityError):
        pool.check_integrity([])  # leaked: allocated but owned by nobody
    with pytest.raises(BlockIntegrityError):
        pool.check_integrity([a, a[:1]])  # one block, two owners, one ref


def test_blocks_for_tokens():
    pool = BlockPool(4, 16)
    assert [pool.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def _walk_finds_nothing(pool: BlockPool, owners: list[list[int]]) -> bool:
    from collections import Counter

    counts: Counter[int] = Counter()
    for blocks in owners:
        counts.update(blocks)
    try:
        pool._name_the_broken_block(counts)
    except BlockIntegrityError:
        return False
    return True


def test_the_bulk_check_and_the_block_walk_agree_on_random_corruptions():
    """check_integrity's fast path (bulk counts) must pass exactly where the per-block walk finds nothing: random
    pools with cached, evictable and shared blocks, then one random corruption of their books (or none)."""
    import random

    rng = random.Random(7)
    verdicts = {True: 0, False: 0}
    for trial in range(400):
        pool = BlockPool(24, 2, caching=True)
        owners: list[list[int]] = []
        for _ in range(rng.randrange(1, 6)):
            blocks = pool.allocate(rng.randrange(1, 4))
            for b in blocks:
                pool.cache(b, rng.getrandbits(40), (trial, b))
            owners.append(blocks)
        for blocks in rng.sample(owners, k=len(owners) // 2):  # some owners let go: their blocks turn evictable
            owners.remove(blocks)
            pool.free(reversed(blocks))
        if owners and rng.random() < 0.5:  # a shared prefix
            shared = owners[0][:1]
            pool.incref(shared)
            owners.append(list(shared))
        corruption = rng.randrange(9)
        if corruption == 1 and owners:
            owners.append([owners[0][0]])  # an owner the refcount does not know
        elif corruption == 2 and owners:
            owners[0] = owners[0][1:]  # a leak
        elif corruption == 3 and pool._free:
            pool._free.append(pool._free[0])  # twice in the free list
        elif corruption == 4 and pool._evictable:
            pool._free.append(next(iter(pool._evictable)))  # free and evictable
        elif corruption == 5 and pool._free:
            pool._key[pool._free[0]] = 12345  # free with a key no map knows
        elif corruption == 6 and pool._by_key:
            k = next(iter(pool._by_key))
            pool._by_key[k] = (pool._by_key[k] + 1) % 24  # a key that finds another block
        elif corruption == 7 and pool._tokens:
            del pool._tokens[next(iter(pool._tokens))]
        elif corruption == 8:
            owners.append([24])  # out of range
        fast = pool._integrity_holds(Counter(b for o in owners for b in o))
        assert fast == _walk_finds_nothing(pool, owners), (trial, corruption)
        verdicts[fast] += 1
        if fast:
            pool.check_integrity(owners)
        else:
            with pytest.raises(BlockIntegrityError):
                pool.check_integrity(owners)
    assert min(verdicts.values()) > 50, verdicts  # both verdicts are exercised
