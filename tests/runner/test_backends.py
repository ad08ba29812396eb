"""Attention backend selection: flash-attn only on CUDA when importable; the CPU path never imports it."""

import sys

import pytest
import torch

from tokenflow_ray.runner.attention import SdpaPagedAttention, flash_attn_available, select_backend


def test_cpu_always_uses_sdpa():
    assert isinstance(select_backend(torch.device("cpu"), 16), SdpaPagedAttention)
    assert "flash_attn" not in sys.modules or flash_attn_available()


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
