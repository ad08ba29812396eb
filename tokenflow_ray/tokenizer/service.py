"""ImageTokenizerService: a trained tokenizer behind the serving contract, with no server in it.

A plain class over a trained tokenizer directory (`tokenflow serve --tokenizer DIR`: a save_pretrained /
`tokenflow tokenizer export` folder), by default the one that ships with the package (tokenizer/pretrained.py: the
experiment's TF arm trained on its generated digits, 16 px). Bytes -> model input exactly as evaluation
preprocesses (tokenizer/preprocess.py: centre square, bicubic to the model's side), batched encode / decode, size
limits; raises `ImageRequestError(status, message, param, code)` for anything the caller got wrong. The Serve
deployment and the HTTP routes over it are serve/http/images.py.
"""

from __future__ import annotations

import io
from dataclasses import dataclass


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

        from tokenflow_ray.tokenizer.model import DualCodebookTokenizer
        from tokenflow_ray.tokenizer.pretrained import default_tokenizer_dir

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

        from tokenflow_ray.tokenizer.preprocess import ImageTooLarge, center_crop_resize, decode_rgb

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
