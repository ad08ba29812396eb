"""The multi-turn chat workload of `tokenflow bench peer --workload conversations`: N conversations of T turns behind
one shared system prompt, each turn's prompt the conversation so far (every earlier user message and the reply the
server actually gave) plus a new user message, through the real `openai` client.

A conversation is closed-loop: turn k+1 is sent `think_s` after turn k's reply ended, so what a prefix cache can
reuse is exactly what a chat service would have (the system prompt across conversations, the history within one).
The conversations start `stagger_s` apart. The prompt is plain text for the completions route (`System:`,
`User:`, `Assistant:` lines), so both servers tokenize the same bytes without a chat template; the byte-level
tokenizer makes one ASCII character one token. TTFT is timed here, from the request to the first streamed text;
`cached_tokens` is what each server reports in the final chunk's usage (`prompt_tokens_details`; vLLM reports it
with `--enable-prompt-tokens-details`).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import string
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from tokenflow_ray.lab.peer.systems_table import systems_table

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ConversationWorkload:
    conversations: int = 32
    turns: int = 4
    system_len: int = 1024  # the shared system prompt, tokens
    user_len: int = 48  # each user message, tokens
    max_tokens: int = 32  # each reply (exact: ignore_eos)
    stagger_s: float = 0.25  # conversation i starts at i x this
    think_s: float = 0.5  # between a reply's end and the next turn
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_len", "user_len", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.conversations > 256:
            raise ValueError(f"conversations: at most 256 at once on loopback, got {self.conversations}")
        if self.stagger_s < 0 or self.think_s < 0:
            raise ValueError("stagger_s, think_s: must be >= 0")

    @property
    def max_prompt_len(self) -> int:
        """The last turn's prompt at most: the system prompt and every turn's lines (replies of max_tokens bytes;
        a reply of multi-byte characters is still max_tokens tokens on a byte-level tokenizer)."""
        per_turn = len("\nUser: ") + self.user_len + len("\nAssistant:") + self.max_tokens
        return len("System: ") + self.system_len + self.turns * per_turn

    def system_prompt(self) -> str:
        return "System: " + _words(f"{self.seed}:system", self.system_len)

    def user_message(self, conversation: int, turn: int) -> str:
        return _words(f"{self.seed}:user:{conversation}:{turn}", self.user_len)


def _words(key: str, length: int) -> str:
    rng = random.Random(key)
    text = ""
    while len(text) < length:
        text += ("" if not text else " ") + "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8)))
    return text[:length]


@dataclass
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class ConversationResult:
    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        """TTFT of first turns and of later ones (mean, p50, P99), the cached share of later turns' prompts as the
        server reported it, and the errors."""
        ok = [t for t in self.turns if t.error is None and t.ttft_s is not None]
        first = [t.ttft_s for t in ok if t.turn == 0]
        later = [t for t in ok if t.turn > 0]
        later_ttft = [t.ttft_s for t in later]
        prompt_later = sum(t.prompt_tokens for t in later)
        return {"turns": len(self.turns), "complete": len(ok), "errors": sum(t.error is not None for t in self.turns),
                "first_turn_ttft_p50_s": _quantile(first, 0.5), "first_turn_ttft_p99_s": _quantile(first, 0.99),
                "later_ttft_mean_s": statistics.fmean(later_ttft) if later_ttft else None,
                "later_ttft_p50_s": _quantile(later_ttft, 0.5), "later_ttft_p99_s": _quantile(later_ttft, 0.99),
                "later_prompt_tokens": prompt_later, "later_cached_tokens": sum(t.cached_tokens for t in later),
                "later_cached_share": sum(t.cached_tokens for t in later) / prompt_later if prompt_later else None,
                "completion_tokens": sum(t.completion_tokens for t in ok), "wall_s": self.wall_s}

    def to_dict(self) -> dict:
        return {"summary": self.summary(), "turns": [asdict(t) for t in self.turns]}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # nearest rank: P99 of 96 turns is the max


async def _conversation(client, model: str, wl: ConversationWorkload, index: int, start: float,
                        out: list[TurnResult], timeout_s: float) -> None:
    await asyncio.sleep(max(0.0, start + index * wl.stagger_s - time.monotonic()))
    history = wl.system_prompt()
    for turn in range(wl.turns):
        prompt = f"{history}\nUser: {wl.user_message(index, turn)}\nAssistant:"
        result = TurnResult(index, turn)
        out.append(result)
        sent = time.monotonic()
        reply = []
        try:
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=wl.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=timeout_s)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    if result.ttft_s is None:
                        result.ttft_s = time.monotonic() - sent
                    reply.append(chunk.choices[0].text)
                if chunk.usage is not None:
                    result.prompt_tokens = chunk.usage.prompt_tokens
                    result.completion_tokens = chunk.usage.completion_tokens
                    details = chunk.usage.prompt_tokens_details
                    result.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
        except Exception as exc:  # a failed turn ends its conversation; the others go on
            result.error = f"{type(exc).__name__}: {exc}"[:200]
            return
        result.latency_s = time.monotonic() - sent
        history = f"{prompt}{''.join(reply)}"
        await asyncio.sleep(wl.think_s)


async def run_conversations(base_url: str, wl: ConversationWorkload, *, model: str = "embedded",
                            api_key: str = "-", timeout_s: float = 300.0) -> ConversationResult:
    """Every conversation of `wl` against the server at `base_url` (loopback only), bounded by `timeout_s` in
    all; turns still running then are recorded as timed out."""
    import openai

    host = urlparse(base_url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"base_url: the load generator only targets loopback hosts, got {host!r}")
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0)
    turns: list[TurnResult] = []
    start = time.monotonic()
    tasks = [asyncio.create_task(_conversation(client, model, wl, i, start, turns, timeout_s))
             for i in range(wl.conversations)]
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in turns:
            if t.latency_s is None and t.error is None:
                t.error = "timeout"
    finally:
        await client.close()
    turns.sort(key=lambda t: (t.conversation, t.turn))
    return ConversationResult(turns, time.monotonic() - start)


def print_conversations(report: dict) -> str:
    """`tokenflow bench peer --workload conversations`'s table: TTFT of first and later turns, the cached share."""
    w, kv = report["workload"], report["kv"]
    return systems_table(
        f"conversations: {w['conversations']} x {w['turns']} turns behind a {w['system_len']}-token system prompt, "
        f"KV {kv['ours_bytes'] / 2**20:.1f} MiB (ours, + host store) / {kv['vllm_bytes'] / 2**20:.1f} MiB (vLLM)",
        [("turn 1 TTFT p50 (s)", "first_turn_ttft_p50_s", ".3f"), ("later TTFT p50 (s)", "later_ttft_p50_s", ".3f"),
         ("later TTFT p99 (s)", "later_ttft_p99_s", ".3f"), ("later mean (s)", "later_ttft_mean_s", ".3f"),
         ("cached share", "later_cached_share", ".1%")],
        report["systems"], lambda p: f"{p['complete']}/{p['turns']}")
