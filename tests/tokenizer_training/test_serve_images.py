import asyncio
import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from tokenflow_ray.tokenizer.service import ImageLimits, ImageRequestError, ImageTokenizerService


def png_bytes(side=16, seed=0, height=None) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height or side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """A briefly trained tiny tokenizer (criterion + Adam on held-in digits), saved as `export` writes it."""
    from tokenflow_ray.tokenizer.config import preset
    from tokenflow_ray.tokenizer.criterion import TokenizerLoss
    from tokenflow_ray.tokenizer.model import DualCodebookTokenizer
    from tokenflow_ray.tokenizer.preprocess import center_crop_resize, decode_rgb
    from tokenflow_ray.tokenizer.training.datasets import digit_images

    torch.manual_seed(0)
    model = DualCodebookTokenizer(preset("tiny"))
    crit = TokenizerLoss.for_model(model)
    blobs, _ = digit_images(64, 32, seed=0)
    x = torch.from_numpy(np.stack([center_crop_resize(decode_rgb(b, 1 << 20), 16) for b in blobs]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    first = None
    for _ in range(15):
        loss = crit(model, x[:32]).loss
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < first
    out = tmp_path_factory.mktemp("tok")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def service(trained_dir):
    return ImageTokenizerService(str(trained_dir), limits=ImageLimits(max_bytes=64 << 10, max_pixels=128 * 128))


def test_service_round_trip_and_errors(service):
    tok = service.tokenize(png_bytes(side=24))
    assert tok["scales"] == [1, 2, 4] and tok["size"] == [16, 16] and tok["original_size"] == [24, 24]
    assert [np.array(i).shape for i in tok["indices"]] == [(1, 1), (2, 2), (4, 4)]
    assert service.tokenize(png_bytes(side=24)) == tok  # deterministic
    img = service.detokenize(tok["indices"])
    assert img.startswith(b"\x89PNG")
    cases = [(lambda: service.tokenize(b"not an image"), 400), (lambda: service.tokenize(png_bytes(side=200)), 413),
             (lambda: service.detokenize([[[0]], [[1, 2, 3]]]), 400), (lambda: service.detokenize([[[10 ** 6]]]), 400),
             (lambda: service.detokenize("abc"), 400), (lambda: service.detokenize([[[0, 0], [0, 0]], [[0]]]), 400),
             (lambda: service.detokenize([[[0] * 5] * 5]), 400)]  # a 5x5 grid on a 4x4 tokenizer
    for call, status in cases:
        with pytest.raises(ImageRequestError) as err:
            call()
        assert err.value.status == status and set(err.value.body()["error"]) == {"message", "type", "param", "code"}


def test_serving_preprocesses_exactly_as_evaluation(service, tmp_path):
    """A non-square image: serving's tokens are those of the model on evaluation's centre-cropped input."""
    from tokenflow_ray.tokenizer.training.config import DataSettings
    from tokenflow_ray.tokenizer.training.evaluate import load_eval_images

    data = png_bytes(side=40, height=24, seed=5)
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "a.png").write_bytes(data)
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "b.png").write_bytes(png_bytes(seed=6))
    cfg = DataSettings(source="images", path=str(tmp_path / "train"), eval_path=str(tmp_path / "held"))
    images, files = load_eval_images(cfg, str(tmp_path), 16, 1)
    assert files == [str((tmp_path / "held" / "a.png").resolve())]
    x, _ = service.preprocess(data)
    assert torch.equal(x, images)
    expected = [i[0].tolist() for i in service.model.encode(images).idx_per_scale]
    assert service.tokenize(data)["indices"] == expected
    batched = service.encode_many([x, service.preprocess(png_bytes(seed=7))[0]])
    assert batched[0] == expected  # a batch gives each image the tokens it gets alone


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_trained_checkpoint_served_over_http_with_key_limits_and_batching(serve_url, trained_dir):
    import httpx
    from ray import serve

    from tokenflow_ray.serve.app import IMAGE_DEPLOYMENT, deploy, undeploy
    from tokenflow_ray.serve.config import ServeConfig, serve_engine
    from tokenflow_ray.tokenizer.model import DualCodebookTokenizer

    app = "tfimages"
    config = ServeConfig(app_name=app, route_prefix=f"/{app}", replicas=1, num_cpus=0.5, images=True,
                         tokenizer_dir=str(trained_dir), api_key="sk-images",
                         engine=serve_engine(policy="fcfs", max_num_seqs=4, num_device_blocks=64, num_host_blocks=0))
    local = DualCodebookTokenizer.from_pretrained(trained_dir)
    key = {"Authorization": "Bearer sk-images"}
    try:
        deploy(config)
        base = f"{serve_url}/{app}/v1/images"
        body = {"image": base64.b64encode(png_bytes(side=24)).decode()}
        with httpx.Client(timeout=60) as client:
            r = client.post(f"{base}/tokenize", json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = client.post(f"{base}/tokenize", json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = client.post(f"{base}/tokenize", json=body, headers=key)
            assert r.status_code == 200, r.text
            tok = r.json()
            r = client.post(f"{base}/detokenize", json={"indices": tok["indices"]}, headers=key)
            assert r.status_code == 200, r.text
            served = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["image"]))), dtype=np.float32)
            # The trained weights are what is served: the PNG is the local model's decode of the same tokens.
            idx = tuple(torch.tensor(s)[None] for s in tok["indices"])
            want = ((local.decode(idx)[0].clamp(-1, 1) + 1) * 127.5).round().permute(1, 2, 0).numpy()
            assert np.abs(served - want).max() <= 1

            huge = Image.new("RGB", (5000, 5000))
            buf = io.BytesIO()
            huge.save(buf, "PNG")
            bad = [({"image": base64.b64encode(buf.getvalue()).decode()}, "tokenize", 413, "image_too_large"),
                   ({"image": "A" * (13 << 20)}, "tokenize", 413, "request_too_large"),
                   ({"image": base64.b64encode(b"garbage bytes").decode()}, "tokenize", 400, "invalid_image"),
                   ({"image": "%%% not base64"}, "tokenize", 400, "invalid_image"),
                   ({"indices": [[[0] * 5] * 5]}, "detokenize", 400, "grid_too_large"),
                   ({"indices": [[[999999]]]}, "detokenize", 400, "invalid_indices"),
                   ({}, "detokenize", 400, "invalid_indices")]
            for payload, route, status, code in bad:
                r = client.post(f"{base}/{route}", json=payload, headers=key)
                assert r.status_code == status, (route, code, r.text[:200])
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == code

        async def burst():
            async with httpx.AsyncClient(timeout=60) as client:
                bodies = [{"image": base64.b64encode(png_bytes(seed=s)).decode()} for s in range(16)]
                return await asyncio.gather(*[client.post(f"{base}/tokenize", json=b, headers=key) for b in bodies])

        assert all(r.status_code == 200 for r in asyncio.run(burst()))
        stats = serve.get_deployment_handle(IMAGE_DEPLOYMENT, app).stats.remote().result()
        assert stats["max_batch"] > 1 and stats["grid"] == 4  # concurrent requests shared model calls
    finally:
        undeploy(config)
