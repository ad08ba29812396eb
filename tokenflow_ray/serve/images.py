"""Image tokenizer endpoints for the Serve app: `POST /v1/images/tokenize` and `POST /v1/images/detokenize`.

Three layers, so each can be tested alone:
  * `ImageTokenizerService`: plain class, bytes -> indices dict and indices -> PNG bytes, with size limits; raises
    `ImageRequestError(status, message, param, code)` for anything the caller got wrong.
  * `ImageTokenizerDeployment`: the Serve deployment wrapping it (one tokenizer per replica).
  * `image_routes(get_handle)`: a FastAPI router the ingress includes; JSON + base64 in, OpenAI-shaped errors out.
"""

# No `from __future__ import annotations`: Serve pickles these routes by value, and FastAPI must resolve the
# `Request` annotation in the unpickled function's globals, which string annotations would miss.
import base64
import binascii
import io
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from ray import serve


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 8 << 20  # encoded image size
    max_pixels: int = 4096 * 4096  # decoded width x height, checked from the header before decoding
    max_scales: int = 64

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_pixels, self.max_scales) < 1:
            raise ValueError("image limits must be >= 1")


class ImageRequestError(ValueError):
    """A client error: becomes {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(status, message, param, code)  # all args kept so the error pickles across actors
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class ImageTokenizerService:
    """Loads a saved tokenizer directory, or builds preset('tiny') with a fixed seed when none is given."""

    def __init__(self, model_dir: str | None = None, seed: int = 0, limits: ImageLimits | None = None,
                 torch_threads: int = 1) -> None:
        import torch

        from ..tokenizer.config import preset
        from ..tokenizer.model import DualCodebookTokenizer

        torch.set_num_threads(torch_threads)
        if model_dir is not None:
            self.model = DualCodebookTokenizer.from_pretrained(model_dir)
        else:
            torch.manual_seed(seed)
            self.model = DualCodebookTokenizer(preset("tiny"))
        self.model.eval()
        self.limits = limits or ImageLimits()
        self.side = self.model.config.image_size

    def _decode_image(self, data: bytes):
        from PIL import Image

        if len(data) > self.limits.max_bytes:
            raise ImageRequestError(413, f"image is {len(data)} bytes; the limit is {self.limits.max_bytes}",
                                    "image", "image_too_large")
        try:
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > self.limits.max_pixels:
                raise ImageRequestError(413, f"image is {img.width}x{img.height} pixels; the limit is "
                                             f"{self.limits.max_pixels} pixels", "image", "image_too_large")
            return img.convert("RGB")
        except ImageRequestError:
            raise
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise ImageRequestError(400, f"cannot decode image as PNG/JPEG ({type(exc).__name__})", "image",
                                    "invalid_image") from None

    def tokenize(self, data: bytes) -> dict:
        import numpy as np
        import torch
        from PIL import Image

        img = self._decode_image(data)
        original = [img.height, img.width]
        arr_HWC = np.asarray(img.resize((self.side, self.side), Image.BICUBIC), dtype=np.float32)
        img_BCHW = torch.from_numpy(arr_HWC.transpose(2, 0, 1).copy())[None] / 127.5 - 1
        enc = self.model.encode(img_BCHW)
        return {"indices": [idx[0].tolist() for idx in enc.idx_per_scale], "scales": list(enc.scales),
                "size": [self.side, self.side], "original_size": original}

    def _indices_to_tensors(self, indices) -> tuple:
        import torch

        if not isinstance(indices, list) or not indices or len(indices) > self.limits.max_scales:
            raise ImageRequestError(400, f"indices must be a non-empty list of scales (at most "
                                         f"{self.limits.max_scales})", "indices", "invalid_indices")
        out = []
        for i, scale in enumerate(indices):
            try:
                idx = torch.tensor(scale, dtype=torch.long)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                raise ImageRequestError(400, f"indices[{i}] must be a square grid of integers", "indices",
                                        "invalid_indices") from None
            if idx.ndim < 2 or idx.shape[0] != idx.shape[1] or idx.shape[0] < 1:
                raise ImageRequestError(400, f"indices[{i}] must be a square s x s grid, got shape "
                                             f"{list(idx.shape)}", "indices", "invalid_indices")
            out.append(idx[None])
        if [t.shape[1] for t in out] != sorted({t.shape[1] for t in out}):
            raise ImageRequestError(400, "scales must be strictly increasing in side", "indices", "invalid_indices")
        return tuple(out)

    def detokenize(self, indices) -> bytes:
        import torch
        from PIL import Image

        idx_per_scale = self._indices_to_tensors(indices)
        try:
            img_BCHW = self.model.decode(idx_per_scale)
        except (ValueError, RuntimeError, IndexError) as exc:
            raise ImageRequestError(400, f"cannot decode these indices: {exc}", "indices", "invalid_indices") from None
        arr_HWC = ((img_BCHW[0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        buf = io.BytesIO()
        Image.fromarray(arr_HWC).save(buf, format="PNG")
        return buf.getvalue()


@serve.deployment(max_ongoing_requests=16, ray_actor_options={"num_cpus": 0.5})
class ImageTokenizerDeployment:
    def __init__(self, model_dir: str | None = None, seed: int = 0, limits: ImageLimits | None = None) -> None:
        self.service = ImageTokenizerService(model_dir, seed=seed, limits=limits)

    async def tokenize(self, image_bytes: bytes) -> dict:
        return self.service.tokenize(image_bytes)

    async def detokenize(self, indices) -> bytes:
        return self.service.detokenize(indices)


def _error(status: int, message: str, param: str | None, code: str | None) -> JSONResponse:
    return JSONResponse(ImageRequestError(status, message, param, code).body(), status_code=status)


async def _json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise ImageRequestError(400, "request body must be JSON", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ImageRequestError(400, "request body must be a JSON object", None, "invalid_json")
    return body


def image_routes(get_handle, max_body_bytes: int = 12 << 20) -> APIRouter:
    """Routes over a handle to ImageTokenizerDeployment; `get_handle()` is called per request (it may be lazy)."""
    router = APIRouter()

    async def _call(coro_fn):
        try:
            return await coro_fn()
        except ImageRequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except Exception as exc:  # a replica-side ImageRequestError arrives wrapped; unwrap it
            cause = getattr(exc, "cause", None) or exc.__cause__
            if isinstance(cause, ImageRequestError):
                return JSONResponse(cause.body(), status_code=cause.status)
            raise

    @router.post("/v1/images/tokenize")
    async def tokenize(request: Request):
        async def run():
            if int(request.headers.get("content-length") or 0) > max_body_bytes:
                raise ImageRequestError(413, f"request body over {max_body_bytes} bytes", "image", "image_too_large")
            body = await _json_body(request)
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
        return await _call(run)

    @router.post("/v1/images/detokenize")
    async def detokenize(request: Request):
        async def run():
            body = await _json_body(request)
            if "indices" not in body:
                raise ImageRequestError(400, "`indices` is required", "indices", "invalid_indices")
            png = await get_handle().detokenize.remote(body["indices"])
            return {"image": base64.b64encode(png).decode("ascii")}
        return await _call(run)

    return router
