"""TorchModelRunner: owns the model, the device KV pool and sampling state; turns a StepPlan into a StepResult."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from tokenflow_ray.engine.config import CacheConfig, EngineConfig
from tokenflow_ray.engine.plan import StepPlan, StepResult
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.models.loader import build_model, load_tokenizer, resolve_model
from tokenflow_ray.runner.attention import flash_attn_available, select_backend
from tokenflow_ray.runner.cpu_kernels import build_cpu_kernels
from tokenflow_ray.runner.kv_transfer import KVTransfer
from tokenflow_ray.runner.malloc_tuning import tune_malloc_for_inference
from tokenflow_ray.runner.sampler import sample
from tokenflow_ray.runner.step_state import PersistentBatch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but no CUDA device is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


FLASH_BLOCK_SIZE = 256  # flash-attn 2's paged KV kernel wants block sizes in multiples of this
DEFAULT_BLOCK_SIZE = CacheConfig().block_size


def gpu_cache_defaults(config: EngineConfig, cuda: bool, flash: bool) -> EngineConfig:
    """On CUDA with flash-attn importable and the attention backend on auto, the default block size becomes one
    flash-attn's paged kernel takes, with the pool's token capacity kept: flash-attn (and the decode CUDA graphs it
    allows) is then what a default config runs. A block size set by hand is left alone (SDPA then, as before)."""
    cc = config.cache
    if not (cuda and flash and config.model.attention_backend == "auto" and cc.block_size == DEFAULT_BLOCK_SIZE):
        return config
    blocks = max(1, cc.num_device_blocks * cc.block_size // FLASH_BLOCK_SIZE)
    host = -(-cc.num_host_blocks * cc.block_size // FLASH_BLOCK_SIZE)
    log.info("CUDA + flash-attn: block_size %d -> %d (%d device blocks)", cc.block_size, FLASH_BLOCK_SIZE, blocks)
    return replace(config, cache=replace(cc, block_size=FLASH_BLOCK_SIZE, num_device_blocks=blocks,
                                         num_host_blocks=host))


class TorchModelRunner:
    def __init__(self, config: EngineConfig, attention_backend: str | None = None) -> None:
        device = resolve_device(config.model.device)
        if attention_backend is None:
            config = gpu_cache_defaults(config, device.type == "cuda", flash_attn_available())
        self.config = config  # the engine builds its scheduler from this one (the block size may differ)
        mc, cc = config.model, config.cache
        if mc.num_threads is not None:
            torch.set_num_threads(mc.num_threads)
        self._num_threads = torch.get_num_threads()
        self.device = device
        if device.type == "cpu":
            tune_malloc_for_inference()  # a step's activations from the heap, not re-faulted mmaps
        self.dtype = resolve_dtype(mc.dtype, self.device)
        source = resolve_model(mc.model, mc.load_format)
        self.model_dir = source.weights_dir  # None: a built-in config (no checkpoint; dummy weights)
        hf_config = source.hf_config
        self.tokenizer = load_tokenizer(source.tokenizer_dir)
        self.model = build_model(source, self.device, self.dtype, mc.load_format, mc.seed)
        if self.device.type == "cpu" and self.dtype == torch.float32 and mc.fused_cpu_ops and \
                (attention_backend or mc.attention_backend) in ("auto", "cpu_paged"):
            build_cpu_kernels()  # two at a time, before the first of them is asked for
        self.gemm = None  # the CPU GEMM kernel the linear layers run, when they were packed for one
        if mc.cpu_prepack and self.device.type == "cpu" and self.dtype == torch.float32:
            self.gemm = self.model.prepack_for_cpu(mc.cpu_gemm)
        max_len = min(mc.max_model_len or hf_config.max_position_embeddings, hf_config.max_position_embeddings)
        self.model.build_rope_tables(max_len, self.device)
        self.fused_ops = bool(mc.fused_cpu_ops) and self.model.use_fused_cpu_ops()
        # A greedy step's tokens from the compiled kernel (float32 CPU logits) rather than argmax + tolist.
        self._argmax_rows = self.model.fused_ops.argmax_rows if self.fused_ops else None
        self.block_size = cc.block_size
        L, kvh, hd = hf_config.num_hidden_layers, self.model.num_kv_heads, self.model.head_dim
        # One tensor for the whole pool: [layers, K/V, blocks, block_size, kv_heads, head_dim]. A block's KV for
        # every layer is one index away, which is what host spill copies want.
        self.backend = select_backend(self.device, cc.block_size, attention_backend or mc.attention_backend,
                                      self.dtype)
        # CUDA graphs for decode steps (flash-attn reads lengths and tables from tensors, so it can be captured);
        # their padding rows write into one extra pool block that no stream owns.
        use_graphs = self.device.type == "cuda" and self.backend.name == "flash"
        self.kv_cache = torch.zeros((L, 2, cc.num_device_blocks + use_graphs, cc.block_size, kvh, hd),
                                    dtype=self.dtype, device=self.device)
        self.batch = PersistentBatch(config.scheduler.max_num_seqs + 8,
                                     min(-(-max_len // cc.block_size), cc.num_device_blocks), cc.block_size,
                                     self.device, torch.int32 if self.backend.name == "flash" else torch.long,
                                     sdpa_mask=self.backend.name == "sdpa",
                                     tables_by_row=self.backend.name == "cpu_paged")
        self.graphs = None
        if use_graphs:
            from tokenflow_ray.runner.cuda_graphs import DEFAULT_SIZES, DecodeGraphs

            sizes = [b for b in DEFAULT_SIZES if b < config.scheduler.max_num_seqs] + [config.scheduler.max_num_seqs]
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    lambda ids, pos, meta: self.model(ids, pos, self.kv_cache, meta, self.backend), sizes,
                    self.batch.tables.shape[1], cc.block_size, scratch_block=cc.num_device_blocks,
                    device=self.device, scale=hd ** -0.5)
        self.transfer = KVTransfer(self.kv_cache, cc.num_host_blocks, cc.overlap_copies) if cc.num_host_blocks else None
        self.scale = hd ** -0.5
        self.info = ModelInfo(name=mc.model, vocab_size=hf_config.vocab_size, max_model_len=max_len,
                              eos_token_ids=_eos_ids(hf_config, self.tokenizer, self.model_dir),
                              kv_bytes_per_token=L * 2 * kvh * hd * self.kv_cache.element_size())
        self._default_gen = torch.Generator(device=self.device).manual_seed(mc.seed)
        self._generators: dict[str, torch.Generator] = {}
        self._params: dict[str, SamplingParams] = {}
        self._not_greedy: set[str] = set()  # streams that sample (temperature > 0): none, and a step is one argmax
        self._restored: dict[str, bytes] = {}  # imported streams' generator states, until first scheduled
        log.info("loaded %s (%s weights, %s, %s, %s attention, %s GEMM, %d KV blocks)", self.model_dir or mc.model,
                 mc.load_format, self.device, self.dtype, self.backend.name, self.gemm or "default",
                 cc.num_device_blocks)

    def init_thread(self) -> None:
        """Called on the engine's runner thread (overlapped scheduling): torch's thread count is per thread."""
        torch.set_num_threads(self._num_threads)

    # ---- migration (between steps, on the engine's thread) ----------------------------------------------------
    def export_kv(self, host_blocks: list[int]):
        return self._transfer_or_raise().read_host_blocks(host_blocks)

    def import_kv(self, host_blocks: list[int], data) -> None:
        self._transfer_or_raise().write_host_blocks(host_blocks, data)

    def export_sampler(self, stream_id: str) -> bytes | None:
        gen = self._generators.get(stream_id)
        return None if gen is None else gen.get_state().numpy().tobytes()

    def import_sampler(self, stream_id: str, state: bytes) -> None:
        self._restored[stream_id] = state

    def _transfer_or_raise(self) -> KVTransfer:
        if self.transfer is None:
            raise ValueError("KV migration needs a host spill store (num_host_blocks > 0)")
        return self.transfer

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for sid in plan.finished:
            self._generators.pop(sid, None)
            self._params.pop(sid, None)
            self._not_greedy.discard(sid)
        for sid, params in plan.new_streams:
            self._params[sid] = params
            if not params.greedy:
                self._not_greedy.add(sid)
            restored = self._restored.pop(sid, None)
            if restored is not None:  # a migrated stream continues its generator where it left off
                self._generators[sid] = torch.Generator(device=self.device)
                self._generators[sid].set_state(torch.frombuffer(bytearray(restored), dtype=torch.uint8))
            elif params.seed is not None:  # a seeded stream samples the same tokens whatever else is batched
                self._generators[sid] = torch.Generator(device=self.device).manual_seed(params.seed)
        self.batch.apply(plan)
        copies = self.transfer.launch(plan) if plan.has_copies and self.transfer is not None else None
        sampled = self._forward(plan) if plan.decodes or plan.prefills else {}
        compute_s = time.perf_counter() - t0
        if copies is None:
            return StepResult(step_id=plan.step_id, sampled=sampled, compute_s=compute_s, step_s=compute_s)
        timing = KVTransfer.wait(copies)  # copies planned in a step are complete when its result is read
        return StepResult(step_id=plan.step_id, sampled=sampled, compute_s=compute_s, copy_s=timing.copy_s,
                          copy_bytes=timing.num_blocks * self.transfer.block_bytes,
                          swap_out_s={sid: max(0.0, done - t0) for sid, done in timing.swap_out_done.items()},
                          step_s=time.perf_counter() - t0)

    def _forward(self, plan: StepPlan) -> dict[str, int]:
        step = self.batch.inputs(plan, self.scale)
        hidden = self.graphs.run(step.input_ids, step.positions, step.meta) if self.graphs is not None else None
        if hidden is None:  # prefill or mixed steps, batches past the largest graph, and CPU
            hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta, self.backend)
        sampled: dict[str, int] = {}
        if step.sample_rows:
            rows = step.sample_rows
            # A decode-only step samples every row: no gather of the hidden states.
            h = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=self.device)]
            logits = self.model.compute_logits(h)
            not_greedy = self._not_greedy
            random_rows = [(row, self._params[s], self._generators.get(s, self._default_gen))
                           for row, s in enumerate(step.sample_ids) if s in not_greedy] if not_greedy else ()
            tokens = sample(logits, random_rows, self._argmax_rows)
            sampled = dict(zip(step.sample_ids, tokens))
            self.batch.last_sampled.update(sampled)
        return sampled


def _eos_ids(hf_config, tokenizer, model_dir) -> frozenset[int]:
    ids: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    try:
        from transformers import GenerationConfig

        if model_dir is not None:
            candidates.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except OSError:
        pass  # no generation_config.json
    for c in candidates:
        if isinstance(c, int):
            ids.add(c)
        elif isinstance(c, (list, tuple)):
            ids.update(int(x) for x in c)
    return frozenset(ids)
