"""tokenflow_ray: streaming LLM serving under bursts, and a dual-codebook image tokenizer, on Ray.

    from tokenflow_ray import LLM, SamplingParams

Both are imported on first use: `import tokenflow_ray` loads no torch, and the pure parts (engine, cluster, sim)
never do.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tokenflow_ray.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenflow_ray.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tokenflow_ray' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
