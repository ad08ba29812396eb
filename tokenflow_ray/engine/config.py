"""Frozen, validated engine configuration. Pure Python: the simulator and tests build these without torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenflow_ray.engine.policies import POLICY_NAMES, AndesConfig, TokenFlowConfig

EMBEDDED_MODEL = "embedded"  # the seeded small Llama written to the cache folder on first use
# Built-in model configs (models/presets.py): the shape of a real model with no checkpoint, so they load only with
# load_format "dummy" (random weights). The names are the simulator's (sim/hardware.py).
MODEL_PRESETS = ("llama3-8b", "qwen2-7b", "qwen2.5-32b")
# ModelConfig.load_format, vLLM's names: auto reads the checkpoint's safetensors; dummy builds the model from its
# config with random weights drawn on the device (benchmarks of any shape without a checkpoint).
LOAD_FORMATS = ("auto", "dummy")
CPU_GEMMS = ("auto", "tokenflow", "onednn")  # ModelConfig.cpu_gemm (models/packed_linear.py)
KV_LAYOUTS = ("auto", "layer_major", "block_major")  # CacheConfig.kv_layout (runner/kv_pool.py)
ATTENTION_BACKENDS = ("auto", "flash", "sdpa", "cpu_paged", "triton")  # ModelConfig.attention_backend


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    model: str = EMBEDDED_MODEL  # local HF model directory, hub id, "embedded", or a preset (MODEL_PRESETS)
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda if available else cpu
    max_model_len: int | None = None  # None: the model config's max_position_embeddings
    seed: int = 0  # seeds the engine's default sampling generator
    # torch intra-op threads (process-wide). None: torch's default. On a small shared CPU box 1 is the safe
    # choice beside a copy thread: OpenMP teams of 2 stall at barriers whenever another thread takes a core.
    num_threads: int | None = None
    cpu_prepack: bool = True  # fp32 on CPU: pack linear weights once for the GEMM kernel below (faster decode GEMMs)
    # Which GEMM the packed linears run. auto: the compiled panel GEMM (runner/csrc/packed_gemm.cpp) on AVX-512 CPUs,
    # where it measured faster than oneDNN at every batch size, else oneDNN's packed linear; or name one.
    cpu_gemm: str = "auto"
    # fp32 on CPU: RMSNorm + residual, RoPE + KV write and SiLU·mul as fused C++ kernels (False: the reference ops)
    fused_cpu_ops: bool = True
    # auto: flash-attn on CUDA when importable, else the Triton paged kernels; the compiled paged decode kernel on
    # CPU fp32; SDPA otherwise; or name one (triton on CPU needs TRITON_INTERPRET=1: the tests).
    attention_backend: str = "auto"
    # True: no CUDA graphs, every decode step launched kernel by kernel (vLLM's name). CUDA only.
    enforce_eager: bool = False
    # auto: the checkpoint's weights; dummy: random weights (normal, std 0.02, norms 1, seeded by `seed`) drawn on
    # the device from the model's config: a preset's, or a directory's config.json (its weights unread).
    load_format: str = "auto"

    def __post_init__(self) -> None:
        _require(bool(self.model), "model: must name a local directory, a hub id, 'embedded' or a preset "
                                   f"({', '.join(MODEL_PRESETS)})")
        _require(self.load_format in LOAD_FORMATS,
                 f"load_format: expected one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        _require(self.model not in MODEL_PRESETS or self.load_format == "dummy",
                 f"model: {self.model!r} is a built-in config with no weights; it loads only with "
                 f"load_format='dummy' (random weights)")
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"dtype: unknown dtype {self.dtype!r}")
        _require(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
                 f"device: expected auto, cpu or cuda[:N], got {self.device!r}")
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len: must be positive")
        _require(self.num_threads is None or self.num_threads > 0, "num_threads: must be positive")
        _require(self.cpu_gemm in CPU_GEMMS, f"cpu_gemm: expected one of {CPU_GEMMS}, got {self.cpu_gemm!r}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention_backend: expected one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _require(isinstance(self.enforce_eager, bool), "enforce_eager: must be a bool")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block; flash-attn 2 paged KV wants a multiple of 256 (else SDPA is used)
    num_device_blocks: int = 1024  # device KV pool size, in blocks
    num_host_blocks: int = 0  # CPU spill store size, in blocks (0: no spill store, recompute only)
    write_through: bool = True  # mirror full blocks to the host in the background (False: copy all on preempt)
    overlap_copies: bool = True  # copies run beside the model step (False: before it, blocking)
    write_budget_fraction: float = 0.8  # write-through bytes per step: this share of (step time x copy bandwidth)
    resume_mode: str = "auto"  # how a paused stream comes back: auto (cheaper of load and recompute), load, recompute
    # The device pool's layout (runner/kv_pool.py). auto: block-major on CUDA (a block of every layer is one
    # contiguous region, one DMA to the host), layer-major on CPU (the compiled CPU kernels read a layer in place).
    kv_layout: str = "auto"

    def __post_init__(self) -> None:
        _require(self.kv_layout in KV_LAYOUTS, f"kv_layout: expected one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        _require(self.resume_mode in ("auto", "load", "recompute"),
                 f"resume_mode: expected auto, load or recompute, got {self.resume_mode!r}")
        _require(0 < self.write_budget_fraction <= 4, "write_budget_fraction: must be in (0, 4]")
        _require(self.block_size > 0, "block_size: must be positive")
        _require(self.num_device_blocks > 0, "num_device_blocks: must be positive")
        _require(self.num_host_blocks >= 0, "num_host_blocks: must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # most streams in one step's batch
    max_num_batched_tokens: int = 512  # token budget per step (decode tokens + prefill chunk tokens)
    chunked_prefill: bool = True  # False: a prompt is prefilled whole or not at all this step
    policy: str = "fcfs"  # fcfs | andes | tokenflow
    tokenflow: TokenFlowConfig = field(default_factory=TokenFlowConfig)
    andes: AndesConfig = field(default_factory=AndesConfig)
    fcfs_reserve_ratio: float = 0.3  # fcfs admission keeps this share of running streams' remaining tokens free

    def __post_init__(self) -> None:
        _require(self.policy in POLICY_NAMES, f"policy: unknown policy {self.policy!r}; choose one of "
                                              f"{', '.join(POLICY_NAMES)}")
        _require(self.max_num_seqs > 0, "max_num_seqs: must be positive")
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens: must be positive")
        _require(self.max_num_batched_tokens >= self.max_num_seqs,
                 "max_num_batched_tokens: must be >= max_num_seqs so every running stream can decode each step")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    default_rate: float = 0.0  # consumption rate of streams that declare none (tokens/s; 0: unpaced)
    record_history: int = 10_000  # finished-stream records kept for metrics and benchmarks
    # Plan step N+1 while the runner thread runs step N, and apply N's result while N+1 runs (same greedy output).
    # None: by the device, resolved by the runner: on with CUDA (the host's planning hides under the GPU's step),
    # off on CPU (planning and the model's threads would share the same cores).
    overlap_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.default_rate, (int, float)) and math.isfinite(self.default_rate)
                 and self.default_rate >= 0, "default_rate: must be a finite number >= 0")
        _require(self.record_history >= 0, "record_history: must be >= 0")
        _require(self.overlap_scheduling in (None, True, False), "overlap_scheduling: must be true, false or null")
