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
