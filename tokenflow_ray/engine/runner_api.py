"""What the engine needs from a model runner and a tokenizer. The torch runner and the fake runner both fit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenflow_ray.engine.plan import StepPlan, StepResult


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    kv_bytes_per_token: int  # all layers, K and V: what one token's KV costs in the device pool


class ModelRunner(Protocol):
    info: ModelInfo

    def execute(self, plan: StepPlan) -> StepResult: ...


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...
    def __len__(self) -> int: ...


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer.encode(prompt, add_special_tokens=True))
