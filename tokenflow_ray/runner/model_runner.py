"""TorchModelRunner: owns the model, the device KV pool and sampling state; turns a StepPlan into a StepResult."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenflow_ray.engine.config import EngineConfig
from tokenflow_ray.engine.plan import StepPlan, StepResult
from tokenflow_ray.engine.runner_api import ModelInfo
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.layers.attention_select import select_backend
from tokenflow_ray.layers.cpu_kernels import build_cpu_kernels
from tokenflow_ray.models.loader import build_model, load_tokenizer, resolve_model
from tokenflow_ray.runner.kv_pool import KVPool
from tokenflow_ray.runner.kv_transfer import KVTransfer
from tokenflow_ray.runner.malloc_tuning import tune_malloc_for_inference
from tokenflow_ray.runner.sampler import sample, sample_on_device
from tokenflow_ray.runner.step_inputs import StepInputs
from tokenflow_ray.runner.step_staging import StagingBuffer
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


@dataclass(frozen=True)
class RunnerOptions:
    """What is decided by the device, overridable for CPU tests of the CUDA path. None: by the device."""

    staged: bool | None = None  # one staged host->device copy a step, sampled tokens kept on the device
    graph_capture: Callable | None = None  # capture decode graphs with this (cuda_graphs.eager_capture on CPU)
    warm_up: bool | None = None  # run the warm-up steps at start


class TorchModelRunner:
    def __init__(self, config: EngineConfig, options: RunnerOptions = RunnerOptions()) -> None:
        """`config` as the engine runs it: its device defaults already resolved (runner/factory.py)."""
        device = resolve_device(config.model.device)
        self.config = config
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
                mc.attention_backend in ("auto", "cpu_paged"):
            build_cpu_kernels()  # two at a time, before the first of them is asked for
        self.gemm = None  # the CPU GEMM kernel the linear layers run, when they were packed for one
        if mc.cpu_prepack and self.device.type == "cpu" and self.dtype == torch.float32:
            self.gemm = self.model.prepack_for_cpu(mc.cpu_gemm)
        max_len = min(mc.max_model_len or hf_config.max_position_embeddings, hf_config.max_position_embeddings)
        self.model.build_rope_tables(max_len, self.device)
        L, kvh, hd = hf_config.num_hidden_layers, self.model.num_kv_heads, self.model.head_dim
        backend_name = mc.attention_backend
        # One block past the engine's pool is scratch: no stream owns it, so padding rows (CUDA graphs, warm-up)
        # may write their KV there.
        self.kv = KVPool(L, cc.num_device_blocks + 1, cc.block_size, kvh, hd, self.dtype, self.device,
                         cc.kv_layout)
        # The compiled CPU kernels (fused ops, the paged decode kernel) read a layer's K/V contiguous.
        self.fused_ops = bool(mc.fused_cpu_ops) and not self.kv.block_major and self.model.use_fused_cpu_ops()
        # A greedy step's tokens from the compiled kernel (float32 CPU logits) rather than argmax + tolist.
        self._argmax_rows = self.model.fused_ops.argmax_rows if self.fused_ops else None
        self.block_size = cc.block_size
        self.backend = select_backend(self.device, cc.block_size, backend_name, self.dtype,
                                      contiguous_layers=not self.kv.block_major)
        name, cuda = self.backend.name, self.device.type == "cuda"
        varlen = name == "triton"
        staged = varlen and (cuda if options.staged is None else options.staged)
        sc = config.scheduler
        self.batch = PersistentBatch(
            sc.max_num_seqs + 8, min(-(-max_len // cc.block_size), cc.num_device_blocks), cc.block_size,
            self.device, torch.int32 if name == "flash" else torch.long, sdpa_mask=name == "sdpa",
            tables_by_row=name == "cpu_paged", varlen=varlen,
            staging=StagingBuffer(10 * sc.max_num_batched_tokens + 3 * (cc.num_device_blocks + 1) + 16,
                                  self.device) if staged else None,
            scratch_block=cc.num_device_blocks if varlen else None)
        self.graphs = None  # CUDA graphs of decode steps, for backends that read lengths and tables from tensors
        self._graph_capture = options.graph_capture
        self._copy_in = None  # flash-attn's graph inputs
        self._graph_tables = 0  # the tables' version the graphs read
        self.host_syncs = 0  # device->host reads of sampled tokens (one a sampling step)
        self.transfer = KVTransfer(self.kv, cc.num_host_blocks, cc.overlap_copies) if cc.num_host_blocks else None
        self.scale = hd ** -0.5
        self.info = ModelInfo(name=mc.model, vocab_size=hf_config.vocab_size, max_model_len=max_len,
                              eos_token_ids=_eos_ids(hf_config, self.tokenizer, self.model_dir),
                              kv_bytes_per_token=self.kv.block_bytes // cc.block_size)
        self._default_gen = torch.Generator(device=self.device).manual_seed(mc.seed)
        self._generators: dict[str, torch.Generator] = {}
        self._params: dict[str, SamplingParams] = {}
        self._not_greedy: set[str] = set()  # streams that sample (temperature > 0): none, and a step is one argmax
        self._restored: dict[str, bytes] = {}  # imported streams' generator states, until first scheduled
        log.info("loaded %s (%s weights, %s, %s, %s attention, %s GEMM, %d KV blocks, %s)",
                 self.model_dir or mc.model, mc.load_format, self.device, self.dtype, self.backend.name,
                 self.gemm or "default", cc.num_device_blocks, self.kv.layout)
        graphs = (cuda or options.graph_capture is not None) and not mc.enforce_eager and name in ("flash", "triton")
        if cuda if options.warm_up is None else options.warm_up:
            self.warm_up(decode_sizes=not graphs)
        if graphs:
            self.capture_graphs()

    # ---- start-up: warm-up and decode graphs -------------------------------------------------------------------
    def warm_up(self, decode_sizes: bool = True) -> None:
        """Warm-up steps (`warmup.py`): every kernel variant a step can take is compiled before the first
        request; decode_sizes: also a decode-only step at each graph-ladder size (when no graph capture does)."""
        from tokenflow_ray.runner.cuda_graphs import ladder
        from tokenflow_ray.runner.warmup import warmup_plans

        t0 = time.perf_counter()
        sc = self.config.scheduler
        plans = warmup_plans(sc.max_num_batched_tokens, self.batch.tables.shape[1] * self.block_size,
                             self.block_size, self.config.cache.num_device_blocks,
                             ladder(sc.max_num_seqs) if decode_sizes else ())
        for plan in plans:
            self.execute(plan)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("warm-up: %d steps in %.2f s", len(plans), time.perf_counter() - t0)

    def capture_graphs(self) -> None:
        """Capture the decode graphs; if capture fails, say so once and run decode steps eagerly."""
        from tokenflow_ray.runner.cuda_graphs import CopyInInputs, DecodeGraphs, ladder
        from tokenflow_ray.runner.varlen_inputs import decode_views

        sizes = ladder(self.config.scheduler.max_num_seqs)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                if self.batch.varlen:
                    inputs = lambda b: decode_views(self.batch, b, self.scale)  # noqa: E731
                else:
                    self._copy_in = CopyInInputs(max(sizes), self.batch.tables.shape[1], self.block_size,
                                                 self.config.cache.num_device_blocks, self.device, self.scale)
                    inputs = self._copy_in.views
                self.graphs = DecodeGraphs(
                    lambda ids, pos, meta: self.model(ids, pos, self.kv.layers, meta, self.backend), sizes, inputs,
                    self._graph_capture)
        except Exception as e:  # noqa: BLE001 - any capture failure leaves a correct eager runner
            self.graphs = None
            log.warning("CUDA graphs: capture failed (%s: %s); decode steps run eagerly", type(e).__name__, e)
            return
        self._graph_tables = self.batch.tables_version
        log.info("CUDA graphs: %d decode sizes captured in %.2f s", len(sizes), time.perf_counter() - t0)

    def init_thread(self) -> None:
        """Called on the engine's runner thread (overlapped scheduling): torch's thread count and CUDA device are
        per thread."""
        torch.set_num_threads(self._num_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

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
        if self.batch.varlen:
            step, hidden = self._varlen_step(plan)
        else:
            step = self.batch.inputs(plan, self.scale)
            hidden = None
            if self.graphs is not None:
                from tokenflow_ray.runner.cuda_graphs import run_copied_in

                hidden = run_copied_in(self.graphs, self._copy_in, step.input_ids, step.positions, step.meta)
            if hidden is None:  # prefill or mixed steps, batches past the largest graph, and CPU
                hidden = self.model(step.input_ids, step.positions, self.kv.layers, step.meta, self.backend)
        if not step.sample_rows:
            return {}
        rows = step.sample_rows
        if step.sample_index is not None:
            h = hidden.index_select(0, step.sample_index)
        elif len(rows) == hidden.shape[0] or self.batch.varlen:  # every row samples (varlen: the first rows)
            h = hidden[:len(rows)]
        else:
            h = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(h)
        not_greedy = self._not_greedy
        random_rows = [(row, self._params[s], self._generators.get(s, self._default_gen))
                       for row, s in enumerate(step.sample_ids) if s in not_greedy] if not_greedy else ()
        if self.batch.staging is not None:  # tokens stay on the device; the host reads them once
            tokens_dev = sample_on_device(logits, random_rows)
            self.batch.record_sampled(tokens_dev, step)
            self.host_syncs += 1
            tokens = tokens_dev.tolist()
        else:
            tokens = sample(logits, random_rows, self._argmax_rows)
        sampled = dict(zip(step.sample_ids, tokens))
        self.batch.last_sampled.update(sampled)
        return sampled

    def _varlen_step(self, plan: StepPlan) -> tuple[StepInputs, torch.Tensor]:
        """A decode-only step within the graph ladder replays its graph on inputs staged straight into the graph's
        buffers; any other step runs eagerly."""
        bucket = None
        if self.graphs is not None and not plan.prefills:
            if self.batch.tables_version != self._graph_tables:  # the tables grew: the graphs read the old ones
                log.info("CUDA graphs: block tables grew; capturing again")
                self.capture_graphs()
            bucket = self.graphs.padded_size(len(plan.decodes)) if self.graphs is not None else None
        step = self.batch.inputs(plan, self.scale, pad_to=bucket)
        if bucket is not None:
            return step, self.graphs.replay(bucket)
        return step, self.model(step.input_ids, step.positions, self.kv.layers, step.meta, self.backend)


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
