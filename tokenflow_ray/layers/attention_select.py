"""Which attention backend (attention.py) a runner gets, by device, dtype, block size and what is importable."""

from __future__ import annotations

import logging

import torch

from tokenflow_ray.engine.config import ATTENTION_BACKENDS, FLASH_BLOCK_SIZE
from tokenflow_ray.layers.attention import (
    AttentionBackend,
    CpuPagedAttention,
    FlashPagedAttention,
    SdpaPagedAttention,
)

log = logging.getLogger(__name__)


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(device: torch.device, block_size: int, prefer: str = "auto",
                   dtype: torch.dtype = torch.float32, contiguous_layers: bool = True) -> AttentionBackend:
    """CUDA: flash-attn when importable and the block size suits its paged kernel, else the Triton kernels (when
    triton is importable: it ships with CUDA torch), else SDPA. CPU float32: the compiled paged decode kernel when
    it builds and the pool's layers are contiguous (layer-major). SDPA otherwise. `triton` on CPU runs only under
    the Triton interpreter (tests)."""
    if prefer not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {prefer!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    if prefer == "sdpa":
        return SdpaPagedAttention()
    if prefer == "triton":
        return _triton_backend(device, dtype)
    if device.type != "cuda":
        if prefer == "flash":
            raise ValueError("attention_backend: flash-attn needs a CUDA device")
        if not contiguous_layers:
            if prefer == "cpu_paged":
                raise ValueError("attention_backend: cpu_paged needs the layer-major KV layout")
            return SdpaPagedAttention()
        return _cpu_backend(dtype, required=prefer == "cpu_paged")
    if prefer == "cpu_paged":
        raise ValueError("attention_backend: cpu_paged runs on CPU only")
    if prefer == "flash":
        if not flash_attn_available():
            raise ValueError("attention_backend: flash-attn is not installed (pip install .[gpu])")
        return FlashPagedAttention()
    if flash_attn_available() and block_size % FLASH_BLOCK_SIZE == 0:
        return FlashPagedAttention()
    from tokenflow_ray.layers.triton_attention import triton_available

    if triton_available():
        log.info("attention: Triton paged kernels (flash-attn %s)",
                 "wants block_size % 256 == 0" if flash_attn_available() else "not importable")
        return _triton_backend(device, dtype)
    log.warning("attention: neither flash-attn nor triton importable; torch SDPA over gathered KV (slow)")
    return SdpaPagedAttention()


def _triton_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    if device.type == "cpu" and dtype == torch.bfloat16:
        raise ValueError("attention_backend: the Triton interpreter has no bfloat16 arithmetic; use float32/16 on CPU")
    from tokenflow_ray.layers.triton_attention import TritonPagedAttention

    return TritonPagedAttention(device)


def _cpu_backend(dtype: torch.dtype, required: bool) -> AttentionBackend:
    from tokenflow_ray.layers.cpu_kernels import load_paged_decode_attention

    kernel = load_paged_decode_attention() if dtype == torch.float32 else None
    if kernel is None:
        if required:
            raise ValueError("attention_backend: cpu_paged needs float32 and a C++ compiler to build its kernel")
        return SdpaPagedAttention()
    return CpuPagedAttention(kernel)
