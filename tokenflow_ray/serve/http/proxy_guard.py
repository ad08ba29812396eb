"""A Serve proxy middleware that answers for a replica that died under a request (direct placement).

In the direct placement (ingress.py) the LLMServer replica writes the HTTP response itself, through Serve's proxy.
When the replica dies, the proxy's stream from it raises and Serve's proxy, having no answer of its own for a dead
actor, writes nothing more: a stream's connection just ends, without an error event or `[DONE]`, and a request
that had no response yet gets a bare 500. The ingress placement answers these (errors.py) because its process
outlives the replica; this middleware gives the direct placement the same answers from the one process that does
outlive it there, the proxy:

- no response started: HTTP 503 `replica_unavailable` with Retry-After, OpenAI-shaped, quoting Serve's request id;
- an SSE response cut before its end: an error event (the stream's id, from its `X-Stream-Id` header), then
  `[DONE]`, and the body is closed properly.

A response that ended, or whose client left, is not touched. Ray's details stay in the proxy's log (Serve logs
the actor error there).

Installed through Serve's proxy callback, `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=` `PROXY_CALLBACK` in the
environment of the processes that start proxies (serve/local.py sets it before it starts Ray; cluster.yaml and
deploy/rayservice.yaml set it on every node).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from tokenflow_ray.serve.http.errors import REPLICA_MESSAGE, RETRY_AFTER_S
from tokenflow_ray.serve.http.protocol import APIError
from tokenflow_ray.serve.http.responses import DONE, sse

log = logging.getLogger(__name__)

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "tokenflow_ray.serve.http.proxy_guard:proxy_middlewares"


def proxy_middlewares() -> list:
    """Serve's proxy callback: the middlewares its proxies wrap their ASGI app in."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLossGuard)]


@dataclass
class _Seen:
    """What the inner app has sent so far."""

    started: bool = False
    ended: bool = False
    event_stream: bool = False
    stream_id: str | None = None
    client_gone: bool = False


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def replica_lost(request_id: str | None) -> APIError:
    """The 503 a request gets when its replica died before its response started."""
    rid = f" (request id {request_id})" if request_id else ""
    return APIError(503, f"{REPLICA_MESSAGE}{rid}", code="replica_unavailable", retry_after_s=RETRY_AFTER_S)


class ReplicaLossGuard:
    """Pure ASGI middleware (no buffering: every message passes straight through)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        seen = _Seen()

        async def watch_receive() -> dict:
            message = await receive()
            if message["type"] == "http.disconnect":
                seen.client_gone = True
            return message

        async def watch_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen.started = True
                headers = message.get("headers")
                seen.event_stream = (_header(headers, b"content-type") or "").startswith("text/event-stream")
                seen.stream_id = _header(headers, b"x-stream-id")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                seen.ended = True
            await send(message)

        try:
            await self.app(scope, watch_receive, watch_send)
        finally:  # returned without finishing (Serve's proxy, for a dead replica) or raised: answer, then go on
            if not (seen.ended or seen.client_gone or (seen.started and not seen.event_stream)):
                # (a cut JSON body has no repair: the client sees a short body, as from any server)
                try:
                    await self._answer(scope, seen, send)
                except Exception:  # the client went away meanwhile: nothing to tell it
                    log.debug("could not answer for a lost replica", exc_info=True)

    @staticmethod
    async def _answer(scope: dict, seen: _Seen, send: Any) -> None:
        if not seen.started:
            request_id = _header(scope.get("headers"), b"x-request-id")
            err = replica_lost(request_id)
            log.warning("request %s %s: the replica died before answering; 503 %s", request_id, scope.get("path"),
                        err.code)
            body = json.dumps(err.body()).encode()
            await send({"type": "http.response.start", "status": err.status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"retry-after", str(err.retry_after_s).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        err = replica_lost(seen.stream_id)
        log.warning("stream %s: the replica died mid-stream; error event %s", seen.stream_id, err.code)
        await send({"type": "http.response.body", "body": sse(err.body()) + DONE, "more_body": False})
