"""Attention backends: flash-attn only on CUDA when importable (the CPU path never imports it); on CPU the
compiled paged decode kernel, checked against SDPA."""

import sys

import pytest
import torch

from tokenflow_ray.layers.attention import CpuPagedAttention, SdpaPagedAttention
from tokenflow_ray.layers.attention_select import flash_attn_available, select_backend
from tokenflow_ray.layers.cpu_kernels import compiler_available, load_paged_decode_attention

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
@pytest.mark.parametrize("width", ["native", "other"])
def test_cpu_paged_kernel_matches_sdpa(shape, width):
    """Decodes of random lengths (1 token up to 3 blocks, partial last blocks) plus a continued prefill chunk.
    head_dim 16/32/64/128 take the vector path, whose query heads go in groups of 4, 3, 2 or 1 (groups of 3 and
    remainders 1-3: G = 3, 5, 7; block_size 8 and 32 split 8- and 16-token chunks unevenly); head_dim 24 the scalar
    one. Both vector widths run on any CPU: this CPU's build, and the other width's (16 lanes on AVX2, 8 on
    AVX-512), whose shuffles, reduction order and head groups differ."""
    from tokenflow_ray.runner.gpu_check import paged_attention_parity

    native = load_paged_decode_attention()
    module = native if width == "native" else load_paged_decode_attention(24 - native.lanes())
    assert module is not None and module.lanes() in (8, 16)
    kernel = CpuPagedAttention(module)
    for seed in range(3):
        assert paged_attention_parity(kernel, SdpaPagedAttention(), device="cpu", dtype=torch.float32,
                                      chunk=8, seed=seed, **shape) < 1e-5


def test_kernel_width_is_checked():
    with pytest.raises(ValueError, match="lanes"):
        load_paged_decode_attention(4)


def test_asking_for_flash_on_cpu_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="CUDA"):
        select_backend(torch.device("cpu"), 256, prefer="flash")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend(torch.device("cpu"), 16, prefer="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend(torch.device("cpu"), 16, prefer="flashinfer")


def test_triton_is_cudas_default_without_flash_attn_and_opt_in_on_cpu(monkeypatch):
    """auto on CUDA: flash-attn when importable and the block size suits it, else the Triton kernels (nothing is
    compiled or run here: the backend is only built). On CPU, triton only when asked for, under the interpreter,
    and never in bfloat16 (the interpreter has none)."""
    from tokenflow_ray.layers import attention_select
    from tokenflow_ray.layers.triton_attention import TritonPagedAttention, triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    cuda = torch.device("cuda")
    monkeypatch.setattr(attention_select, "flash_attn_available", lambda: False)
    assert isinstance(select_backend(cuda, 16), TritonPagedAttention)
    assert isinstance(select_backend(cuda, 16, prefer="sdpa"), SdpaPagedAttention)
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        select_backend(cuda, 16, prefer="flash")
    monkeypatch.setattr(attention_select, "flash_attn_available", lambda: True)
    assert isinstance(select_backend(cuda, 16), TritonPagedAttention)  # block size 16: not flash's
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not isinstance(select_backend(torch.device("cpu"), 16), TritonPagedAttention)  # auto on CPU
    assert isinstance(select_backend(torch.device("cpu"), 16, prefer="triton", dtype=torch.float16),
                      TritonPagedAttention)
    with pytest.raises(ValueError, match="bfloat16"):
        select_backend(torch.device("cpu"), 16, prefer="triton", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_matches_sdpa_on_paged_kv():
    from tokenflow_ray.layers.attention import FlashPagedAttention

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


@needs_compiler
@pytest.mark.parametrize("head_dim", [64, 24])
def test_cpu_kernel_reads_persistent_tables_by_row(head_dim):
    """The engine's form of the decode metadata (the whole persistent table, each stream's row and position, q a
    strided view into a fused QKV output) gives exactly what the gathered table and lengths give; a row or a
    length outside the table is an error, not a read out of bounds."""
    kernel = load_paged_decode_attention()
    g = torch.Generator().manual_seed(0)
    blocks, bs, kvh, heads, D, R, W = 40, 16, 2, 6, 5, 12, 6
    kc = torch.randn(blocks, bs, kvh, head_dim, generator=g)
    vc = torch.randn(blocks, bs, kvh, head_dim, generator=g)
    tables = torch.randint(0, blocks, (R, W), generator=g)
    rows = torch.tensor([7, 0, 11, 3, 5])
    positions = torch.tensor([0, 15, 16, 40, 95])  # one token, a full block, a block and one, partial, all W
    qkv = torch.randn(D, (heads + 2 * kvh) * head_dim, generator=g)
    q = qkv[:, :heads * head_dim].view(D, heads, head_dim)  # rows strided by the fused width
    assert not q.is_contiguous()
    got = kernel.paged_decode_attention_rows(q, kc, vc, tables, rows, positions, 0.125)
    want = kernel.paged_decode_attention(q.contiguous(), kc, vc, tables[rows], positions + 1, 0.125)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="row out of range"):
        kernel.paged_decode_attention_rows(q, kc, vc, tables, torch.tensor([7, 0, 12, 3, 5]), positions, 0.125)
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        kernel.paged_decode_attention_rows(q, kc, vc, tables, rows, positions + 1, 0.125)


def test_config_names_the_triton_backend_and_eager_mode():
    from tokenflow_ray.engine.config import ModelConfig

    assert ModelConfig(attention_backend="triton", enforce_eager=True).enforce_eager
    assert not ModelConfig().enforce_eager  # graphs on by default (CUDA only)
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(attention_backend="flashinfer")
    with pytest.raises(ValueError, match="enforce_eager"):
        ModelConfig(enforce_eager="yes")
