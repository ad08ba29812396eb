"""Frozen, validated engine configuration (docs/design.md §4). Pure Python: the simulator and tests build these
without torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from types import MappingProxyType
from typing import Any

from tokenflow_ray.checks import require
from tokenflow_ray.engine.policies import POLICY_NAMES, AndesConfig, TokenFlowConfig

EMBEDDED_MODEL = "embedded"  # the seeded small Llama written to the cache folder on first use
# Built-in model configs (models/presets.py): the shape of a real model with no checkpoint, so they load only with
# load_format "dummy" (random weights). The names are the simulator's (sim/hardware.py).
MODEL_PRESETS = ("llama3-8b", "qwen2-7b", "qwen2.5-32b")
# ModelConfig.load_format, vLLM's names: auto reads the checkpoint's safetensors; dummy builds the model from its
# config with random weights drawn on the device (benchmarks of any shape without a checkpoint).
LOAD_FORMATS = ("auto", "dummy")
CPU_GEMMS = ("auto", "tokenflow", "onednn")  # ModelConfig.cpu_gemm (layers/packed_linear.py)
KV_LAYOUTS = ("auto", "layer_major", "block_major")  # CacheConfig.kv_layout (runner/kv_pool.py)
ATTENTION_BACKENDS = ("auto", "flash", "sdpa", "cpu_paged", "triton")  # ModelConfig.attention_backend
FLASH_BLOCK_SIZE = 256  # flash-attn 2's paged KV kernel wants block sizes in multiples of this


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
    # Which GEMM the packed linears run. auto: the compiled panel GEMM (layers/csrc/packed_gemm.cpp) on AVX-512 CPUs,
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
        require(bool(self.model), "model: must name a local directory, a hub id, 'embedded' or a preset "
                                  f"({', '.join(MODEL_PRESETS)})")
        require(self.load_format in LOAD_FORMATS,
                f"load_format: expected one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        require(self.model not in MODEL_PRESETS or self.load_format == "dummy",
                f"model: {self.model!r} is a built-in config with no weights; it loads only with "
                f"load_format='dummy' (random weights)")
        require(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"dtype: unknown dtype {self.dtype!r}")
        require(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
                f"device: expected auto, cpu or cuda[:N], got {self.device!r}")
        require(self.max_model_len is None or self.max_model_len > 0, "max_model_len: must be positive")
        require(self.num_threads is None or self.num_threads > 0, "num_threads: must be positive")
        require(self.cpu_gemm in CPU_GEMMS, f"cpu_gemm: expected one of {CPU_GEMMS}, got {self.cpu_gemm!r}")
        require(self.attention_backend in ATTENTION_BACKENDS,
                f"attention_backend: expected one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        require(isinstance(self.enforce_eager, bool), "enforce_eager: must be a bool")


# The prefix cache's tiers by name (the simulator's and benches' --prefix-cache): mode -> (enable_prefix_caching,
# host_prefix_caching).
PREFIX_CACHE_MODES = MappingProxyType({"off": (False, False), "device": (True, False), "device+host": (True, True)})
DEFAULT_PREFIX_CACHE = "device+host"  # the engine's default: both tiers on


def prefix_cache_overrides(mode: str) -> dict:
    """CacheConfig fields for a --prefix-cache mode."""
    if mode not in PREFIX_CACHE_MODES:
        raise ValueError(f"--prefix-cache: expected one of {', '.join(PREFIX_CACHE_MODES)}, got {mode!r}")
    device, host = PREFIX_CACHE_MODES[mode]
    return {"enable_prefix_caching": device, "host_prefix_caching": host}


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV block. On CUDA with flash-attn the default becomes FLASH_BLOCK_SIZE (runner/device_defaults.py).
    block_size: int = 16
    num_device_blocks: int = 1024  # device KV pool size, in blocks
    num_host_blocks: int = 0  # CPU spill store size, in blocks (0: no spill store, recompute only)
    write_through: bool = True  # mirror full blocks to the host in the background (False: copy all on preempt)
    overlap_copies: bool = True  # copies run beside the model step (False: before it, blocking)
    write_budget_fraction: float = 0.8  # write-through bytes per step: this share of (step time x copy bandwidth)
    resume_mode: str = "auto"  # how a paused stream comes back: auto (cheaper of load and recompute), load, recompute
    # Prefix caching (vLLM's name): a full block's KV stays findable by its content after its stream lets go
    # (block_pool.py), and a prompt starts from the longest cached prefix of full blocks. On by default, as in
    # vLLM V1; where no prefix repeats it costs the block hashing only.
    enable_prefix_caching: bool = True
    # The host tier of the prefix cache: blocks written through (or evicted) to the host store stay findable there
    # with their own LRU, and a prompt whose prefix is only there loads it instead of computing it again.
    host_prefix_caching: bool = True
    # The device pool's layout (runner/kv_pool.py). auto: block-major on CUDA (a block of every layer is one
    # contiguous region, one DMA to the host), layer-major on CPU (the compiled CPU kernels read a layer in place).
    kv_layout: str = "auto"

    def __post_init__(self) -> None:
        require(self.kv_layout in KV_LAYOUTS, f"kv_layout: expected one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        require(self.resume_mode in ("auto", "load", "recompute"),
                f"resume_mode: expected auto, load or recompute, got {self.resume_mode!r}")
        require(0 < self.write_budget_fraction <= 4, "write_budget_fraction: must be in (0, 4]")
        require(self.block_size > 0, "block_size: must be positive")
        require(self.num_device_blocks > 0, "num_device_blocks: must be positive")
        require(self.num_host_blocks >= 0, "num_host_blocks: must be >= 0")
        require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching: must be a bool")
        require(isinstance(self.host_prefix_caching, bool), "host_prefix_caching: must be a bool")

    @property
    def prefix_cache_mode(self) -> str:
        """off, device or device+host (PREFIX_CACHE_MODES); the host tier needs a host store."""
        if not self.enable_prefix_caching:
            return "off"
        return "device+host" if self.host_prefix_caching and self.num_host_blocks > 0 else "device"


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
        require(self.policy in POLICY_NAMES, f"policy: unknown policy {self.policy!r}; choose one of "
                                             f"{', '.join(POLICY_NAMES)}")
        require(self.max_num_seqs > 0, "max_num_seqs: must be positive")
        require(self.max_num_batched_tokens > 0, "max_num_batched_tokens: must be positive")
        require(self.max_num_batched_tokens >= self.max_num_seqs,
                "max_num_batched_tokens: must be >= max_num_seqs so every running stream can decode each step")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    record_history: int = 10_000  # finished-stream records kept for metrics and benchmarks
    # Plan step N+1 while the runner thread runs step N, and apply N's result while N+1 runs (same greedy output).
    # None: by the device, resolved by the runner: on with CUDA (the host's planning hides under the GPU's step),
    # off on CPU (planning and the model's threads would share the same cores).
    overlap_scheduling: bool | None = None

    def __post_init__(self) -> None:
        require(self.record_history >= 0, "record_history: must be >= 0")
        require(self.overlap_scheduling in (None, True, False), "overlap_scheduling: must be true, false or null")

    def with_options(self, **options: Any) -> EngineConfig:
        """This config with engine options given by name, each set on the config that declares it: ModelConfig's
        (model, dtype, device, load_format, ...), CacheConfig's (block_size, num_device_blocks, num_host_blocks,
        ...), SchedulerConfig's (max_num_seqs, policy, ...) or this one's (overlap_scheduling, record_history),
        as vLLM's LLM(...) and `tokenflow serve` take them. `model`, `cache` or `scheduler` given a mapping (or a
        config) sets that part as a whole; a mapping for a nested config (tokenflow, andes) sets its fields. An
        unknown name or the same field given twice raises ValueError."""
        parts: dict[str, Any] = {name: getattr(self, name) for name in _PARTS}
        changes: dict[str, dict[str, Any]] = {name: {} for name in (*_PARTS, "")}  # per part, set at once
        for name, value in options.items():
            part_type = _PARTS.get(name)
            if part_type is not None and isinstance(value, part_type):
                parts[name] = value
            elif part_type is not None and isinstance(value, Mapping):
                for key in value:
                    require(key not in changes[name], f"{key}: given twice (by name and in {name}'s part)")
                changes[name].update(value)
            elif name in _OPTION_PART:
                part = _OPTION_PART[name]
                require(name not in changes[part], f"{name}: given twice (by name and in {part}'s part)")
                changes[part][name] = value
            else:
                raise ValueError(f"unknown engine option {name!r}; known: {', '.join(sorted(_OPTION_PART))}")
        for name in _PARTS:
            if changes[name]:
                parts[name] = _with_fields(parts[name], changes[name], name)
        return replace(self, **parts, **_with_fields(self, changes[""], "engine", build=False))


_PARTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
# Every engine option by name -> the part that declares it ("" : EngineConfig itself). ModelConfig.model is the
# option `model` (a string); EngineConfig.model, the part, is set by a mapping or a ModelConfig.
_OPTION_PART = {f.name: part for part, cls in _PARTS.items() for f in fields(cls)} | {
    f.name: "" for f in fields(EngineConfig) if f.name not in _PARTS}
require(len(_OPTION_PART) == sum(len(fields(c)) for c in _PARTS.values()) + len(fields(EngineConfig)) - len(_PARTS),
        "engine options: a field name is declared by two configs")


def engine_option_names() -> frozenset[str]:
    """Every engine option EngineConfig.with_options takes by name."""
    return frozenset(_OPTION_PART)


def _with_fields(obj: Any, changes: Mapping[str, Any], where: str, build: bool = True) -> Any:
    """`obj` with `changes` (a mapping given for a nested config sets that config's fields); validated on build."""
    known = {f.name for f in fields(obj)}
    out = {}
    for key, value in changes.items():
        require(key in known, f"{where}: unknown option {key!r}; known: {', '.join(sorted(known))}")
        current = getattr(obj, key)
        out[key] = _with_fields(current, value, f"{where}.{key}") if is_dataclass(current) and isinstance(
            value, Mapping) else value
    return replace(obj, **out) if build else out
