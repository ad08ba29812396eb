"""Prompt token ids for requests that carry lengths but no text (synthetic workloads, replayed traces): distinct
per request unless the workload says which prefixes repeat (Mooncake's `hash_ids`), so that prefix caching finds
exactly the sharing the workload has, no more (a fixed filler prompt would make every request a hit).
"""

from __future__ import annotations

HASH_CHUNK_TOKENS = 512  # Mooncake: one hash id per 512 prompt tokens
_TAG_TOKENS = 4  # a chunk's first tokens: its kind and its id's digits


def distinct_prompt(index: int, length: int, vocab: int = 200) -> list[int]:
    """Token ids in [1, vocab) for a real model: the first three name the request (distinct for (vocab - 1)³
    requests), the rest a pattern."""
    v = vocab - 1
    head = [1 + index % v, 1 + (index // v) % v, 1 + (index // v ** 2) % v]
    return (head + [1 + (index + k) % v for k in range(3, length)])[:length]


def _chunk(kind: int, ident: int, n: int, vocab: int) -> tuple[int, ...]:
    digits, v = [kind], vocab - 1
    for _ in range(_TAG_TOKENS - 1):
        digits.append(1 + ident % v)
        ident //= v
    return (tuple(digits) + (1,) * n)[:n]


def sim_prompt(index: int, length: int, hash_ids: tuple[int, ...] = (), vocab: int = 32_000,
               chunk_tokens: int = HASH_CHUNK_TOKENS) -> tuple[int, ...]:
    """The simulator's prompt (ids in [1, vocab)): chunk c of `chunk_tokens` starts with a tag of hash id c, so
    equal ids give equal tokens and, where their prefixes agree too, equal block keys; the tokens past the ids
    start with a tag of the request's own (block keys chain, so a distinct first block makes every later one
    distinct)."""
    parts: list[tuple[int, ...]] = []
    done = 0
    for h in hash_ids:
        n = min(chunk_tokens, length - done)
        if n <= 0:
            break
        parts.append(_chunk(2, h, n, vocab))
        done += n
    if done < length:
        parts.append(_chunk(1, index, length - done, vocab))
    return parts[0] if len(parts) == 1 else tuple(t for part in parts for t in part)
