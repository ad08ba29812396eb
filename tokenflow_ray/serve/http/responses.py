"""OpenAI response and SSE chunk bodies as dicts (see protocol.py for why not pydantic)."""

from __future__ import annotations

import json
from typing import Any

from tokenflow_ray.cluster.messages import Delta

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage(d: Delta) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens prefix caching served."""
    return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": d.num_output_tokens,
            "total_tokens": d.num_prompt_tokens + d.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": d.num_cached_tokens}}


def _finish(d: Delta) -> str | None:
    return None if not d.finished else ("length" if d.finish_reason == "length" else "stop")


class ChunkWriter:
    """Builds the SSE events of one stream for /v1/completions (chat=False) or /v1/chat/completions."""

    def __init__(self, stream_id: str, model: str, created: int, chat: bool, include_usage: bool,
                 continuous_usage: bool) -> None:
        self.base = {"id": stream_id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}
        self.chat, self.include_usage, self.continuous = chat, include_usage, continuous_usage
        self._role_sent = False

    def chunk(self, d: Delta) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"content": d.text}
            if not self._role_sent:
                delta["role"] = "assistant"
                self._role_sent = True
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": _finish(d)}
        else:
            choice = {"index": 0, "text": d.text, "logprobs": None, "finish_reason": _finish(d)}
        body = {**self.base, "choices": [choice]}
        if self.continuous:
            body["usage"] = usage(d)
        elif self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last when include_usage is set
        return sse(body)

    def final(self, last: Delta) -> bytes:
        tail = sse({**self.base, "choices": [], "usage": usage(last)}) if self.include_usage else b""
        return tail + DONE


def full_response(stream_id: str, model: str, created: int, chat: bool, text: str, last: Delta) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": _finish(last)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(last)}
    return {"id": stream_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(last)}
