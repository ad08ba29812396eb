"""The real openai SDK against the app: streaming chat and completions, non-streaming, errors as SDK exceptions."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key=app.api_key, max_retries=0, timeout=60)


def test_chat_stream_with_consumption_rate(client):
    stream = client.chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"consumption_rate": 20, "ignore_eos": True})
    chunks = list(stream)
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_matches_non_stream(client):
    kwargs = dict(model="embedded", prompt="Once upon a time", max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].text == streamed  # greedy: the same tokens either way
    assert whole.usage.completion_tokens <= 10 and whole.usage.prompt_tokens > 0


def test_chat_non_stream_and_models(client):
    resp = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=5, temperature=0.7, top_p=0.9, seed=3)
    assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens <= 5
    assert [m.id for m in client.models.list()] == ["embedded"]


def test_stop_string_is_not_returned(client):
    base = client.completions.create(model="embedded", prompt="abc", max_tokens=12, temperature=0)
    text = base.choices[0].text
    if len(text) < 4:
        pytest.skip("greedy output too short to pick a stop string")
    stop = text[2:4]
    cut = client.completions.create(model="embedded", prompt="abc", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_errors_are_sdk_exceptions(client, app):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="embedded", prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"consumption_rate": -1})
    wrong = openai.OpenAI(base_url=app.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(app.base_url + "/health").json() == {"status": "ok"}
