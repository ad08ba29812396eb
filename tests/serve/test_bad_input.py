"""Bad input over HTTP gets OpenAI-shaped 4xx, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

GOOD = {"model": "embedded", "prompt": "hi", "max_tokens": 3}


def _post(app, path: str, *, body: object = None, raw: bytes | None = None, headers: dict | None = None):
    h = dict(app.headers) if headers is None else headers
    if raw is not None:
        return httpx.post(app.base_url + path, content=raw, headers={**h, "content-type": "application/json"},
                          timeout=60)
    return httpx.post(app.base_url + path, json=body, headers=h, timeout=60)


CASES = [
    ("malformed json", dict(raw=b'{"model": "embedded", "prompt": '), 400, None),
    ("not an object", dict(raw=b"[1, 2]"), 400, None),
    ("max_tokens wrong type", dict(body={**GOOD, "max_tokens": "many"}), 400, "max_tokens"),
    ("temperature wrong type", dict(body={**GOOD, "temperature": [1]}), 400, "temperature"),
    ("negative rate", dict(body={**GOOD, "consumption_rate": -1}), 400, "consumption_rate"),
    ("NaN rate", dict(raw=b'{"model": "embedded", "prompt": "hi", "consumption_rate": NaN}'), 400,
     "consumption_rate"),
    ("infinite rate", dict(raw=b'{"model": "embedded", "prompt": "hi", "consumption_rate": Infinity}'), 400,
     "consumption_rate"),
    ("missing prompt", dict(body={"model": "embedded"}), 400, "prompt"),
    ("empty prompt", dict(body={**GOOD, "prompt": ""}), 400, "prompt"),
    ("token id out of vocab", dict(body={**GOOD, "prompt": [1, 10**6]}), 400, "prompt"),
    ("n > 1", dict(body={**GOOD, "n": 2}), 400, "n"),
    ("unknown model", dict(body={**GOOD, "model": "gpt-4o"}), 404, "model"),
    ("prompt too long", dict(body={**GOOD, "prompt": "a" * 3000}), 400, "prompt"),
    ("oversize body", dict(body={**GOOD, "prompt": "a" * (70 * 1024)}), 413, None),
    ("missing api key", dict(body=GOOD, headers={}), 401, None),
    ("wrong api key", dict(body=GOOD, headers={"Authorization": "Bearer wrong"}), 401, None),
    ("not bearer", dict(body=GOOD, headers={"Authorization": "Basic dGVzdA=="}), 401, None),
]


@pytest.mark.parametrize("name,kwargs,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_completion_request(app, name, kwargs, status, param):
    resp = _post(app, "/v1/completions", **kwargs)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


def test_bad_chat_and_report_requests(app):
    assert _post(app, "/v1/chat/completions", body={"model": "embedded", "messages": []}).status_code == 400
    bad_role = {"model": "embedded", "messages": [{"role": "wizard", "content": "x"}]}
    assert _post(app, "/v1/chat/completions", body=bad_role).status_code == 400
    for body in ({"rate": -2}, {"rate": "fast"}, {"consumed_tokens": -1}, {"paused": "yes"}, {"extra": 1}):
        resp = _post(app, "/v1/streams/cmpl-x/consumption", body=body)
        assert resp.status_code == 400 and "error" in resp.json(), body
    resp = _post(app, "/v1/streams/cmpl-unknown/consumption", body={"rate": 3})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "stream_not_found"
    assert httpx.get(app.base_url + "/v1/nothing-here").json()["error"]["type"] == "not_found_error"


def test_still_serving_after_bad_input(app):
    for _ in range(3):
        _post(app, "/v1/completions", raw=b"{nope")
    resp = _post(app, "/v1/completions", body=GOOD)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] <= 3
