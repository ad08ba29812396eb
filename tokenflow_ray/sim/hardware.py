"""GPU, model and deployment constants for the simulator's roofline cost model, each with its source; and the
profiles of this project's engine as measured on a GPU (`MEASURED`).

Roofline sources are the notes in gpu-notes.md (§0-§4; outside the repository, docs/design.md §13), which cite the
primary documents; tags follow them: [src] copied from a named source, [computed] from a config, [est.] an estimate
by the stated arithmetic. The measured profiles were fitted by `tokenflow simulate validate --real` on this
project's own runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

GB = 1e9
GIB = 2 ** 30


@dataclass(frozen=True)
class GpuSpec:
    name: str
    flops: float  # dense BF16 tensor FLOP/s
    hbm_bytes_s: float  # device memory bandwidth
    memory_bytes: float
    host_link_bytes_s: float  # measured pinned one-way H2D/D2H
    bidir_factor: float  # per-direction share of host_link_bytes_s when both directions copy at once
    eta_bw: float  # achieved share of hbm_bytes_s on the weight read (small-batch decode, overheads in)
    eta_compute: float  # achieved share of flops on large GEMMs
    eta_kv: float  # achieved share of hbm_bytes_s on decode attention's KV reads
    fixed_s: float  # per-step fixed cost (launches, sampling, scheduling glue)
    allreduce_bytes_s: float  # GPU-to-GPU all-reduce bandwidth for tensor parallelism (0: TP unsupported)
    allreduce_latency_s: float  # per all-reduce call

    def __post_init__(self) -> None:
        for name in ("flops", "hbm_bytes_s", "memory_bytes", "host_link_bytes_s", "fixed_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{self.name}.{name}: must be a finite number > 0, got {v!r}")
        for name in ("bidir_factor", "eta_bw", "eta_compute", "eta_kv"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{self.name}.{name}: must be in (0, 1], got {v!r}")


# gpu-notes.md §0/§1 (specs, host link) and §3.5 (efficiency factors, fixed cost).
GPUS = MappingProxyType({
    # RTX 4090: 165.2 TFLOP/s BF16 dense with FP32 accumulate [src waredb]; 1,008 GB/s GDDR6X [src spec table];
    # PCIe 4.0 x16, pinned copies ~25-26 GB/s on Gen4 servers [src nvbandwidth README, A10 25.17]; both directions
    # at once 18.6 of 26 GB/s each way [src nvbandwidth README] -> 0.72. η_bw 0.85 (llama.cpp 18.2 ms vs 15.9 ms
    # floor: 0.87), η_c 0.8 (matmul measured 159-167 TF), η_kv 0.8 [§3.5]. No P2P on GeForce: TP all-reduce goes
    # through host memory at ~25.8 GB/s [src tinygrad/open-gpu-kernel-modules#6], ~30 µs a call [est.].
    "4090": GpuSpec("RTX 4090", flops=165.2e12, hbm_bytes_s=1008 * GB, memory_bytes=24 * GB,
                    host_link_bytes_s=25 * GB, bidir_factor=0.72, eta_bw=0.85, eta_compute=0.8, eta_kv=0.8,
                    fixed_s=0.3e-3, allreduce_bytes_s=25.8 * GB, allreduce_latency_s=30e-6),
    # RTX A6000: 154.8 TFLOP/s dense [src llmperf.net/Microway]; 768 GB/s [src servethehome]; PCIe 4.0 like the
    # 4090; GPU-GPU copies over PCIe 26.3 GB/s [src NVIDIA/nvbandwidth#50], all-reduce ~15-30 µs a call [§3.5
    # est.]. η_bw 0.88 (vLLM Qwen2.5-7B 21.9 ms vs 19.8 ms floor: 0.90), η_c 0.65 (slope at 64-256 seqs) [§3.5].
    "a6000": GpuSpec("RTX A6000", flops=154.8e12, hbm_bytes_s=768 * GB, memory_bytes=48 * GB,
                     host_link_bytes_s=25 * GB, bidir_factor=0.72, eta_bw=0.88, eta_compute=0.65, eta_kv=0.8,
                     fixed_s=0.5e-3, allreduce_bytes_s=26.3 * GB, allreduce_latency_s=20e-6),
    # H200 SXM: 989 TFLOP/s BF16 dense [src glennklockwood H100 page: same GH100]; 141 GB HBM3e at 4.8 TB/s
    # [src]; PCIe 5.0, pinned copies 55-57 GB/s on Gen5 HGX boards [src H800 nvbandwidth 55.3/55.1]; both
    # directions at once unknown, 0.75 assumed [§1 est.]. η_bw 0.72 (H100 vLLM 6.48 ms vs 4.79 ms floor: 0.74),
    # η_c 0.6, η_kv 0.7, fixed 0.6 ms (BLIS: ~1.1 ms at 32 layers on H100; CUDA graphs lower) [§3.5].
    "h200": GpuSpec("H200 SXM", flops=989e12, hbm_bytes_s=4800 * GB, memory_bytes=141 * GB,
                    host_link_bytes_s=55 * GB, bidir_factor=0.75, eta_bw=0.72, eta_compute=0.6, eta_kv=0.7,
                    fixed_s=0.6e-3, allreduce_bytes_s=450 * GB, allreduce_latency_s=10e-6),
})


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    weight_bytes: float  # bf16, all weights (embedding and lm_head included)
    linear_flops_per_token: float  # 2·params of the layers' linear ops (lm_head excluded)
    max_model_len: int

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K, V) · layers · kv_heads · head_dim · 2 bytes (bf16)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def attn_flops_per_pair(self) -> float:
        """4·L·Hq·d per (query, key) pair: QKᵀ and PV."""
        return 4.0 * self.layers * self.q_heads * self.head_dim

    @property
    def lm_head_flops_per_token(self) -> float:
        return 2.0 * self.hidden * self.vocab


# gpu-notes.md §2, from the HF config.json files [computed there: params, weight bytes, linear FLOPs, KV bytes].
MODELS = MappingProxyType({
    "llama3-8b": ModelSpec("Llama-3-8B", layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128,
                           vocab=128_256, weight_bytes=16.06 * GB, linear_flops_per_token=13.96e9,
                           max_model_len=8192),
    "qwen2.5-32b": ModelSpec("Qwen2.5-32B", layers=64, hidden=5120, q_heads=40, kv_heads=8, head_dim=128,
                             vocab=152_064, weight_bytes=65.5 * GB, linear_flops_per_token=62.4e9,
                             max_model_len=32768),
})


@dataclass(frozen=True)
class Deployment:
    """A model on a GPU type: tensor parallelism, and the KV pool left over (gpu-notes.md §2, 'Where each model
    fits'). Per-GPU quantities divide by TP; each rank copies its share of the KV over its own host link."""

    gpu: GpuSpec
    model: ModelSpec
    tp: int
    kv_pool_tokens: int  # device KV pool, tokens, all ranks together
    note: str
    host_kv_bytes: float = 64 * GIB  # pinned host memory for the spill store, all ranks together

    @property
    def host_kv_tokens(self) -> int:
        return int(self.host_kv_bytes // self.model.kv_bytes_per_token)

    @property
    def name(self) -> str:
        return f"{self.gpu.name} x{self.tp} / {self.model.name}" if self.tp > 1 else f"{self.gpu.name} / {self.model.name}"


# KV capacity [est. in gpu-notes.md §2]: memory utilisation 0.9, 1.5-3 GiB of activations, KV split by KV heads.
# Host spill store (the paper gives no size) [est.]: 64 GiB of pinned memory on a 4090/A6000 workstation, 64 GiB
# per GPU on multi-GPU boxes, 256 GiB on an H200 server (HGX nodes carry 1-2 TiB for 8 GPUs).
DEPLOYMENTS = MappingProxyType({
    ("4090", "llama3-8b"): Deployment(GPUS["4090"], MODELS["llama3-8b"], 1, 42_000, "~5.1 GiB free for KV"),
    ("4090", "qwen2.5-32b"): Deployment(GPUS["4090"], MODELS["qwen2.5-32b"], 4, 79_000,
                                        "TP4, no P2P: all-reduce through the host; ~4.8 GiB KV per GPU",
                                        host_kv_bytes=4 * 64 * GIB),
    ("a6000", "llama3-8b"): Deployment(GPUS["a6000"], MODELS["llama3-8b"], 1, 219_000, "~26.7 GiB free for KV"),
    ("a6000", "qwen2.5-32b"): Deployment(GPUS["a6000"], MODELS["qwen2.5-32b"], 2, 92_000,
                                         "TP2 over PCIe; ~11 GiB KV per GPU",
                                         host_kv_bytes=2 * 64 * GIB),
    # The paper's H200 runs use SGLang mem-frac 0.3 (weights + KV pool in 30% of memory) to create pressure.
    ("h200", "llama3-8b"): Deployment(GPUS["h200"], MODELS["llama3-8b"], 1, 222_000, "SGLang mem-frac 0.3",
                                      host_kv_bytes=256 * GIB),
    # mem-frac 0.3 (~42 GiB) cannot hold 61 GiB of weights, so the 32B runs must have used more [inference, §2].
    ("h200", "qwen2.5-32b"): Deployment(GPUS["h200"], MODELS["qwen2.5-32b"], 1, 255_000,
                                        "util 0.9 (mem-frac 0.3 cannot hold the weights)",
                                        host_kv_bytes=256 * GIB),
})

GPU_NAMES = tuple(GPUS)
MODEL_NAMES = tuple(MODELS)


def deployment(gpu: str, model: str) -> Deployment:
    """A roofline deployment, or the deployment a measured profile ran (`MEASURED`, only with its own model)."""
    measured = MEASURED.get(gpu)
    if measured is not None and MODELS.get(model) == measured.deployment.model:
        return measured.deployment
    try:
        return DEPLOYMENTS[(gpu, model)]
    except KeyError:
        raise ValueError(f"no deployment for gpu={gpu!r} model={model!r}; gpus: {', '.join(PROFILE_NAMES)}, "
                         f"models: {', '.join(MODEL_NAMES)}") from None


@dataclass(frozen=True)
class MeasuredEngine:
    """This project's engine on a device as measured (not a roofline): its step law per policy (whole steps on the
    wall clock, planning included), what a new attention shape and the process's first step cost, and its copy
    link (sim/calibrate_gpu.py fits them; sim/cold_start.py says what each cost is)."""

    name: str
    deployment: Deployment  # the model and device KV pool it ran; its host store is `host_pool_factor` x the pool
    laws: MappingProxyType  # policy -> (fixed_s, decode_s, prefill_s per token, context_s per token)
    decode_shape_s: float
    prefill_shape_s: float
    first_step_s: float
    copy_bytes_s: float  # median measured, evictions then loads (the CUDA copier's streams), beside the step
    host_pool_factor: int  # the host store is this many times the device pool, in blocks (as the runs had it)
    source: str


_H200 = DEPLOYMENTS[("h200", "llama3-8b")]
# Fitted by `tokenflow simulate validate --real ../shared/data/h200/setup_a_eighth_{fcfs,tokenflow}.json --grid
# ../shared/data/h200/step_grid.json` (docs/results/runs/validate_real_h200.json): the fcfs run's 3,517 steps
# replayed step for step (2 one-offs over 0.5 s left out, rms 8.3 ms), tokenflow's per-step terms on its own warm
# steps, the cost per prefill token from the grid (the serving runs cannot separate it from new prefill shapes).
# The engine at commit 5e9bf8e: torch SDPA, block size 16, no CUDA graphs, random bf16 Llama-3-8B weights.
MEASURED = MappingProxyType({
    "h200-measured": MeasuredEngine(
        "H200 SXM, this engine (SDPA, measured)",
        Deployment(_H200.gpu, _H200.model, 1, _H200.kv_pool_tokens, "the runs' pool: SGLang mem-frac 0.3",
                   host_kv_bytes=4 * _H200.kv_pool_tokens * _H200.model.kv_bytes_per_token),
        MappingProxyType({"fcfs": (16.83e-3, 69.1e-6, 23.1e-6, 0.0),
                          "tokenflow": (24.45e-3, 42.4e-6, 23.1e-6, 0.0)}),
        decode_shape_s=56.2e-3, prefill_shape_s=61.1e-3, first_step_s=0.472, copy_bytes_s=27.09e9,
        host_pool_factor=4, source="../shared/data/h200/setup_a_eighth_{fcfs,tokenflow}.json, step_grid.json (2026-12-04)"),
})
PROFILE_NAMES = GPU_NAMES + tuple(MEASURED)
