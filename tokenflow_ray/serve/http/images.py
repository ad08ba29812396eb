"""Image tokenizer endpoints for the Serve app: `POST /v1/images/tokenize` and `POST /v1/images/detokenize`.

Over the tokenizer wing's `ImageTokenizerService` (tokenizer/service.py: bytes in, indices or PNG bytes out, and
`ImageRequestError` for anything the caller got wrong), two layers, so each can be tested alone:
  * `ImageTokenizerDeployment`: the Serve deployment wrapping it (one tokenizer per replica). Decoding and torch
    run in a worker thread, never on the replica's event loop, and concurrent requests are batched (`serve.batch`):
    one model call encodes (or decodes) up to `max_batch_size` images.
  * `image_routes(get_handle, api_key=...)`: a FastAPI router the HTTP deployment includes: the same bearer API key
    as the rest of /v1, a body limit counted as the body arrives (413), JSON + base64 in, OpenAI-shaped errors out.
"""

# No `from __future__ import annotations`: Serve pickles these routes by value, and FastAPI must resolve the
# `Request` annotation in the unpickled function's globals, which string annotations would miss.
import asyncio
import base64
import binascii
import hmac

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from ray import serve

from tokenflow_ray.tokenizer.service import ImageLimits, ImageRequestError, ImageTokenizerService


@serve.deployment(max_ongoing_requests=32, ray_actor_options={"num_cpus": 0.5})
class ImageTokenizerDeployment:
    def __init__(self, model_dir: str | None = None, limits: ImageLimits | None = None) -> None:
        self.service = ImageTokenizerService(model_dir, limits=limits)
        lim = self.service.limits
        for method in (self._encode_batch, self._decode_batch):
            method.set_max_batch_size(lim.max_batch_size)
            method.set_batch_wait_timeout_s(lim.batch_wait_timeout_s)
        self.batch_sizes: list[int] = []  # per model call, for stats()

    async def tokenize(self, image_bytes: bytes) -> dict:
        x, original = await asyncio.to_thread(self.service.preprocess, image_bytes)
        return self.service.result(await self._encode_batch(x), original)

    async def detokenize(self, indices) -> bytes:
        parsed = await asyncio.to_thread(self.service.parse_indices, indices)
        return await self._decode_batch(parsed)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _encode_batch(self, images: list) -> list:
        self.batch_sizes.append(len(images))
        return await asyncio.to_thread(self.service.encode_many, images)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def _decode_batch(self, parsed: list) -> list:
        self.batch_sizes.append(len(parsed))
        return await asyncio.to_thread(self.service.decode_many, parsed)

    def stats(self) -> dict:
        """Model calls so far and the largest batch one of them took (batching is observable, so testable)."""
        return {"calls": len(self.batch_sizes), "max_batch": max(self.batch_sizes, default=0),
                "image_size": self.service.side, "grid": self.service.max_grid}


def _check_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ImageRequestError(401, "missing API key: send 'Authorization: Bearer <key>'", None, "invalid_api_key")
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ImageRequestError(401, "incorrect API key provided", None, "invalid_api_key")


async def _json_body(request: Request, limit: int, param: str) -> dict:
    import json

    too_big = ImageRequestError(413, f"request body over {limit} bytes", param, "request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body carries no length: count as it arrives
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError:
        raise ImageRequestError(400, "request body must be JSON", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ImageRequestError(400, "request body must be a JSON object", None, "invalid_json")
    return body


def image_routes(get_handle, max_body_bytes: int = 12 << 20, api_key: str | None = None,
                 max_indices_body_bytes: int = 4 << 20) -> APIRouter:
    """Routes over a handle to ImageTokenizerDeployment; `get_handle()` is called per request (it may be lazy)."""
    router = APIRouter()

    async def _call(request: Request, coro_fn):
        try:
            _check_key(request, api_key)
            return await coro_fn()
        except ImageRequestError as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
            return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
        except Exception as exc:  # a replica-side ImageRequestError arrives wrapped; unwrap it
            cause = getattr(exc, "cause", None) or exc.__cause__
            if isinstance(cause, ImageRequestError):
                return JSONResponse(cause.body(), status_code=cause.status)
            raise

    @router.post("/v1/images/tokenize")
    async def tokenize(request: Request):
        async def run():
            body = await _json_body(request, max_body_bytes, "image")
            image = body.get("image")
            if not isinstance(image, str) or not image:
                raise ImageRequestError(400, "`image` must be a base64-encoded PNG or JPEG", "image", "invalid_image")
            if image.startswith("data:"):  # accept data URLs: data:image/png;base64,....
                image = image.split(",", 1)[-1]
            try:
                raw = base64.b64decode(image, validate=True)
            except (binascii.Error, ValueError):
                raise ImageRequestError(400, "`image` is not valid base64", "image", "invalid_image") from None
            return await get_handle().tokenize.remote(raw)
        return await _call(request, run)

    @router.post("/v1/images/detokenize")
    async def detokenize(request: Request):
        async def run():
            body = await _json_body(request, max_indices_body_bytes, "indices")
            if "indices" not in body:
                raise ImageRequestError(400, "`indices` is required", "indices", "invalid_indices")
            png = await get_handle().detokenize.remote(body["indices"])
            return {"image": base64.b64encode(png).decode("ascii")}
        return await _call(request, run)

    return router
