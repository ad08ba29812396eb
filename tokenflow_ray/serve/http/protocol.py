"""OpenAI request models (plus the `consumption_rate` extension) and OpenAI-shaped errors (docs/design.md §7).

Responses are plain dicts built in `responses.py`: a pydantic model per SSE chunk costs more than the chunk's
transport, and the bench holds the HTTP path to 0.85x of in-process throughput.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tokenflow_ray.engine.sampling import SamplingParams

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                503: "service_unavailable"}


class APIError(Exception):
    """An error the client caused or can retry; rendered as OpenAI's {"error": {...}} with its status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s  # set: the response carries Retry-After

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


def engine_value_error(exc: ValueError) -> APIError:
    """Engine/SamplingParams errors start with the field name ("prompt: ..."); keep it as the OpenAI param."""
    message = str(exc)
    head = message.split(":", 1)[0]
    param = head if head.isidentifier() else None
    code = "context_length_exceeded" if param == "prompt" and "context" in message else None
    return APIError(400, message, param=param, code=code)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage in every chunk (the pacing client counts tokens)


class _Common(BaseModel):
    # Unknown OpenAI fields (user, logit_bias, ...) are ignored like other OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)  # extension (vLLM)
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM): fixed-length outputs for benchmarks
    consumption_rate: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)  # tokens/s, the extension

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=stop,
                              ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            return self.model_copy(update={"max_tokens": self.max_completion_tokens}).sampling(default_max_tokens)
        return super().sampling(default_max_tokens)


class ConsumptionReport(BaseModel):
    """POST /v1/streams/{id}/consumption: replaces the server's reader model of the stream from now on."""

    model_config = ConfigDict(extra="forbid", strict=True)
    consumed_tokens: int | None = Field(default=None, ge=0)
    rate: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    paused: bool | None = None

    @field_validator("rate", mode="before")
    @classmethod
    def _int_rate(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v  # strict mode rejects 20


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Raw JSON -> model, with every failure as a 400 naming the offending field."""
    try:
        data = json.loads(raw, parse_constant=_nan_is_float)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None


def _nan_is_float(token: str) -> float:
    # Python's json accepts NaN/Infinity; keep them as floats so the field validator names the field.
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[token]
