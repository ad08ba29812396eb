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


def test_a_conversation_reuses_its_cached_prefix(client):
    """Prefix caching over HTTP: a repeated prompt and the next turn of a conversation report the prompt tokens the
    cache served (usage.prompt_tokens_details.cached_tokens, whole 16-token blocks), and greedy text is the same
    as computed from nothing."""
    import uuid

    system = f"Session {uuid.uuid4().hex}. " + "You answer briefly and you never repeat the question. " * 8
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    kwargs = dict(model="embedded", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(messages=turn, **kwargs)
    prompt = first.usage.prompt_tokens
    assert prompt > 64 and first.usage.prompt_tokens_details.cached_tokens == 0  # a new session id: nothing cached
    again = client.chat.completions.create(messages=turn, **kwargs)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16  # its last token computed
    follow = turn + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And another one?"}]
    chunks = list(client.chat.completions.create(messages=follow, stream=True, stream_options={"include_usage": True},
                                                 **kwargs))
    usage = chunks[-1].usage
    assert usage.prompt_tokens > prompt
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and prompt - 32 <= cached < usage.prompt_tokens  # at least the first turn, bar its tail


def test_the_conversation_workload_reuses_history_through_the_cache(app):
    """`tokenflow bench peer --workload conversations`'s client, small, against the app: closed-loop turns, each
    later turn's prompt mostly served from the cache (system prompt and history), TTFT timed for every turn."""
    import asyncio

    from tokenflow_ray.lab.peer.conversations import ConversationWorkload, run_conversations

    wl = ConversationWorkload(conversations=3, turns=3, system_len=256, user_len=24, max_tokens=8, stagger_s=0.1,
                              think_s=0.05, seed=7)
    result = asyncio.run(run_conversations(app.base_url, wl, api_key=app.api_key, timeout_s=120))
    s = result.summary()
    assert s["turns"] == s["complete"] == 9 and s["errors"] == 0
    assert [(t.conversation, t.turn) for t in result.turns] == [(c, k) for c in range(3) for k in range(3)]
    assert all(t.completion_tokens == 8 and t.ttft_s > 0 for t in result.turns)
    assert all(t.prompt_tokens <= wl.max_prompt_len for t in result.turns)
    assert s["later_cached_share"] > 0.7  # the system prompt and the history: all but each turn's new lines
    assert s["later_ttft_p50_s"] is not None and s["first_turn_ttft_p50_s"] is not None
