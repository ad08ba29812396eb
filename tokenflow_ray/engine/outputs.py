"""What the engine hands back per stream per step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamOutput:
    stream_id: str
    token_ids: tuple[int, ...]  # new this step
    text: str  # new text this step (may be empty while a character or a possible stop string is incomplete)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative


@dataclass(frozen=True)
class GenerationResult:
    stream_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
