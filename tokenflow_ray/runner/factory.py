"""build_engine: an LLMEngine over the torch runner, its device defaults resolved first (device_defaults.py).

Above both the engine (pure Python, handed its runner) and the runner (torch): the one place they are put together.
"""

from __future__ import annotations

from tokenflow_ray.engine.clock import Clock
from tokenflow_ray.engine.config import EngineConfig
from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.runner.device_defaults import local_device_facts, resolve_device_defaults
from tokenflow_ray.runner.model_runner import RunnerOptions, TorchModelRunner


def build_engine(config: EngineConfig | None = None, clock: Clock | None = None,
                 options: RunnerOptions | None = None) -> LLMEngine:
    config = config or EngineConfig()
    config = resolve_device_defaults(config, local_device_facts(config.model.device))
    runner = TorchModelRunner(config, options or RunnerOptions())
    return LLMEngine(config, runner, runner.tokenizer, clock)
