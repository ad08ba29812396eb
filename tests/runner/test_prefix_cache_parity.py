"""Prefix caching on a real model: greedy outputs token-identical to HF `generate` and to the engine with caching
off, over prompts that share prefixes (a system prompt, a conversation's earlier turns, partial blocks), with
hits on the device and, past a small pool, loaded back from the host store; integrity after every step."""

from __future__ import annotations

import random

import pytest

from tests.runner.test_parity import NEW_TOKENS, _hf_reference_cached
from tokenflow_ray.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.runner.factory import build_engine


def _shared_prompts(seed: int = 1) -> list[list[int]]:
    """(Seed 1: no greedy step of these prompts picks EOS, which HF's min_new_tokens would mask and ignore_eos
    does not.) Two rounds: a system prompt of 21 tokens (two full 8-token blocks and a partial one) before each of four
    questions; then each conversation's next turn (its first prompt plus a reply and a new question)."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(21)]
    first = [system + [rng.randrange(256) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    second = [p + [rng.randrange(256) for _ in range(rng.randint(10, 30))] for p in first]
    return first + second


def _engine(model_dir, caching: bool, device_blocks: int, host_blocks: int, policy: str):
    return build_engine(EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=8, num_device_blocks=device_blocks, num_host_blocks=host_blocks,
                          enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, policy=policy)))


def _run_rounds(engine, rounds: list[list[list[int]]]) -> list[list[int]]:
    """Each round's prompts added together and run to the end before the next round starts (so the second finds
    the first's blocks cached), integrity after every step."""
    sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    out: list[list[int]] = []
    for prompts in rounds:
        ids = [engine.add_request(p, sp, rate=5.0) for p in prompts]
        tokens: dict[str, list[int]] = {}
        for _ in range(5000):
            if not engine.has_unfinished():
                break
            for o in engine.step():
                tokens.setdefault(o.stream_id, []).extend(o.token_ids)
            engine.check_integrity()
        out.extend(tokens[i] for i in ids)
    return out


@pytest.mark.parametrize("case", ["device", "host", "tokenflow_host"])
def test_shared_prefixes_match_hf_with_caching_on_and_off(tiny_llama_dir, case):
    """device: a pool that keeps the first round cached; host: a pool of 24 blocks, so the first round's blocks
    are evicted from the device and the second round loads them from the host store (write-through put them
    there); tokenflow_host: the same under the paced policy, which pauses and resumes streams."""
    prompts = _shared_prompts()
    rounds = [prompts[:4], prompts[4:]]
    refs = _hf_reference_cached(str(tiny_llama_dir), tuple(map(tuple, prompts)))
    policy = "tokenflow" if case.startswith("tokenflow") else "fcfs"
    device_blocks = 256 if case == "device" else 24
    off = _engine(tiny_llama_dir, False, device_blocks, 256, policy)
    assert _run_rounds(off, rounds) == refs
    on = _engine(tiny_llama_dir, True, device_blocks, 256, policy)
    assert _run_rounds(on, rounds) == refs
    stats = on.scheduler.prefix_stats
    assert stats.prompt_hit_tokens_device >= 3 * 16  # the system prompt's full blocks, at least for 3 of 4
    if case == "device":
        assert stats.prompt_hit_tokens_host == 0
        # Round two: each conversation's first turn (as far as its full blocks go) was still cached.
        assert stats.prompt_hit_tokens_device >= sum(len(p) // 8 * 8 for p in prompts[:4]) - 4 * 8
    else:
        assert stats.prompt_hit_tokens_host > 0 and on.scheduler.bytes_from_host > 0
    assert off.scheduler.prefix_stats.prompt_hit_tokens == 0
    assert on.pool.num_free == on.pool.num_blocks  # every block back (cached ones count as free)
