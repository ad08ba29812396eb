"""The pinned host store is page-locked at exactly its size by host registration, and unregistered once on close,
checked through a recording stand-in for torch.cuda.cudart()."""

from __future__ import annotations

import pytest
import torch

from tests.runner.fake_cuda import FakeCuda
from tokenflow_ray.runner.cuda_copies import CudaBlockCopier
from tokenflow_ray.runner.host_store import PinnedHostStore
from tokenflow_ray.runner.kv_pool import KVPool


def test_registers_exactly_the_store_and_unregisters_once():
    cuda = FakeCuda()
    shape = (37, 3, 2, 16, 2, 24)  # 37 blocks: not a power of two, nor is a block's byte count
    store = PinnedHostStore(shape, torch.bfloat16, cuda.cudart())
    exact = 37 * 3 * 2 * 16 * 2 * 24 * 2
    assert store.nbytes == exact and store.tensor.untyped_storage().nbytes() == exact
    assert cuda.log == [("host_register", store.tensor.data_ptr(), exact, 0)]
    assert not store.tensor.is_pinned()  # a plain CPU tensor: the caching host allocator was not asked
    store.close()
    store.close()
    assert cuda.log[1:] == [("host_unregister", store.tensor.data_ptr())]


def test_a_refused_registration_says_what_to_check():
    cuda = FakeCuda()
    cuda.runtime.fail = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="ulimit -l"):
        PinnedHostStore((4, 8), torch.float32, cuda.cudart())


@pytest.mark.parametrize("layout", ["block_major", "layer_major"])
def test_the_copier_registers_host_blocks_times_block_bytes(layout):
    cuda = FakeCuda()
    pool = KVPool(4, 10, 16, 2, 8, torch.bfloat16, torch.device("cpu"), layout=layout)
    copier = CudaBlockCopier(pool, num_host_blocks=23, cuda=cuda, batch_memcpy=None)
    registered = [e for e in cuda.log if e[0] == "host_register"]
    assert registered == [("host_register", copier.host_kv.data_ptr(), 23 * pool.block_bytes, 0)]
    assert copier.host_kv.shape == (23, 4, 2, 16, 2, 8)  # block-major whatever the pool's layout
    copier.close()
    assert cuda.runtime.registered == {}
