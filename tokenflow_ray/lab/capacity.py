"""Measured decode capacity Γ: the engine's decode tokens/s at the batch a bench's KV pool allows.

The load of a streaming workload is Σ declared reader rates against what the engine can decode. In the benches'
regime (serving-paper.md §5: the device pool holds a fraction of the burst at full length) the running batch is
limited by memory, not by `max_num_seqs`: at most `pool_blocks // blocks(mean prompt + mean output)` streams hold
the device at once. Γ is the decode throughput of exactly that batch, measured with the real engine at the
bench's own config (model, torch threads, block size, device and host pool, step budget) through its public API:
`build_engine`, `add_request`, `step`.

How (`measure_decode_capacity`):
1. Start `batch` unpaced streams (rate 0: nothing is paced, every step decodes every stream).
2. Step until every stream has its first token (chunked prefill), then `warmup_steps` more decode steps.
3. Time `decode_steps` steps in which every stream decodes, in three consecutive windows; each window's figure
   is tokens / wall seconds, all engine overhead in (scheduling, write-through copies to the host store,
   sampling), since the bench pays those too. Γ is the fastest window: on a shared box other processes only ever
   slow a window down, so the fastest is the least disturbed estimate of what the engine can do (at the default
   96 steps each window spans two blocks' worth of steps, so periodic costs are in every one). All three, the
   overall figure and the median-step figure are recorded, so the spread (the machine's noise) is visible.
The prompts are longer than the workload's mean prompt by about (mean output - decode_steps) / 2 tokens, so the
timed window is centred on a stream's mean context over its life (mean prompt + mean output / 2): attention cost grows
with the context, and timing the first few decode steps after a short prompt would overstate the capacity. The
total (prompt + all generated tokens) stays within the mean full length, so the batch fits the pool without
preemption under any policy. About 2-3 s to load the model plus a few seconds of steps on a 2-core box.

Γ is the engine's in-process capacity. A workload adds prefill work and (under pressure) preemption copies, and a
served engine also pays the HTTP path, so what a bench delivers at load 1.0 is below Γ (about 75-80% for the
policy bench's default burst here, in-process).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.runner.factory import build_engine


@dataclass(frozen=True)
class CapacityConfig:
    """The bench's engine config plus the workload's mean lengths, and how long to time."""

    num_device_blocks: int  # the bench's device KV pool
    mean_prompt_len: int  # the workload's mean prompt tokens
    mean_output_len: int  # the workload's mean output tokens
    num_host_blocks: int = 0  # the bench's host spill store (write-through runs as it would in the bench)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    model: str = "embedded"
    num_threads: int | None = 1  # torch intra-op threads, as the bench sets them
    decode_steps: int = 96  # timed steps (fewer if the mean output is short: see timed_steps)
    warmup_steps: int = 8  # decode steps after prefill, not timed (first-call kernel work)
    policy: str = "fcfs"  # irrelevant to the figure: the batch fits, so no policy preempts
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_device_blocks", "mean_prompt_len", "mean_output_len", "block_size", "max_num_seqs",
                     "max_num_batched_tokens", "decode_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.warmup_steps < 0 or self.num_host_blocks < 0:
            raise ValueError("warmup_steps and num_host_blocks: must be >= 0")
        if self.batch < 1:
            raise ValueError(f"num_device_blocks: {self.num_device_blocks} blocks of {self.block_size} cannot hold "
                             f"one stream at the mean full length ({self.full_len} tokens)")
        if self.timed_steps < 1:
            raise ValueError(f"mean_output_len={self.mean_output_len} leaves no timed step after prefill "
                             f"({self.prefill_steps_max} steps) and warmup_steps={self.warmup_steps}")

    @property
    def full_len(self) -> int:
        return self.mean_prompt_len + self.mean_output_len

    @property
    def batch(self) -> int:
        """Streams that fit the pool at the mean full length (capped by max_num_seqs)."""
        per_stream = -(-self.full_len // self.block_size)
        return min(self.max_num_seqs, self.num_device_blocks // per_stream)

    @property
    def prefill_steps_max(self) -> int:
        """Steps the batch's chunked prefill can take: the first stream decodes while the last one prefills, so
        its output runs ahead of the others' by up to this many tokens."""
        return -(-self.batch * self.full_len // self.max_num_batched_tokens) + 1

    @property
    def timed_steps(self) -> int:
        return min(self.decode_steps, self.mean_output_len - self.prefill_steps_max - self.warmup_steps)

    @property
    def max_tokens(self) -> int:
        """Per stream: enough for prefill lead + warm-up + timed steps, so no stream finishes inside the window."""
        return self.prefill_steps_max + self.warmup_steps + self.timed_steps

    @property
    def calib_prompt_len(self) -> int:
        """Centres the timed window on the mean context over a stream's life (mean prompt + mean output / 2),
        keeping prompt + every generated token within the mean full length (so the batch fits the pool)."""
        centred = self.mean_prompt_len + self.mean_output_len // 2 - self.warmup_steps - 1 - self.timed_steps // 2
        return max(1, min(centred, self.full_len - self.max_tokens))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype="float32", num_threads=self.num_threads),
            cache=CacheConfig(block_size=self.block_size, num_device_blocks=self.num_device_blocks,
                              num_host_blocks=self.num_host_blocks),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens, policy=self.policy),
            record_history=self.batch)


@dataclass(frozen=True)
class Capacity:
    """Γ and how it was measured (all of it goes into the benches' JSON)."""

    tok_s: float  # Γ: decode tokens / wall seconds in the fastest of the three timed windows
    overall_tok_s: float  # the same over all timed steps
    median_step_tok_s: float  # batch / median step time
    batch: int
    timed_steps: int
    context_mean: float  # mean context length (tokens) over the timed steps
    step_s_p50: float
    window_tok_s: tuple[float, ...]  # the timed steps in thirds: their spread is the machine's noise
    wall_s: float  # the whole calibration, model load included
    config: CapacityConfig
    method: str = ("decode tok/s of `batch` unpaced streams (the device pool's capacity at the workload's mean full "
                   "length), real engine at the bench's config, timed over `timed_steps` steps centred on the mean "
                   "context after prefill and warm-up; tok_s is the fastest third of those steps")

    def to_dict(self) -> dict:
        return asdict(self)


EngineFactory = Callable[[EngineConfig], LLMEngine]


def measure_decode_capacity(cfg: CapacityConfig, engine_factory: EngineFactory = build_engine,
                            progress: Callable[[str], None] | None = print) -> Capacity:
    """Γ for `cfg` (see the module docstring). `engine_factory` lets tests pass an engine with a fake runner."""
    start = time.perf_counter()
    engine = engine_factory(cfg.engine_config())
    try:
        vocab = engine.runner.info.vocab_size
        rng = random.Random(cfg.seed)
        sampling = SamplingParams(max_tokens=cfg.max_tokens, ignore_eos=True)
        ids = [engine.add_request([rng.randrange(vocab) for _ in range(cfg.calib_prompt_len)], sampling,
                                  stream_id=f"calib-{i}", rate=0.0) for i in range(cfg.batch)]
        first = set()
        while len(first) < len(ids):  # prefill (chunked); the step that samples a first token is not timed
            first.update(o.stream_id for o in engine.step() if o.token_ids)
        for _ in range(cfg.warmup_steps):
            engine.step()
        step_s: list[float] = []
        tokens = 0
        for _ in range(cfg.timed_steps):
            t0 = time.perf_counter()
            out = engine.step()
            step_s.append(time.perf_counter() - t0)
            decoded = sum(len(o.token_ids) for o in out)
            if decoded != cfg.batch:  # a policy held a stream back: the figure would not be the pool's capacity
                raise RuntimeError(f"calibration: {decoded} of {cfg.batch} streams decoded in a timed step")
            tokens += decoded
    finally:
        transfer = getattr(engine.runner, "transfer", None)
        if transfer is not None:
            transfer.close()
    elapsed = sum(step_s)
    context_start = cfg.calib_prompt_len + 1 + cfg.warmup_steps  # tokens a stream holds at the first timed step
    thirds = [step_s[i * len(step_s) // 3:(i + 1) * len(step_s) // 3] for i in range(3)]
    windows = tuple(cfg.batch * len(w) / sum(w) for w in thirds if w)
    cap = Capacity(tok_s=max(windows), overall_tok_s=tokens / elapsed,
                   median_step_tok_s=cfg.batch / statistics.median(step_s), batch=cfg.batch,
                   timed_steps=cfg.timed_steps, context_mean=context_start + (cfg.timed_steps - 1) / 2,
                   step_s_p50=statistics.median(step_s),
                   window_tok_s=windows,
                   wall_s=time.perf_counter() - start, config=cfg)
    if progress is not None:
        spread = "/".join(f"{w:.0f}" for w in cap.window_tok_s)
        progress(f"decode capacity Γ = {cap.tok_s:.0f} tok/s ({cap.batch} streams x {cap.timed_steps} steps at "
                 f"~{cap.context_mean:.0f} tokens of context, step p50 {cap.step_s_p50 * 1e3:.1f} ms, thirds "
                 f"{spread}, overall {cap.overall_tok_s:.0f}; calibration {cap.wall_s:.1f} s)")
    return cap
