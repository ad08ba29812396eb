"""Per-step lower bound for decoding: max(weight bytes / copy bandwidth, step FLOPs / matmul FLOP/s), measured here.

The matmul rate is torch's default matmul (the benchmark's contract). oneDNN's packed GEMM, which the engine runs on
CPU, is also measured: on some CPUs (AMD: MKL takes an AVX2 path) it is twice as fast, and the bound from its rate
is the stricter one. Both are reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Roofline:
    copy_gb_s: float  # bytes of a large tensor copied per second (counted once)
    matmul_gflop_s: float  # torch's default matmul
    weight_bytes: int  # streamed every step: all weights but the embedding table (gathered, not streamed)
    flops_per_token: float
    onednn_matmul_gflop_s: float = 0.0  # 0: oneDNN unavailable

    def step_s(self, batch: int) -> float:
        return max(self.weight_bytes / (self.copy_gb_s * 1e9), batch * self.flops_per_token / (self.matmul_gflop_s * 1e9))

    def tok_s(self, batch: int) -> float:
        return batch / self.step_s(batch)

    def with_onednn_rate(self) -> Roofline:
        """The same bound at oneDNN's matmul rate where that is faster (the stricter bound)."""
        return replace(self, matmul_gflop_s=max(self.matmul_gflop_s, self.onednn_matmul_gflop_s))


def measure_copy_gb_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def median_seconds(fn, repeats: int, warm: bool = True) -> float:
    """Median wall time of `fn` over `repeats` calls, after one untimed call when `warm`."""
    if warm:
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_matmul_gflop_s(n: int = 2048, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / median_seconds(lambda: a @ b, repeats) / 1e9


def measure_onednn_matmul_gflop_s(n: int = 2048, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """The same product through oneDNN's packed linear kernel; 0 where oneDNN is unavailable."""
    from tokenflow_ray.layers.packed_linear import onednn_linear_available

    if not onednn_linear_available() or dtype != torch.float32:
        return 0.0
    a = torch.randn(n, n, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, n, dtype=dtype))
    return 2 * n ** 3 / median_seconds(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""),
                                  repeats) / 1e9


def model_roofline(hf_model: torch.nn.Module, context_len: int, dtype: torch.dtype) -> Roofline:
    """From the HF model of the same checkpoint (plain parameters): FLOPs per decoded token are 2 per weight in
    the linear layers plus attention over context_len tokens; bytes are every weight but the embedding table."""
    embed = hf_model.get_input_embeddings().weight
    linear = sum(p.numel() for p in hf_model.parameters() if p.dim() == 2 and p is not embed)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters() if p is not embed)
    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn = 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * context_len
    return Roofline(copy_gb_s=measure_copy_gb_s(), matmul_gflop_s=measure_matmul_gflop_s(dtype=dtype),
                    weight_bytes=weight_bytes, flops_per_token=2 * linear + attn,
                    onednn_matmul_gflop_s=measure_onednn_matmul_gflop_s(dtype=dtype))
