"""Attention backends: flash-attn only on CUDA when importable (the CPU path never imports it); on CPU the
compiled paged decode kernel, checked against SDPA."""

import sys

import pytest
import torch

from tokenflow_ray.runner.attention import (
    CpuPagedAttention,
    SdpaPagedAttention,
    flash_attn_available,
    select_backend,
)
from tokenflow_ray.runner.cpu_kernels import compiler_available, load_paged_decode_attention

needs_compiler = pytest.mark.skipif(not compiler_available(), reason="needs a C++ compiler")


def test_cpu_never_imports_flash_attn():
    assert isinstance(select_backend(torch.device("cpu"), 16), SdpaPagedAttention)
    assert isinstance(select_backend(torch.device("cpu"), 16, prefer="sdpa", dtype=torch.bfloat16),
                      SdpaPagedAttention)
    assert "flash_attn" not in sys.modules or flash_attn_available()


@needs_compiler
def test_cpu_float32_uses_the_compiled_paged_kernel():
    """With a compiler the kernel must build: a silent fallback would hide a broken build."""
    assert load_paged_decode_attention() is not None
    assert isinstance(select_backend(torch.device("cpu"), 16), CpuPagedAttention)
    assert not isinstance(select_backend(torch.device("cpu"), 16, dtype=torch.bfloat16), CpuPagedAttention)


@needs_compiler
@pytest.mark.parametrize("shape", [dict(block_size=16, heads=4, kv_heads=2, head_dim=16),
                                   dict(block_size=16, heads=6, kv_heads=2, head_dim=64, decodes=9),
                                   dict(block_size=8, heads=4, kv_heads=4, head_dim=32),
                                   dict(block_size=32, heads=8, kv_heads=1, head_dim=64, decodes=1),
                                   dict(block_size=16, heads=8, kv_heads=2, head_dim=128, decodes=5),
                                   dict(block_size=32, heads=6, kv_heads=2, head_dim=128, decodes=4),
                                   dict(block_size=16, heads=10, kv_heads=2, head_dim=64, decodes=3),
                                   dict(block_size=16, heads=14, kv_heads=2, head_dim=32, decodes=3),
                                   dict(block_size=16, heads=4, kv_heads=2, head_dim=24, decodes=4)])
def test_cpu_paged_kernel_matches_sdpa(shape):
    """Decodes of random lengths (1 token up to 3 blocks, partial last blocks) plus a continued prefill chunk.
    head_dim 16/32/64/128 take the vector path, whose query heads go in groups of 4, 3, 2 or 1 (groups of 3 and
    remainders 1-3: G = 3, 5, 7; block_size 8 and 32 split 16-token chunks unevenly); head_dim 24 the scalar one."""
    from tokenflow_ray.runner.gpu_check import paged_attention_parity

    kernel = CpuPagedAttention(load_paged_decode_attention())
    for seed in range(3):
        assert paged_attention_parity(kernel, SdpaPagedAttention(), device="cpu", dtype=torch.float32,
                                      chunk=8, seed=seed, **shape) < 1e-5


def test_asking_for_flash_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA"):
        select_backend(torch.device("cpu"), 256, prefer="flash")
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend(torch.device("cpu"), 16, prefer="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_matches_sdpa_on_paged_kv():
    from tokenflow_ray.runner.attention import FlashPagedAttention

    if not flash_attn_available():
        pytest.skip("flash-attn not installed")
    from tokenflow_ray.runner.gpu_check import paged_attention_parity

    assert paged_attention_parity(FlashPagedAttention(), SdpaPagedAttention()) < 2e-2


def test_paged_batch_of_the_gpu_check_runs_on_cpu():
    """The device check's batch builder and SDPA path, exercised here so the script is known to run."""
    from tokenflow_ray.runner.gpu_check import _random_paged_batch

    q, k, v, kc, vc, meta = _random_paged_batch(torch.device("cpu"), torch.float32, block_size=16, heads=4,
                                                kv_heads=2, head_dim=16, decodes=3, chunk=8)
    out = SdpaPagedAttention().forward(q, k, v, kc, vc, meta)
    assert out.shape == (q.shape[0], 4 * 16) and torch.isfinite(out).all()
