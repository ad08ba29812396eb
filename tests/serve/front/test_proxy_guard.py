"""The proxy middleware that answers for a dead replica (serve/http/proxy_guard.py), on plain ASGI apps (no Ray): the
real-replica cases are in test_faults.py (direct placement)."""

from __future__ import annotations

import asyncio
import json

from tokenflow_ray.serve.http.proxy_guard import ReplicaLossGuard

SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-stream-id", b"cmpl-abc")]


def _run(app, disconnect: bool = False, headers=()) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"} if disconnect else {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": [(b"x-request-id", b"req-42"), *headers]}
    asyncio.run(ReplicaLossGuard(app)(scope, receive, send))
    return sent


def _body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_finished_response_passes_through_untouched():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    sent = _run(app)
    assert len(sent) == 3 and _body(sent) == b"data: {}\n\ndata: [DONE]\n\n"


def test_a_cut_event_stream_ends_with_an_error_event_and_done():
    async def app(scope, receive, send):  # what Serve's proxy does when the replica dies mid-stream
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await send({"type": "http.response.body", "body": b'data: {"id":"cmpl-abc"}\n\n', "more_body": True})

    sent = _run(app)
    assert sent[-1] == {"type": "http.response.body", "body": sent[-1]["body"], "more_body": False}
    events = [e[6:] for e in _body(sent).decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert (err["code"], err["type"]) == ("replica_unavailable", "service_unavailable")
    assert "cmpl-abc" in err["message"]


def test_an_app_that_raises_mid_stream_still_ends_the_stream_properly():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        raise RuntimeError("the replica's stream failed")

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    try:
        asyncio.run(ReplicaLossGuard(app)({"type": "http", "headers": []}, receive, send))
    except RuntimeError:
        pass  # re-raised for the server's log, after the answer
    else:
        raise AssertionError("the app's error was swallowed")
    assert sent[-1]["more_body"] is False and sent[-1]["body"].endswith(b"data: [DONE]\n\n")


def test_no_response_at_all_becomes_an_openai_shaped_503():
    async def app(scope, receive, send):  # the replica died before it answered: the proxy sends nothing
        return None

    (start, body) = _run(app)
    assert start["status"] == 503 and dict(start["headers"])[b"retry-after"] == b"1"
    err = json.loads(body["body"])["error"]
    assert err["code"] == "replica_unavailable" and "req-42" in err["message"] and not body["more_body"]


def test_a_client_that_left_or_a_cut_json_body_gets_nothing_more():
    async def sse_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await receive()
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})

    assert len(_run(sse_app, disconnect=True)) == 2

    async def json_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"id": ', "more_body": True})

    assert len(_run(json_app)) == 2


def test_websockets_and_lifespan_pass_straight_through():
    calls: list[str] = []

    async def app(scope, receive, send):
        calls.append(scope["type"])

    async def noop(*_):
        return {}

    asyncio.run(ReplicaLossGuard(app)({"type": "lifespan"}, noop, noop))
    assert calls == ["lifespan"]
