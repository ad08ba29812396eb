"""LLM: the engine behind the call nano-vllm and vLLM give (example.py at the repository root).

    from tokenflow_ray import LLM, SamplingParams

    llm = LLM(model="embedded")  # engine options by name: LLM(model=..., dtype="float32", max_num_seqs=8, ...)
    for result in llm.generate(["Once upon a time"], SamplingParams(max_tokens=32)):
        print(result.text)

Options go to the config that declares them (EngineConfig.with_options); the device defaults are resolved once,
where the engine is built (runner/factory.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tokenflow_ray.engine.config import EMBEDDED_MODEL, EngineConfig
from tokenflow_ray.engine.outputs import GenerationResult, StreamOutput
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.runner.factory import build_engine


class LLM:
    def __init__(self, model: str = EMBEDDED_MODEL, **options: Any) -> None:
        self.engine = build_engine(EngineConfig().with_options(model=model, **options))

    def generate(self, prompts: str | Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Every prompt (text, or token ids) to its end, batched by the engine; results in the prompts' order."""
        return self.engine.generate([prompts] if isinstance(prompts, str) else list(prompts), sampling)

    def stream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None) -> Iterator[StreamOutput]:
        """One prompt's outputs as they are generated (each with the text it adds)."""
        return self.engine.stream(prompt, sampling)
