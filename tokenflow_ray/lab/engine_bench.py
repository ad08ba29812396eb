"""`tokenflow bench engine`: decode tok/s of our engine vs HF `generate` (static batch) and HF `generate_batch`
(continuous batching), on the same model directory, dtype and prompts, in one run; plus the roofline and a
mixed-output-length workload.

Decode throughput isolates decoding from prefill for every system the same way: run the batch to N new tokens and
to 1 new token, and divide the B·(N−1) extra tokens by the extra time. Each figure is the median of --repeats runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from tokenflow_ray.engine.config import (
    CPU_GEMMS,
    LOAD_FORMATS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.lab.roofline import median_seconds, model_roofline
from tokenflow_ray.runner.factory import build_engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineBenchConfig:
    model: str = "embedded"
    dtype: str = "float32"
    batches: tuple[int, ...] = (1, 8, 32, 64)
    prompt_len: int = 64
    new_tokens: int = 128
    repeats: int = 3
    mixed_requests: int = 64
    mixed_min_tokens: int = 16
    mixed_max_tokens: int = 256
    hf_static_batch: int = 32  # HF generate runs the mixed workload in batches of this size
    generate_batch: bool = True  # include HF generate_batch (slow: it is the like-for-like continuous batcher)
    seed: int = 0
    peer: str | None = None  # "vllm": also vLLM's offline tok/s on the same model, prompts and batches (own venv)
    peer_env: str | None = None  # the vLLM venv; None: the default under the cache folder (created if missing)
    # "ours" with overlapped scheduling; the other mode is measured beside it either way. Off by default: on a
    # CPU box the model's OpenMP team and the planning thread share the same cores (`overlap_vs_sync` 0.63-0.98
    # in docs/results/runs/engine_vs_*.json).
    overlap: bool = False
    profile_batch: int | None = 32  # where a decode step's time goes at this batch (None: skip)
    cpu_gemm: str = "auto"  # the linear layers' kernel (ModelConfig.cpu_gemm): auto, tokenflow or onednn
    # ModelConfig.load_format. dummy: random weights from the model's config (a preset such as llama3-8b needs
    # no checkpoint); HF then runs a model built from the same config (its own random weights: speed only).
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if not self.batches or any(b <= 0 for b in self.batches):
            raise ValueError("batch: batch sizes must be positive integers")
        if self.prompt_len <= 0 or self.new_tokens < 2 or self.repeats <= 0:
            raise ValueError("prompt_len, new_tokens (>= 2) and repeats must be positive")
        if not 0 < self.mixed_min_tokens <= self.mixed_max_tokens:
            raise ValueError("mixed token range: need 0 < min <= max")
        if self.peer not in (None, "vllm"):
            raise ValueError(f"peer: expected 'vllm', got {self.peer!r}")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"cpu_gemm: expected one of {CPU_GEMMS}, got {self.cpu_gemm!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: expected one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.peer is not None and self.load_format == "dummy":
            raise ValueError("peer: vLLM loads a checkpoint; run it with load_format auto, not dummy")
        ModelConfig(model=self.model, load_format=self.load_format)  # a preset without dummy: its error now


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(min(vocab, 256)) for _ in range(length)] for _ in range(n)]


def _decode_tok_s(runs: dict[str, Callable[[int], object]], batch: int, n: int, repeats: int) -> dict[str, float]:
    """Systems take turns within each repeat, so load from elsewhere on the machine hits them alike."""
    for run in runs.values():
        run(2)  # warm-up
    full: dict[str, list[float]] = {k: [] for k in runs}
    first: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            full[name].append(median_seconds(lambda run=run: run(n), 1, warm=False))
            first[name].append(median_seconds(lambda run=run: run(1), 1, warm=False))
    return {k: batch * (n - 1) / max(statistics.median(full[k]) - statistics.median(first[k]), 1e-9) for k in runs}


def bench_engine(cfg: EngineBenchConfig) -> LLMEngine:
    """Our engine as every figure of the bench runs it: room for the largest batch at the longest context."""
    max_batch = max(max(cfg.batches), cfg.mixed_requests, cfg.profile_batch or 0)
    ctx = cfg.prompt_len + max(cfg.new_tokens, cfg.mixed_max_tokens)
    block = 16
    return build_engine(EngineConfig(
        model=ModelConfig(model=cfg.model, dtype=cfg.dtype, device="cpu", cpu_gemm=cfg.cpu_gemm,
                          load_format=cfg.load_format),
        cache=CacheConfig(block_size=block, num_device_blocks=max_batch * (-(-ctx // block)) + 8),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch * 4))))


def run_step_profile(cfg: EngineBenchConfig, progress: Callable[[str], None] = print) -> dict:
    """Only the step profile (`--profile-only`): no HF model, no peers; --repeats profiles on one engine, each
    figure the median over them (the runs are kept under `runs`)."""
    from tokenflow_ray.lab.step_profile import profile_decode_steps

    if not cfg.profile_batch:
        raise ValueError("profile-only: needs a profile batch > 0")
    engine = bench_engine(cfg)
    prompts = _prompts(cfg.profile_batch, cfg.prompt_len, engine.runner.info.vocab_size,
                       cfg.seed + cfg.profile_batch)
    runs = []
    for i in range(cfg.repeats):
        runs.append(profile_decode_steps(engine, prompts))
        progress(f"run {i + 1}/{cfg.repeats}: " + _profile_line(runs[-1]))
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    progress("median: " + _profile_line(out))
    return {"model": cfg.model, "dtype": cfg.dtype, "device": "cpu", "threads": torch.get_num_threads(),
            "gemm": engine.runner.gemm, "machine": machine_info(), "config": asdict(cfg), "profile": out, "runs": runs}


def _profile_line(p: dict) -> str:
    return (f"batch {p['batch']} step {p['step_ms']:.2f} ms ({p['step_ms_overlapped']:.2f} overlapped): GEMMs "
            f"{p['gemm_ms']:.2f}, attention {p['attention_ms']:.2f}, other model {p['other_model_ms']:.2f}, Python "
            f"bookkeeping {p['python_bookkeeping_ms']:.3f} ms (schedule {p['schedule_ms']:.3f}, runner "
            f"{p['runner_python_ms']:.3f}, engine rest {p['engine_rest_ms']:.3f})")


class _Systems:
    """The three systems on one model directory."""

    def __init__(self, cfg: EngineBenchConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.engine = bench_engine(cfg)
        self.vocab = self.engine.runner.info.vocab_size
        dtype = self.engine.runner.dtype
        if cfg.load_format == "dummy":  # no checkpoint to read (or not read): the same shape, HF's random init
            self.hf = AutoModelForCausalLM.from_config(self.engine.runner.model.config, dtype=dtype).eval()
        else:
            self.hf = AutoModelForCausalLM.from_pretrained(self.engine.runner.model_dir, dtype=dtype).eval()
        self.pad = self.engine.tokenizer.pad_token_id or 0

    def ours(self, prompts: Sequence[Sequence[int]], lengths: Sequence[int], overlap: bool) -> int:
        self.engine.config = dataclasses.replace(self.engine.config, overlap_scheduling=overlap)
        self.engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
        return sum(lengths)

    @torch.inference_mode()
    def hf_generate(self, prompts: Sequence[Sequence[int]], n: int) -> None:
        x = torch.tensor(prompts)
        self.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=self.pad)

    @torch.inference_mode()
    def hf_generate_batch(self, prompts: Sequence[Sequence[int]], n: int) -> None:
        from transformers import GenerationConfig

        gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                               pad_token_id=self.pad)
        self.hf.generate_batch([list(p) for p in prompts], generation_config=gen, progress_bar=False)


def run_engine_bench(cfg: EngineBenchConfig, progress: Callable[[str], None] = print) -> dict:
    systems = _Systems(cfg)
    results: dict[str, dict] = {}
    for batch in cfg.batches:
        prompts = _prompts(batch, cfg.prompt_len, systems.vocab, cfg.seed + batch)
        mode, other = ("overlap", "sync") if cfg.overlap else ("sync", "overlap")
        runs = {"ours_tok_s": lambda n, p=prompts, b=batch: systems.ours(p, [n] * b, cfg.overlap),
                f"ours_{other}_tok_s": lambda n, p=prompts, b=batch: systems.ours(p, [n] * b, not cfg.overlap),
                "hf_generate_tok_s": lambda n, p=prompts: systems.hf_generate(p, n)}
        if cfg.generate_batch:
            runs["hf_generate_batch_tok_s"] = lambda n, p=prompts: systems.hf_generate_batch(p, n)
        row: dict = _decode_tok_s(runs, batch, cfg.new_tokens, cfg.repeats)
        roof = model_roofline(systems.hf, cfg.prompt_len + cfg.new_tokens // 2, systems.engine.runner.dtype)
        row["roofline_tok_s"] = roof.tok_s(batch)
        row["roofline_onednn_tok_s"] = roof.with_onednn_rate().tok_s(batch)  # stricter: the GEMM kernel we run
        # The rooflines count weight bytes only. Decode attention also reads every stream's KV once a step (fp32,
        # at the mean context of the run): with those bytes at the same copy bandwidth, the memory bound is
        kv_bytes = batch * (cfg.prompt_len + cfg.new_tokens // 2) * systems.engine.runner.info.kv_bytes_per_token
        onednn = roof.with_onednn_rate()
        step_s = max((roof.weight_bytes + kv_bytes) / (roof.copy_gb_s * 1e9),
                     batch * roof.flops_per_token / (onednn.matmul_gflop_s * 1e9))
        row["kv_bytes_per_step"] = kv_bytes
        row["bound_with_kv_tok_s"] = batch / step_s
        row["ours_vs_bound_with_kv"] = row["ours_tok_s"] / row["bound_with_kv_tok_s"]
        row[f"ours_{mode}_tok_s"] = row["ours_tok_s"]
        row["overlap_vs_sync"] = row["ours_overlap_tok_s"] / row["ours_sync_tok_s"]
        row["ours_vs_hf_generate"] = row["ours_tok_s"] / row["hf_generate_tok_s"]
        if "hf_generate_batch_tok_s" in row:
            row["ours_vs_hf_generate_batch"] = row["ours_tok_s"] / row["hf_generate_batch_tok_s"]
        row["ours_vs_roofline"] = row["ours_tok_s"] / row["roofline_tok_s"]
        row["ours_vs_roofline_onednn"] = row["ours_tok_s"] / row["roofline_onednn_tok_s"]
        row["roofline"] = asdict(roof)
        results[str(batch)] = row
        progress(f"batch {batch:>3}: ours {row['ours_tok_s']:8.0f} tok/s ({other} {row[f'ours_{other}_tok_s']:.0f})"
                 f" | HF generate {row['hf_generate_tok_s']:8.0f}"
                 + (f" | HF generate_batch {row['hf_generate_batch_tok_s']:8.0f}" if cfg.generate_batch else "")
                 + f" | roofline {row['roofline_tok_s']:8.0f}")

    profile = None
    if cfg.profile_batch:
        from tokenflow_ray.lab.step_profile import profile_decode_steps

        profile = profile_decode_steps(systems.engine, _prompts(cfg.profile_batch, cfg.prompt_len, systems.vocab,
                                                                cfg.seed + cfg.profile_batch))
        progress(_profile_line(profile))
    mixed = _mixed(cfg, systems)
    progress(f"mixed ({cfg.mixed_requests} requests, {cfg.mixed_min_tokens}-{cfg.mixed_max_tokens} new tokens): "
             f"ours {mixed['mixed_ours_tok_s']:.0f} tok/s | HF generate x{cfg.hf_static_batch} "
             f"{mixed['mixed_hf_generate_tok_s']:.0f} tok/s")
    if cfg.peer == "vllm":
        mixed.update(_vllm_peer(cfg, systems, results, progress))
        mixed["mixed_ours_vs_vllm"] = mixed["mixed_ours_tok_s"] / mixed["mixed_vllm_tok_s"]
    out = {"model": cfg.model, "dtype": cfg.dtype, "device": "cpu", "threads": torch.get_num_threads(),
           "gemm": systems.engine.runner.gemm, "machine": machine_info(), "config": asdict(cfg), "results": results,
           "profile": profile, **mixed}
    headline = str(32 if 32 in cfg.batches else cfg.batches[-1])
    out["batch"] = int(headline)
    out.update({k: v for k, v in results[headline].items() if k != "roofline"})
    return out


def _mixed_workload(cfg: EngineBenchConfig, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(cfg.seed)
    prompts = _prompts(cfg.mixed_requests, cfg.prompt_len, vocab, cfg.seed + 999)
    return prompts, [rng.randint(cfg.mixed_min_tokens, cfg.mixed_max_tokens) for _ in prompts]


def _vllm_peer(cfg: EngineBenchConfig, systems: _Systems, results: dict[str, dict],
               progress: Callable[[str], None]) -> dict:
    """vLLM's offline decode tok/s on the very prompts ours ran (same seeds), in the rows; mixed figures returned."""
    from tokenflow_ray.lab.peer.vllm_engine import run_vllm_offline

    max_batch = max(max(cfg.batches), cfg.mixed_requests)
    prompts = {b: _prompts(b, cfg.prompt_len, systems.vocab, cfg.seed + b) for b in cfg.batches}
    peer = run_vllm_offline(systems.engine.runner.model_dir, prompts, cfg.new_tokens, cfg.repeats,
                            mixed=_mixed_workload(cfg, systems.vocab), threads=torch.get_num_threads(),
                            max_num_batched_tokens=max(2048, max_batch * 4), dtype=cfg.dtype, env_dir=cfg.peer_env)
    for batch in cfg.batches:
        row = results[str(batch)]
        row["vllm_tok_s"] = peer["results"][batch]["vllm_tok_s"]
        row["ours_vs_vllm"] = row["ours_tok_s"] / row["vllm_tok_s"]
        progress(f"batch {batch:>3}: ours {row['ours_tok_s']:8.0f} tok/s | vLLM {row['vllm_tok_s']:8.0f} tok/s "
                 f"({row['ours_vs_vllm']:.2f}x)")
    mixed = {"mixed_vllm_tok_s": peer["mixed_vllm_tok_s"], "vllm_version": peer["vllm_version"],
             "vllm_torch_version": peer["torch_version"], "vllm_threads": peer["threads"]}
    progress(f"mixed: vLLM {mixed['mixed_vllm_tok_s']:.0f} tok/s")
    return mixed


def _mixed(cfg: EngineBenchConfig, systems: _Systems) -> dict:
    prompts, lengths = _mixed_workload(cfg, systems.vocab)
    useful = sum(lengths)

    def hf_static() -> None:
        for i in range(0, len(prompts), cfg.hf_static_batch):  # static batching runs to the longest in each batch
            systems.hf_generate(prompts[i:i + cfg.hf_static_batch], max(lengths[i:i + cfg.hf_static_batch]))

    times: dict[str, list[float]] = {"ours": [], "other": [], "hf": []}
    for _ in range(cfg.repeats):
        times["ours"].append(median_seconds(lambda: systems.ours(prompts, lengths, cfg.overlap), 1, warm=False))
        times["other"].append(median_seconds(lambda: systems.ours(prompts, lengths, not cfg.overlap), 1, warm=False))
        times["hf"].append(median_seconds(hf_static, 1, warm=False))
    ours, other, hf = (statistics.median(times[k]) for k in ("ours", "other", "hf"))
    overlap, sync = (ours, other) if cfg.overlap else (other, ours)
    return {"mixed_ours_tok_s": useful / ours, "mixed_ours_sync_tok_s": useful / sync,
            "mixed_ours_overlap_tok_s": useful / overlap, "mixed_hf_generate_tok_s": useful / hf,
            "mixed_ours_vs_hf_generate": hf / ours, "mixed_useful_tokens": useful}


def machine_info() -> dict:
    """CPU model, cores and cache sizes (lscpu's words): figures differ by box, the L3 above all."""
    import platform
    import subprocess

    info: dict = {"cpu_count": os.cpu_count(), "machine": platform.machine(), **isa_in_use()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return info
    keys = {"Model name": "cpu_model", "L1d cache": "l1d_cache", "L2 cache": "l2_cache", "L3 cache": "l3_cache"}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            info[keys[key.strip()]] = value.strip()
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags:")), "")
    info["avx512"] = "avx512f" in flags.split()
    return info


def isa_in_use() -> dict:
    """What the run's kernels were allowed to use, which may be less than the CPU has: ATen's dispatch level
    (ATEN_CPU_CAPABILITY caps it), oneDNN's cap (ONEDNN_MAX_CPU_ISA, read by both engines' oneDNN) and our kernels'
    build target (TOKENFLOW_KERNEL_MARCH)."""
    from tokenflow_ray.layers.cpu_kernels import kernel_march

    return {"aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL"), "kernel_march": kernel_march()}
