import base64
import io

import numpy as np
import pytest

from tokenflow_ray.serve.images import ImageLimits, ImageRequestError, ImageTokenizerService


def png_bytes(side=16, seed=0) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def service():
    return ImageTokenizerService(seed=0, limits=ImageLimits(max_bytes=64 << 10, max_pixels=128 * 128))


def test_service_round_trip_and_errors(service):
    tok = service.tokenize(png_bytes(side=24))
    assert tok["scales"] == [1, 2, 4] and tok["size"] == [16, 16] and tok["original_size"] == [24, 24]
    assert [np.array(i).shape for i in tok["indices"]] == [(1, 1), (2, 2), (4, 4)]
    assert service.tokenize(png_bytes(side=24)) == tok  # deterministic
    img = service.detokenize(tok["indices"])
    assert img.startswith(b"\x89PNG")
    cases = [(lambda: service.tokenize(b"not an image"), 400), (lambda: service.tokenize(png_bytes(side=200)), 413),
             (lambda: service.detokenize([[[0]], [[1, 2, 3]]]), 400), (lambda: service.detokenize([[[10 ** 6]]]), 400),
             (lambda: service.detokenize("abc"), 400), (lambda: service.detokenize([[[0, 0], [0, 0]], [[0]]]), 400)]
    for call, status in cases:
        with pytest.raises(ImageRequestError) as err:
            call()
        assert err.value.status == status and set(err.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_http_round_trip_and_4xx(serve_url):
    import httpx
    from fastapi import FastAPI
    from ray import serve

    from tokenflow_ray.serve.images import ImageTokenizerDeployment, image_routes

    app_name = "tftrain-images"
    api = FastAPI()
    api.include_router(image_routes(lambda: serve.get_deployment_handle("ImageTokenizerDeployment", app_name)))

    @serve.deployment(ray_actor_options={"num_cpus": 0.1})
    @serve.ingress(api)
    class Front:
        def __init__(self, images) -> None:
            self.images = images  # keeps the tokenizer deployment in this app

    images = ImageTokenizerDeployment.options(ray_actor_options={"num_cpus": 0.1}).bind(
        limits=ImageLimits(max_bytes=64 << 10, max_pixels=128 * 128))
    try:  # serve.run inside: an app that failed to get healthy is deleted too, not left holding replicas
        serve.run(Front.bind(images), name=app_name, route_prefix="/tftrain")
        base = f"{serve_url}/tftrain/v1/images"
        with httpx.Client(timeout=60) as client:
            r = client.post(f"{base}/tokenize", json={"image": base64.b64encode(png_bytes()).decode()})
            assert r.status_code == 200, r.text
            tok = r.json()
            assert tok["scales"] == [1, 2, 4] and tok["size"] == [16, 16] and len(tok["indices"]) == 3
            r = client.post(f"{base}/detokenize", json={"indices": tok["indices"]})
            assert r.status_code == 200, r.text
            png = base64.b64decode(r.json()["image"])
            r = client.post(f"{base}/tokenize", json={"image": base64.b64encode(png).decode()})
            assert r.status_code == 200 and len(r.json()["indices"]) == 3  # the reconstruction tokenizes again

            bad = [({"image": base64.b64encode(b"garbage bytes").decode()}, "tokenize", 400),
                   ({"image": "%%% not base64"}, "tokenize", 400),
                   ({"image": base64.b64encode(png_bytes(side=200)).decode()}, "tokenize", 413),
                   ({"indices": [[[999999]]]}, "detokenize", 400),
                   ({}, "detokenize", 400)]
            for body, route, status in bad:
                r = client.post(f"{base}/{route}", json=body)
                assert r.status_code == status, (route, body.keys(), r.text)
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    finally:
        serve.delete(app_name)
