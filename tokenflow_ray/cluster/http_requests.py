"""What the router can tell about an HTTP request before its body is read: a new stream, or a report for whose stream.

In the direct placement Serve's proxy hands the router only the ASGI scope (path and headers; the body follows
later through the proxy), so:
- a new stream's declared rate comes from the optional `X-Consumption-Rate` header (the body's
  `consumption_rate` is not visible yet; without the header the server's default rate is assumed), and its prompt
  length is estimated from `Content-Length`, less the JSON around it (routing.http_prompt_tokens);
- a consumption report's stream id is in its path, and the id ends with its owning replica's id
  (LLMServer._new_stream_id), so the report is sent to the replica that applies it.

Pure Python (no ray): serve/control/slack_router.py unpickles the scope and asks here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

RATE_HEADER = "x-consumption-rate"
_STREAM_ROUTES = re.compile(r"/v1/(?:chat/)?completions/?$")
_REPORT_ROUTE = re.compile(r"/v1/streams/([^/]+)/consumption/?$")
_OWNED_ID = re.compile(r"^(?:chat)?cmpl-[0-9a-f]{32}-(.+)$")


@dataclass(frozen=True)
class HttpRequestInfo:
    new_stream: bool
    rate: float | None = None  # declared in the header; None: not declared
    body_bytes: int = 0
    owner: str | None = None  # a report's owning replica id, when its stream id names one


def owner_of(stream_id: str) -> str | None:
    match = _OWNED_ID.match(stream_id)
    return match.group(1) if match else None


def classify(method: str, path: str, headers: Iterable[tuple[bytes, bytes]]) -> HttpRequestInfo:
    if method.upper() != "POST":
        return HttpRequestInfo(False)
    report = _REPORT_ROUTE.search(path)
    if report is not None:
        return HttpRequestInfo(False, owner=owner_of(report.group(1)))
    if _STREAM_ROUTES.search(path) is None:
        return HttpRequestInfo(False)
    rate, size = None, 0
    for key, value in headers:
        name = key.decode("latin-1").lower()
        if name == RATE_HEADER:
            try:
                parsed = float(value)
            except ValueError:
                continue
            rate = parsed if math.isfinite(parsed) and parsed >= 0 else None
        elif name == "content-length" and value.isdigit():
            size = int(value)
    return HttpRequestInfo(True, rate, size)
