"""The pinned host store is page-locked at its size (to the page) by host registration, page-aligned in a buffer of
its own, and unregistered once on close, checked through a recording stand-in for torch.cuda.cudart()."""

from __future__ import annotations

import mmap

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
    page = mmap.PAGESIZE
    pages = -(-exact // page) * page
    assert store.nbytes == exact and store.registered_bytes == pages < exact + page
    assert store.tensor.shape == shape and store.tensor.dtype == torch.bfloat16 and store.tensor.is_contiguous()
    assert store.tensor.data_ptr() % page == 0  # registered pages hold nothing but the store
    assert store.tensor.untyped_storage().nbytes() == pages + page  # its own buffer: no power-of-two rounding
    assert cuda.log == [("host_register", store.tensor.data_ptr(), pages, 0)]
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
    exact = 23 * pool.block_bytes
    assert registered == [("host_register", copier.host_kv.data_ptr(), -(-exact // mmap.PAGESIZE) * mmap.PAGESIZE, 0)]
    assert copier.store.nbytes == exact
    assert copier.host_kv.shape == (23, 4, 2, 16, 2, 8)  # block-major whatever the pool's layout
    copier.close()
    assert cuda.runtime.registered == {}


def test_the_store_starts_zeroed():
    store = PinnedHostStore((5, 1000), torch.float32, FakeCuda().cudart())
    assert torch.count_nonzero(store.tensor) == 0
