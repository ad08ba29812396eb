"""Image tokenizer endpoints for the Serve app: `POST /v1/images/tokenize` and `POST /v1/images/detokenize`.

Three layers, so each can be tested alone:
  * `ImageTokenizerService`: plain class over a trained tokenizer directory (`tokenflow serve --tokenizer DIR`: a
    save_pretrained / `tokenflow tokenizer export` folder), by default the one that ships with the package
    (tokenizer/pretrained.py: the experiment's TF arm trained on its generated digits, 16 px). Bytes ->
    model input exactly as evaluation preprocesses (tokenizer/preprocess.py: centre square, bicubic to the model's
    side), batched encode / decode, size limits; raises `ImageRequestError(status, message, param, code)` for
    anything the caller got wrong.
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
import io
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from ray import serve


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 8 << 20  # encoded image size (413 past it)
    max_pixels: int = 4096 * 4096  # decoded width x height, checked from the header before decoding (413)
    max_scales: int = 64  # scales in a detokenize request (400)
    max_grid: int | None = None  # largest scale side in a detokenize request (400); None: the model's token grid
    max_batch_size: int = 8  # images per model call (serve.batch)
    batch_wait_timeout_s: float = 0.005  # how long a batch waits to fill

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_pixels, self.max_scales, self.max_batch_size) < 1:
            raise ValueError("image limits must be >= 1")
        if self.max_grid is not None and self.max_grid < 1:
            raise ValueError("max_grid must be >= 1")
        if self.batch_wait_timeout_s < 0:
            raise ValueError("batch_wait_timeout_s must be >= 0")


class ImageRequestError(ValueError):
    """A client error: becomes {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(status, message, param, code)  # all args kept so the error pickles across actors
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class ImageTokenizerService:
    """Loads a saved tokenizer directory; None: the packaged default (tokenizer/pretrained.py)."""

    def __init__(self, model_dir: str | None = None, limits: ImageLimits | None = None,
                 torch_threads: int = 1) -> None:
        import torch

        from ..tokenizer.model import DualCodebookTokenizer
        from ..tokenizer.pretrained import default_tokenizer_dir

        torch.set_num_threads(torch_threads)
        self.model = DualCodebookTokenizer.from_pretrained(model_dir or default_tokenizer_dir())
        self.model.eval()
        self.limits = limits or ImageLimits()
        self.side = self.model.config.image_size
        self.max_grid = self.limits.max_grid or self.model.config.grid

    # ---- tokenize ----
    def preprocess(self, data: bytes):
        """bytes -> (1 x 3 x S x S tensor, [height, width]); the evaluation's preprocessing."""
        import torch

        from ..tokenizer.preprocess import ImageTooLarge, center_crop_resize, decode_rgb

        if len(data) > self.limits.max_bytes:
            raise ImageRequestError(413, f"image is {len(data)} bytes; the limit is {self.limits.max_bytes}",
                                    "image", "image_too_large")
        try:
            rgb = decode_rgb(data, self.limits.max_pixels)
        except ImageTooLarge as exc:
            raise ImageRequestError(413, str(exc), "image", "image_too_large") from None
        except ValueError:
            raise ImageRequestError(400, "cannot decode image as PNG/JPEG", "image", "invalid_image") from None
        return torch.from_numpy(center_crop_resize(rgb, self.side))[None], [rgb.height, rgb.width]

    def encode_many(self, images: list) -> list[list]:
        """Tensors from `preprocess` -> per image, its indices per scale (nested lists)."""
        import torch

        enc = self.model.encode(torch.cat(images))
        return [[idx[i].tolist() for idx in enc.idx_per_scale] for i in range(len(images))]

    def result(self, indices: list, original: list) -> dict:
        scales = [len(s) for s in indices]
        return {"indices": indices, "scales": scales, "size": [self.side, self.side], "original_size": original}

    def tokenize(self, data: bytes) -> dict:
        x, original = self.preprocess(data)
        return self.result(self.encode_many([x])[0], original)

    # ---- detokenize ----
    def parse_indices(self, indices) -> tuple:
        import torch

        if not isinstance(indices, list) or not indices or len(indices) > self.limits.max_scales:
            raise ImageRequestError(400, f"indices must be a non-empty list of scales (at most "
                                         f"{self.limits.max_scales})", "indices", "invalid_indices")
        out = []
        for i, scale in enumerate(indices):
            if isinstance(scale, list) and len(scale) > self.max_grid:  # before building a huge tensor
                raise ImageRequestError(400, f"indices[{i}] is a {len(scale)}-row grid; the largest this tokenizer "
                                             f"serves is {self.max_grid}", "indices", "grid_too_large")
            try:
                idx = torch.tensor(scale, dtype=torch.long)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                raise ImageRequestError(400, f"indices[{i}] must be a square grid of integers", "indices",
                                        "invalid_indices") from None
            if idx.ndim < 2 or idx.shape[0] != idx.shape[1] or idx.shape[0] < 1:
                raise ImageRequestError(400, f"indices[{i}] must be a square s x s grid, got shape "
                                             f"{list(idx.shape)}", "indices", "invalid_indices")
            if idx.shape[0] > self.max_grid:
                raise ImageRequestError(400, f"indices[{i}] is {idx.shape[0]}x{idx.shape[0]}; the largest grid this "
                                             f"tokenizer serves is {self.max_grid}", "indices", "grid_too_large")
            out.append(idx[None])
        if [t.shape[1] for t in out] != sorted({t.shape[1] for t in out}):
            raise ImageRequestError(400, "scales must be strictly increasing in side", "indices", "invalid_indices")
        try:
            self.model.quantizer.codebook.check_indices(torch.cat([t.flatten() for t in out]))
        except ValueError as exc:
            raise ImageRequestError(400, f"cannot decode these indices: {exc}", "indices", "invalid_indices") from None
        return tuple(out)

    def decode_many(self, parsed: list[tuple]) -> list[bytes]:
        """Parsed index tuples -> PNG bytes each; requests with the same scale sides share one decode call."""
        import torch
        from PIL import Image

        out: list = [None] * len(parsed)
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(parsed):
            groups.setdefault(tuple((tuple(t.shape[1:])) for t in p), []).append(i)
        for members in groups.values():
            stacked = tuple(torch.cat([parsed[i][s] for i in members]) for s in range(len(parsed[members[0]])))
            try:
                imgs = self.model.decode(stacked)
            except (ValueError, RuntimeError, IndexError) as exc:
                raise ImageRequestError(400, f"cannot decode these indices: {exc}", "indices",
                                        "invalid_indices") from None
            for j, i in enumerate(members):
                arr_HWC = ((imgs[j].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
                buf = io.BytesIO()
                Image.fromarray(arr_HWC).save(buf, format="PNG")
                out[i] = buf.getvalue()
        return out

    def detokenize(self, indices) -> bytes:
        return self.decode_many([self.parse_indices(indices)])[0]


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
