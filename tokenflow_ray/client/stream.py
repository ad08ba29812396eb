"""PacedStreamClient: streams one completion over SSE and reads it at a declared rate.

Tokens land in a local buffer as chunks arrive; a ReaderModel drains it at `rate` tokens/s (the same model and
metric definitions the engine uses, so client-side and server-side figures mean the same thing). The client counts
tokens with vLLM's `continuous_usage_stats` (usage in every chunk), measures its own TTFT, stalls and token times,
and checks every `report_interval_s` whether to report how far it has read to `/v1/streams/{id}/consumption`: when
its reader has drifted `report_drift_s` seconds of reading off the server's model of it (report_trigger.py; None:
at every check). report_interval_s=None: no reports, for servers without that route, e.g. vLLM; the client-side
metrics do not depend on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import httpx

from tokenflow_ray.client.report_trigger import ReportTrigger, check_drift_s
from tokenflow_ray.metrics.reader import ReaderModel
from tokenflow_ray.metrics.stream_metrics import StreamRecord


@dataclass(frozen=True)
class StreamSpec:
    prompt: str
    max_tokens: int = 16
    rate: float = 0.0  # consumption rate, tokens/s (0: unpaced)
    start_s: float = 0.0  # offset from the start of a load run
    chat: bool = False
    temperature: float = 0.0
    ignore_eos: bool = True  # fixed-length outputs make runs comparable


@dataclass
class StreamResult:
    spec: StreamSpec
    stream_id: str | None = None
    record: StreamRecord | None = None  # times are seconds since the load's origin
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    # A 429 is the server refusing the stream (its queues are full), not a failure: it is counted apart.
    rejected: bool = False
    retry_after_s: float | None = None  # the 429's Retry-After
    reports_sent: int = 0
    report_errors: list[int] = field(default_factory=list)  # HTTP statuses of failed reports

    @property
    def complete(self) -> bool:
        return self.error is None and not self.rejected and self.finish_reason is not None


class PacedStreamClient:
    def __init__(self, http: httpx.AsyncClient, base_url: str, model: str = "embedded",
                 api_key: str | None = None, report_interval_s: float | None = 1.0,
                 report_drift_s: float | None = 0.5,
                 origin: float | None = None) -> None:
        if report_interval_s is not None and not report_interval_s > 0:
            raise ValueError(f"report_interval_s: must be positive or None, got {report_interval_s!r}")
        self.http = http
        self.base = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        check_drift_s(report_drift_s)
        self.report_interval_s = report_interval_s
        self.report_drift_s = report_drift_s
        self.origin = time.monotonic() if origin is None else origin

    def now(self) -> float:
        return time.monotonic() - self.origin

    async def report(self, stream_id: str, **fields: object) -> int:
        resp = await self.http.post(f"{self.base}/v1/streams/{stream_id}/consumption", json=fields,
                                    headers=self.headers)
        return resp.status_code

    def _body(self, spec: StreamSpec) -> dict:
        body = {"model": self.model, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
                "ignore_eos": spec.ignore_eos, "stream": True, "consumption_rate": spec.rate,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if spec.chat:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return body

    async def run(self, spec: StreamSpec) -> StreamResult:
        path = "/v1/chat/completions" if spec.chat else "/v1/completions"
        result = StreamResult(spec)
        arrival = self.now()
        reader = ReaderModel(spec.rate)
        trigger = None if self.report_interval_s is None else ReportTrigger(spec.rate, self.report_drift_s)
        reporter: asyncio.Task | None = None
        try:
            # The rate header is a routing hint: the router sees headers before the body (cluster/http_requests.py).
            headers = {**self.headers, "X-Consumption-Rate": repr(float(spec.rate))}
            async with self.http.stream("POST", self.base + path, json=self._body(spec), headers=headers) as resp:
                if resp.status_code == 429:
                    await resp.aread()
                    result.rejected = True
                    retry = resp.headers.get("retry-after", "")
                    result.retry_after_s = float(retry) if retry.isdigit() else None
                    return result
                if resp.status_code != 200:
                    result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')}"
                    return result
                texts: list[str] = []
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        result.error = chunk["error"].get("message", "stream error")
                        break
                    t = self.now()
                    usage = chunk.get("usage") or {}
                    if result.record is None:
                        result.stream_id = chunk["id"]
                        result.record = StreamRecord(chunk["id"], arrival, spec.rate, usage.get("prompt_tokens", 0))
                        if trigger is not None:
                            reporter = asyncio.create_task(self._report_loop(result, reader, trigger))
                    if not chunk["choices"]:
                        continue  # the final usage-only chunk
                    choice = chunk["choices"][0]
                    texts.append(choice["delta"].get("content") or "" if spec.chat else choice["text"])
                    total = usage.get("completion_tokens", result.num_tokens + 1)
                    for _ in range(total - result.num_tokens):
                        result.record.record_token(t, reader.buffer_at(t))
                        reader.on_tokens(t)
                    if trigger is not None and total > result.num_tokens:
                        trigger.on_tokens(t, total - result.num_tokens)
                    result.num_tokens = total
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                result.text = "".join(texts)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            if reporter is not None:
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
            if result.record is not None and result.record.token_times:
                end = max(self.now(), result.record.token_times[-1])
                reader.finish(end)
                result.record.mark_finished(stall_s=reader.stall_time_at(end))
        return result

    async def _report_loop(self, result: StreamResult, reader: ReaderModel, trigger: ReportTrigger) -> None:
        assert result.stream_id is not None and self.report_interval_s is not None
        while True:
            await asyncio.sleep(self.report_interval_s)
            t = self.now()
            consumed = reader.consumed_at(t)
            if not trigger.due(t, consumed):
                continue
            trigger.reported(t, consumed)  # before the await: tokens arriving meanwhile come after t
            status = await self.report(result.stream_id, consumed_tokens=consumed)
            result.reports_sent += 1
            if status != 204:
                result.report_errors.append(status)
