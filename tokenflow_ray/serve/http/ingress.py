"""The OpenAI-compatible HTTP API (FastAPI on Serve), shaped like Ray Serve LLM's OpenAiIngress, in two placements.

- direct (the default): the LLMServer replicas answer HTTP themselves. Serve's proxy hands each request to the
  replica its request router picks (the buffer-slack router reads the request's path and headers: a consumption
  report goes to the replica that owns the stream, serve/control/slack_router.py), so a token crosses one hop between the
  engine and the socket, and a report is applied where its stream runs.
- ingress: a separate OpenAIIngress deployment answers HTTP and calls the replicas through a handle. One more hop
  and process, and in exchange the ingress outlives a replica: a replica that dies before a stream's first token is
  answered 503 `replica_unavailable`, and one that dies mid-stream gives its streams an error event and `[DONE]`
  (errors.py). Direct mode gives the same answers for every failure inside a live replica, and for a dead one
  Serve's proxy gives them (serve/http/proxy_guard.py, installed where this package starts Ray or by cluster.yaml).

Both build the same routes (`make_http_class`) over two backends: the handle (`IngressBackend`) and the replica
itself (`LLMServer`'s `_open_stream` and friends, serve/replica/token_path.py).

No `from __future__ import annotations` here: FastAPI reads route annotations at runtime, and string annotations
of a class built inside a function do not resolve (a `request: Request` turns into a required query field).

Every error is OpenAI-shaped. Errors found before the first token (bad JSON, validation, prompt too long, a full
server: 429, a dead replica: 503) are plain HTTP errors: the route waits for the first delta before it sends the
SSE headers. After them a failure is an error event in the stream, then `[DONE]`; the client gets a short message
with the stream id and the server log gets the details (errors.py).
"""


import hmac
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenflow_ray.cluster.messages import Delta, GenerateRequest, Report
from tokenflow_ray.serve.control.central import CentralSettings, get_central, report_with_retry
from tokenflow_ray.serve.http.errors import stream_failure
from tokenflow_ray.serve.http.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ConsumptionReport,
    engine_value_error,
    parse_body,
)
from tokenflow_ray.serve.http.responses import DONE, ChunkWriter, full_response, sse
from tokenflow_ray.serve.http.stream_port import follow

log = logging.getLogger(__name__)

REPORT_PATH = "/v1/streams/{stream_id}/consumption"


@dataclass(frozen=True)
class IngressSettings:
    model: str
    default_max_tokens: int
    max_body_bytes: int
    api_key: str | None
    central: CentralSettings
    report_retry_s: float = 10.0  # a report is retried this long while the central actor restarts, then 503
    default_rate: float = 0.0  # ServeConfig.default_rate: the rate of a request that declares none


def _error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    if exc.retry_after_s is not None:
        headers = {"Retry-After": str(max(0, math.ceil(exc.retry_after_s)))}  # RFC 9110: integer seconds
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def queue_full(retry_after_s: float | None) -> APIError:
    return APIError(429, "every replica's queue is full; retry later", code="queue_full",
                    retry_after_s=retry_after_s)


def _install_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(exc.status_code, str(exc.detail)))

    @api.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(APIError(400, str(exc.errors()[0].get("msg", "invalid request"))))


def _cause(exc: BaseException) -> BaseException:
    # Ray wraps a replica's exception in RayTaskError (which also subclasses it); its str() carries a traceback.
    return getattr(exc, "cause", None) or exc


class IngressBackend:
    """The ingress placement's backend: streams and reports go through a handle to the LLMServer replicas."""

    def __init__(self, llm: DeploymentHandle, settings: IngressSettings, *extra: DeploymentHandle) -> None:
        self.llm = llm.options(stream=True)
        self.http = settings
        self.central = get_central(settings.central)

    def _new_stream_id(self, prefix: str) -> str:
        return prefix + uuid.uuid4().hex

    async def _open_stream(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """The stream's deltas from its replica; if it moves, from its new replica's port (stream_port.follow), so
        the replica it left is done with it (one Serve is stopping can stop)."""
        gen = self.llm.generate.remote(req, follow_moves=True)
        try:
            async for delta in gen:
                if delta.moved_to is None:
                    yield delta
                    continue
                if delta.num_new_tokens:
                    yield replace(delta, moved_to=None)
                async for moved in follow(delta.moved_to, req.stream_id):
                    yield moved
                return
        finally:
            gen.cancel()  # the client left (or the stream is over: a no-op)

    async def _route_report(self, report: Report) -> bool:
        return await report_with_retry(self.central, report, self.http.report_retry_s)

    def _stream_lost(self, stream_id: str) -> None:
        # A dead replica cannot end its streams: end this one in the central table now (fire and forget; the
        # actor's sweep drops whatever is left of the replica).
        try:
            self.central.deregister.remote(stream_id)
        except Exception:  # the central actor is restarting: its table is rebuilt from live replicas anyway
            log.warning("could not deregister stream %s", stream_id, exc_info=True)


def make_http_class(base: type, routers: Sequence[APIRouter] = ()) -> type:
    """The OpenAI routes over `base` (IngressBackend or LLMServer), on a fresh FastAPI app per build, so optional
    routers never mutate shared state."""
    api = FastAPI(title="tokenflow_ray", docs_url=None, redoc_url=None)
    _install_error_handlers(api)
    for router in routers:
        api.include_router(router)

    @serve.ingress(api)
    class OpenAIServer(base):
        # ---- request plumbing ---------------------------------------------------------------------------------
        def _auth(self, request: Request) -> None:
            key = self.http.api_key
            if key is None:
                return
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
            if not hmac.compare_digest(token.strip().encode(), key.encode()):
                raise APIError(401, "incorrect API key provided", code="invalid_api_key")

        async def _body(self, request: Request) -> bytes:
            limit = self.http.max_body_bytes
            too_big = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise too_big
            chunks, size = [], 0
            async for chunk in request.stream():  # chunked bodies carry no length: count as they come
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
            return b"".join(chunks)

        # ---- OpenAI routes ------------------------------------------------------------------------------------
        @api.post("/v1/completions")
        async def completions(self, request: Request) -> Response:
            self._auth(request)
            req = parse_body(await self._body(request), CompletionRequest)
            prompt = req.prompt if isinstance(req.prompt, str) else tuple(req.prompt)
            return await self._generate(req, "cmpl-", prompt=prompt)

        @api.post("/v1/chat/completions")
        async def chat_completions(self, request: Request) -> Response:
            self._auth(request)
            req = parse_body(await self._body(request), ChatCompletionRequest)
            messages = tuple((m.role, m.text()) for m in req.messages)
            return await self._generate(req, "chatcmpl-", messages=messages)

        async def _generate(self, req: CompletionRequest | ChatCompletionRequest, prefix: str,
                            **prompt: object) -> Response:
            if req.model != self.http.model:
                raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.http.model!r}",
                               param="model", code="model_not_found")
            try:
                sampling = req.sampling(self.http.default_max_tokens)
            except ValueError as exc:
                raise engine_value_error(exc) from None
            stream_id = self._new_stream_id(prefix)
            rate = self.http.default_rate if req.consumption_rate is None else req.consumption_rate  # resolved here
            gen = self._open_stream(GenerateRequest(stream_id, sampling, rate=rate, **prompt))
            try:
                # A handle routes on the first await: a full queue raises BackPressureError here, not at .remote().
                first = await gen.__anext__()
            except BackPressureError as exc:  # the LLMServer deployment's backpressure_config has Retry-After
                raise queue_full(exc.retry_after_s) from None
            except APIError:
                raise
            except ValueError as exc:
                raise engine_value_error(_cause(exc)) from None  # type: ignore[arg-type]
            except Exception as exc:  # before the headers: a plain HTTP error (503 if the replica died)
                raise self._failed(exc, stream_id, "before its first token") from None
            chat = isinstance(req, ChatCompletionRequest)
            created = int(time.time())
            if not req.stream:
                return await self._collect(gen, first, stream_id, req.model, created, chat)
            writer = ChunkWriter(stream_id, req.model, created, chat, req.include_usage, req.continuous_usage)
            return StreamingResponse(self._sse(gen, first, writer, stream_id), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Stream-Id": stream_id})

        async def _sse(self, gen, first: Delta, writer: ChunkWriter, stream_id: str) -> AsyncIterator[bytes]:
            last = first
            try:
                yield writer.chunk(first)
                while not last.finished:
                    last = await gen.__anext__()
                    yield writer.chunk(last)
                yield writer.final(last)
            except StopAsyncIteration:
                yield writer.final(last)
            except Exception as exc:  # after the headers: an error event, then [DONE] (docs/design.md §7.3)
                yield sse(self._failed(exc, stream_id, "mid-stream").body()) + DONE
            finally:
                if not last.finished:
                    await _close(gen)  # client gone: the replica aborts the stream and frees its KV

        async def _collect(self, gen, first: Delta, stream_id: str, model: str, created: int,
                           chat: bool) -> JSONResponse:
            parts, last = [first.text], first
            try:
                while not last.finished:
                    last = await gen.__anext__()
                    parts.append(last.text)
            except StopAsyncIteration:
                pass
            except Exception as exc:  # no partial body: the whole answer is the error
                raise self._failed(exc, stream_id, "mid-response") from None
            finally:
                if not last.finished:
                    await _close(gen)
            return JSONResponse(full_response(stream_id, model, created, chat, "".join(parts), last))

        def _failed(self, exc: BaseException, stream_id: str, when: str) -> APIError:
            """The client's short error for a failed stream; the details (Ray's, with actor and node) are logged."""
            err = stream_failure(exc, stream_id)
            if err.code == "server_shutting_down":  # expected while stopping: no traceback per stream
                log.info("stream %s ended %s: the server is stopping", stream_id, when)
                return err
            log.error("stream %s failed %s; answering %d %s", stream_id, when, err.status, err.code, exc_info=exc)
            if err.code == "replica_unavailable":
                self._stream_lost(stream_id)
            return err

        # ---- the consumption-rate extension -------------------------------------------------------------------
        @api.post(REPORT_PATH, status_code=204)
        async def consumption(self, stream_id: str, request: Request) -> Response:
            self._auth(request)
            rep = parse_body(await self._body(request), ConsumptionReport)
            report = Report(stream_id, rep.consumed_tokens, rep.rate, rep.paused)
            try:
                known = await self._route_report(report)
            except ValueError as exc:  # the owner refused it (e.g. consumed more than was generated)
                raise engine_value_error(_cause(exc)) from None  # type: ignore[arg-type]
            except Exception:
                log.exception("report for %s could not be delivered", stream_id)
                raise APIError(503, f"the report could not be delivered; retry (request id {stream_id})",
                               code="report_undelivered", retry_after_s=1) from None
            if not known:
                raise APIError(404, f"stream {stream_id!r} is unknown or finished", param="stream_id",
                               code="stream_not_found")
            return Response(status_code=204)

        # ---- discovery and operations -------------------------------------------------------------------------
        @api.get("/v1/models")
        async def models(self, request: Request) -> dict:
            self._auth(request)
            return {"object": "list", "data": [{"id": self.http.model, "object": "model", "created": 0,
                                                "owned_by": "tokenflow_ray"}]}

        @api.get("/health")
        async def health(self) -> dict:
            return {"status": "ok"}

        @api.get("/metrics")
        async def metrics(self) -> Response:
            from tokenflow_ray.serve.http.prometheus import render_prometheus

            stats = await self.central.stats.remote()
            return Response(render_prometheus(stats), media_type="text/plain; version=0.0.4")

    return OpenAIServer


async def _close(gen) -> None:
    """End a stream the client left: a handle's generator is cancelled, a local one closed (its finally aborts)."""
    cancel = getattr(gen, "cancel", None)
    if cancel is not None:
        cancel()
    else:
        await gen.aclose()


def make_ingress(routers: Sequence[APIRouter] = ()) -> type:
    """The ingress placement's deployment class (OpenAIIngress)."""
    return make_http_class(IngressBackend, routers)
