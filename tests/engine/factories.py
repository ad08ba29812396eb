"""Factories for CPU engine tests: a scheduler/engine over the fake runner with a small KV pool.

`LATE_COPIES` is the fake runner's copy landing when a test does not choose one: tests/engine/conftest.py runs
every test of a module that builds fake engines twice, with copies landing before the step's writes and after
them (as a GPU's side streams land them: `FakeRunner(late_copies=True)`).
"""

from __future__ import annotations

from tokenflow_ray.engine.clock import VirtualClock
from tokenflow_ray.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenflow_ray.engine.fake_runner import FakeRunner
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.policies import AndesConfig, TokenFlowConfig

LATE_COPIES = False  # set per test by the `copy_landing` fixture (conftest.py)


def make_fake_engine(num_blocks: int = 64, block_size: int = 8, max_num_seqs: int = 16,
                     max_num_batched_tokens: int = 64, chunked_prefill: bool = True, policy: str = "fcfs",
                     eos_token_id: int | None = None, max_model_len: int = 4096, num_host_blocks: int = 0,
                     write_through: bool = True, tokenflow: TokenFlowConfig | None = None,
                     andes: AndesConfig | None = None, resume_mode: str = "auto",
                     write_budget_fraction: float = 0.8,
                     late_copies: bool | None = None, prefix_caching: bool = False,
                     overlap: bool | None = None) -> tuple[LLMEngine, FakeRunner]:
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_device_blocks=num_blocks, num_host_blocks=num_host_blocks,
                          write_through=write_through, resume_mode=resume_mode,
                          write_budget_fraction=write_budget_fraction, enable_prefix_caching=prefix_caching),
        overlap_scheduling=overlap,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  chunked_prefill=chunked_prefill, policy=policy,
                                  tokenflow=tokenflow or TokenFlowConfig(), andes=andes or AndesConfig()))
    runner = FakeRunner(num_blocks, block_size, eos_token_id=eos_token_id, max_model_len=max_model_len,
                        num_host_blocks=num_host_blocks, late_copies=LATE_COPIES if late_copies is None else late_copies)
    return LLMEngine(config, runner, tokenizer=None, clock=VirtualClock()), runner


def run_to_completion(engine: LLMEngine, max_steps: int = 100_000,
                      tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Step until idle, checking block integrity after every step; returns tokens per stream (added to `tokens`)."""
    tokens = {} if tokens is None else tokens
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
        engine.check_integrity()
        engine.clock.advance(0.01)
    raise AssertionError("engine did not finish")


def step_engine(engine: LLMEngine, n: int = 1, tokens: dict[str, list[int]] | None = None) -> list:
    """n steps of the fake runner's time each, integrity checked after every one; returns the plans run. `tokens`
    collects each stream's tokens."""
    plans: list = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: plans.append(plan) or execute(plan)
    try:
        for _ in range(n):
            for out in engine.step():
                if tokens is not None:
                    tokens.setdefault(out.stream_id, []).extend(out.token_ids)
            engine.check_integrity()
            engine.clock.advance(engine.runner.step_cost_s)
    finally:
        engine.runner.execute = execute
    return plans
