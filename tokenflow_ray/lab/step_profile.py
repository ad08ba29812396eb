"""Where one decode step's time goes, on the real engine: `tokenflow bench engine` puts this in its JSON.

Wall-clock timers around the scheduler's plan, the runner's execute, the model forward and the lm_head split a step
into the scheduler, the runner's own Python (inputs, sampling), the model (the forward and the lm_head GEMM, which
the runner calls apart from the forward: `lm_head_ms` of it), and the engine's rest (applying the result,
detokenising, outputs); a cProfile pass over the same steps splits the model into GEMMs (oneDNN linear), decode
attention (the paged kernel, or SDPA) and everything else (small ops, module calls); the compiled decode kernel's
time is taken by wall clock in the plain pass instead (cProfile added about a tenth to it). Python bookkeeping is
schedule + runner Python + engine rest. Measured synchronously (the parts are separable then); the same steps with
overlapped scheduling give the step time that remains when planning and applying run beside the model.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import pstats
import time
from collections.abc import Iterator, Sequence

from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.sampling import SamplingParams

_GEMM = ("_linear_pointwise", "linear", "addmm", "matmul")
_ATTENTION = ("paged_decode_attention", "scaled_dot_product_attention", "flash_attn")


@contextlib.contextmanager
def _timed(obj, name: str, acc: dict[str, float], key: str) -> Iterator[None]:
    original = getattr(obj, name)
    shadowed = name in vars(obj)  # already an instance attribute: put it back, do not delete it

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        if shadowed:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def _kernel_timers(kernel, acc: dict[str, float]) -> Iterator[None]:
    """Wall time inside the compiled decode-attention kernel's calls (6 a step), into acc["attention"].

    Under cProfile that kernel read 1.35-1.40 ms a batch-32 step where its calls took 1.19-1.30 ms by wall clock
    over the same contexts: the profiler's hooks slow what runs around the kernel's parallel section too. None
    (another backend): nothing to time here."""
    if kernel is None:
        yield
        return
    with _timed(kernel, "paged_decode_attention_rows", acc, "attention"), \
            _timed(kernel, "paged_decode_attention", acc, "attention"):
        yield


def _steps(engine: LLMEngine, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        engine.step()
    return time.perf_counter() - t


def profile_decode_steps(engine: LLMEngine, prompts: Sequence[Sequence[int]], steps: int = 100,
                         warmup: int = 10) -> dict:
    """ms per step at batch len(prompts), every stream decoding; the streams are aborted afterwards."""
    config = engine.config
    # Three passes of `steps` decodes must fit each stream's share of the pool and the context.
    bs, longest = engine.pool.block_size, max(len(p) for p in prompts)
    room = min(engine.max_total_tokens, engine.pool.num_free // len(prompts) * bs) - longest - 2
    chunks = 3 * -(-steps // 20)  # the untimed steps between passes
    steps = max(1, min(steps, (room - 2 * warmup - chunks) // 3))
    warmup = min(warmup, max(0, room - 3 * steps - chunks) // 2)
    engine.config = dataclasses.replace(config, overlap_scheduling=False)
    sp = SamplingParams(max_tokens=2 * warmup + 3 * steps + chunks + 1, ignore_eos=True)
    ids = [engine.add_request(list(p), sp) for p in prompts]
    try:
        while any(engine.get_stream(i).num_output_tokens == 0 for i in ids):  # prefills out of the way
            engine.step()
        _steps(engine, warmup)
        acc = {"schedule": 0.0, "execute": 0.0, "model": 0.0, "lm_head": 0.0, "attention": 0.0}
        runner = engine.runner
        kernel = getattr(runner.backend, "_kernel", None)  # the compiled CPU decode kernel, when that backend runs
        prof = cProfile.Profile()
        wall = profiled = overlapped = 0.0
        # The three passes take turns in chunks, so each sees the same contexts (attention grows with them).
        chunk = max(1, min(20, steps))
        for done in range(0, steps, chunk):
            n = min(chunk, steps - done)
            engine.config = dataclasses.replace(config, overlap_scheduling=False)
            with _timed(engine.scheduler, "schedule", acc, "schedule"), _timed(runner, "execute", acc, "execute"), \
                    _timed(runner.model, "forward", acc, "model"), \
                    _timed(runner.model, "compute_logits", acc, "lm_head"), _kernel_timers(kernel, acc):
                wall += _steps(engine, n)
            prof.enable()
            profiled += _steps(engine, n)
            prof.disable()
            engine.config = dataclasses.replace(config, overlap_scheduling=True)
            engine.step()  # the runner thread starts and the pipeline fills outside the timed steps
            overlapped += _steps(engine, n)
            engine.config = dataclasses.replace(config, overlap_scheduling=False)
            _steps(engine, 2)  # untimed: the in-flight step is finished and the runner thread ended
        gemm = attention = 0.0
        for (_, _, func), row in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
            if any(k in func for k in _GEMM):
                gemm += row[2]
            elif any(k in func for k in _ATTENTION):
                attention += row[2]
    finally:
        engine.config = config
        for i in ids:
            engine.abort(i)
        while engine.has_unfinished():  # drain an in-flight step and the abort notices
            engine.step()
    ms = 1e3 / steps
    model = (acc["model"] + acc["lm_head"]) * ms
    out = {"batch": len(prompts), "steps": steps, "step_ms": wall * ms, "schedule_ms": acc["schedule"] * ms,
           "runner_python_ms": (acc["execute"] - acc["model"] - acc["lm_head"]) * ms, "model_ms": model,
           "lm_head_ms": acc["lm_head"] * ms,
           "engine_rest_ms": (wall - acc["schedule"] - acc["execute"]) * ms,
           # From the cProfile pass: time inside the GEMM and attention kernels themselves; the compiled decode
           # kernel's by wall clock in the plain pass instead, where it has one (see `_kernel_timers`).
           "gemm_ms": gemm * ms, "attention_ms": (acc["attention"] if kernel is not None else attention) * ms,
           "attention_ms_under_cprofile": attention * ms,
           "step_ms_under_cprofile": profiled * ms, "step_ms_overlapped": overlapped * ms}
    out["other_model_ms"] = max(0.0, model - out["gemm_ms"] - out["attention_ms"])
    out["python_bookkeeping_ms"] = out["schedule_ms"] + out["runner_python_ms"] + out["engine_rest_ms"]
    out["tok_s"] = len(prompts) / (out["step_ms"] / 1e3)
    out["tok_s_overlapped"] = len(prompts) / (out["step_ms_overlapped"] / 1e3)
    return out
