"""Prefix caching in the engine (block_pool.py, engine/prefix_cache.py) over the fake runner, whose next token is a
function of the context read back from the KV slots the block tables name: a wrong, stale or shared-and-written
block changes the output. Integrity (ref counts, free lists, the key maps, no write to a shared block) is checked
after every step."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.factories import make_fake_engine as _make_fake_engine
from tests.engine.factories import run_to_completion
from tokenflow_ray.engine.block_pool import BlockIntegrityError, BlockPool, NoFreeBlocksError, block_keys
from tokenflow_ray.engine.plan import PENDING_TOKEN
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus


def make_fake_engine(**kwargs):
    return _make_fake_engine(**{"prefix_caching": True, **kwargs})


SYSTEM = [(7 * j) % 200 + 1 for j in range(37)]  # 4 full blocks of 8 and a partial one


def _run(engine, tokens=None):
    return run_to_completion(engine, tokens=tokens)


def _greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


# ---- the pool ---------------------------------------------------------------------------------------------------
def test_block_keys_chain_over_the_parent_and_stop_at_a_pending_token():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and a == block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_keys([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert b[1] != a[1]  # the same tokens after another parent: another key
    assert block_keys([5, 6, 7, 8], 4, parent=a[0]) == a[1:]
    assert len(block_keys([1, 2, 3, 4, 5, 6, PENDING_TOKEN, 8], 4)) == 1


def test_freed_cached_blocks_stay_findable_until_memory_needs_them():
    pool = BlockPool(4, 2, caching=True)
    a = pool.allocate(2)
    assert pool.cache(a[0], 11, (1, 2)) and pool.cache(a[1], 12, (3, 4))
    assert not pool.cache(a[1], 13, (3, 4))  # a block is cached under one key
    b = pool.allocate(1)
    assert not pool.cache(b[0], 11, (1, 2))  # a key is cached by one block: the first stays
    pool.free(reversed(a))
    assert (pool.num_free, pool.num_evictable, pool.num_cached) == (3, 2, 2)
    pool.check_integrity([b])
    assert pool.lookup([11, 12]) == a and pool.lookup([12]) == [a[1]] and pool.lookup([99, 12]) == []
    assert pool.lookup([11, 12], (1, 2, 3, 5)) == [a[0]]  # content compared: a collision is a miss
    pool.take(a[:1])
    assert pool.num_evictable == 1 and pool.refcount(a[0]) == 1
    pool.check_integrity([b, a[:1]])
    # Plain free blocks go first, then the least recently freed cached one.
    c = pool.allocate(1)
    assert c[0] not in a and pool.num_cached == 2
    d = pool.allocate(1)
    assert d == [a[1]] and pool.num_cached == 1 and pool.evictions == 1 and pool.lookup([11, 12]) == [a[0]]
    pool.check_integrity([b, a[:1], c, d])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    with pytest.raises(BlockIntegrityError):
        pool.take(c)  # holds no cached content
    pool.free(a[:1])
    pool.take(a[:1])
    pool.incref(a[:1])
    with pytest.raises(BlockIntegrityError):
        pool.check_integrity([b, a[:1], c, d])  # two refs, one owner


def test_a_pool_without_caching_caches_nothing():
    pool = BlockPool(4, 2)
    a = pool.allocate(1)
    assert not pool.cache(a[0], 5, (1, 2)) and pool.lookup([5]) == []
    pool.free(a)
    assert pool.num_evictable == 0 and pool.num_free == 4


# ---- the engine -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_conversation_turns_reuse_the_previous_turns_kv_and_match_caching_off(overlap):
    outputs = {}
    for caching in (False, True):
        engine, runner = make_fake_engine(num_blocks=64, block_size=8, prefix_caching=caching, overlap=overlap)
        history: list[int] = []
        got = []
        for turn in range(4):
            prompt = SYSTEM + history + [200 + turn] * 5
            sid = engine.add_request(prompt, _greedy(9), stream_id=f"t{turn}")
            out = _run(engine)[sid]
            assert out == runner.reference(prompt, 9)
            got.append(out)
            history += [200 + turn] * 5 + out
        stats = engine.scheduler.prefix_stats
        outputs[caching] = got
        if caching:
            # Turn 2 on: the whole previous turn (prompt and output, full blocks) is a hit.
            assert stats.prompt_hit_tokens > 0.6 * (stats.prompt_tokens - len(SYSTEM) - 5)
            assert stats.prompt_hit_tokens % 8 == 0
        else:
            assert stats.prompt_hit_tokens == 0 and engine.pool.num_cached == 0
    assert outputs[True] == outputs[False]


def test_live_streams_share_a_system_prompt_and_never_write_a_shared_block():
    engine, runner = make_fake_engine(num_blocks=64, block_size=8, max_num_seqs=8)
    first = engine.add_request(SYSTEM + [201], _greedy(30), stream_id="first")
    tokens: dict[str, list[int]] = {}
    for _ in range(3):  # the system prompt's blocks are computed and cached
        for out in engine.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
        engine.check_integrity()
    prompts = {first: SYSTEM + [201]}
    for i in range(5):
        prompts[f"s{i}"] = SYSTEM + [210 + i] * (i + 1)
        engine.add_request(prompts[f"s{i}"], _greedy(12), stream_id=f"s{i}")
    for out in engine.step():
        tokens.setdefault(out.stream_id, []).extend(out.token_ids)
    engine.check_integrity()  # checks that every block a running stream writes next has one owner
    shared = engine.scheduler.streams["s0"].block_ids[:4]
    assert all(engine.pool.refcount(b) == 6 for b in shared)  # 4 full system blocks, six owners
    # The partial fifth block is each stream's own.
    fifth = {engine.scheduler.streams[s].block_ids[4] for s in prompts}
    assert len(fifth) == 6
    _run(engine, tokens)
    for sid, prompt in prompts.items():
        assert tokens[sid] == runner.reference(prompt, 30 if sid == first else 12)
    assert engine.scheduler.prefix_stats.prompt_hit_tokens == 5 * 32


def test_a_prompt_cached_to_its_last_block_still_computes_its_last_token():
    engine, runner = make_fake_engine(num_blocks=32, block_size=8)
    prompt = SYSTEM[:32]  # exactly 4 blocks
    a = engine.add_request(prompt, _greedy(1))
    _run(engine)
    b = engine.add_request(prompt, _greedy(6))
    tokens = _run(engine)
    assert tokens[b] == runner.reference(prompt, 6)
    assert engine.scheduler.streams == {} and engine.scheduler.prefix_stats.prompt_hit_tokens == 24
    assert a != b


def test_cached_blocks_are_evicted_least_recent_first_when_memory_is_needed():
    engine, runner = make_fake_engine(num_blocks=12, block_size=8)
    old = [(3 * j) % 100 + 1 for j in range(40)]  # 5 blocks
    new = [(5 * j) % 100 + 2 for j in range(40)]
    for prompt in (old, new):
        engine.add_request(prompt, _greedy(1))
        _run(engine)
    assert engine.pool.num_cached == 10 and engine.pool.num_free == 12
    # A stream of 64 tokens needs 8+ blocks: 2 plain free, then cached ones, the oldest prompt's first.
    big = [(11 * j) % 100 + 3 for j in range(60)]
    sid = engine.add_request(big, _greedy(4))
    assert _run(engine)[sid] == runner.reference(big, 4)
    assert engine.pool.evictions >= 6
    again = engine.add_request(new, _greedy(3))
    assert _run(engine)[again] == runner.reference(new, 3)
    hits = engine.scheduler.prefix_stats.prompt_hit_tokens
    assert hits > 0  # the newer prompt kept some of its blocks ...
    before = hits
    old_again = engine.add_request(old, _greedy(3))
    assert _run(engine)[old_again] == runner.reference(old, 3)
    assert engine.scheduler.prefix_stats.prompt_hit_tokens - before < 40  # ... the older lost some


@pytest.mark.parametrize("resume_mode", ["load", "recompute"])
def test_a_paused_stream_resumes_through_its_own_cached_blocks(resume_mode):
    engine, runner = make_fake_engine(num_blocks=64, block_size=8, num_host_blocks=64, policy="tokenflow",
                                      resume_mode=resume_mode)
    prompt = SYSTEM + [250] * 3  # 40 tokens: 5 full blocks
    sid = engine.add_request(prompt, _greedy(20), stream_id="s")
    plans = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: plans.append(plan) or execute(plan)
    tokens: dict[str, list[int]] = {}
    for _ in range(6):
        for out in engine.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
        engine.check_integrity()
    stream = engine.scheduler.streams[sid]
    computed_blocks = stream.num_computed_tokens // 8
    assert engine.scheduler.preempt(sid, engine.clock.now(), to_host=True)
    engine.step()
    engine.check_integrity()
    assert stream.status in (StreamStatus.PREEMPTED, StreamStatus.RUNNING, StreamStatus.LOADING)
    _run(engine, tokens)
    assert tokens[sid] == runner.reference(prompt, 20)
    stats = engine.scheduler.prefix_stats
    assert stats.hit_tokens_device >= 8 * computed_blocks  # its full blocks were found, not loaded or recomputed
    loaded = sum(len(p.swap_in) for p in plans)
    assert loaded <= 1  # at most its partial tail block came back from the host
    assert stream.num_recomputed_tokens <= 8


def test_caching_off_by_the_flag_reuses_nothing():
    engine, runner = make_fake_engine(num_blocks=64, block_size=8, prefix_caching=False)
    for i in range(3):
        sid = engine.add_request(SYSTEM + [i + 1], _greedy(4))
        assert _run(engine)[sid] == runner.reference(SYSTEM + [i + 1], 4)
    assert engine.scheduler.prefix_stats.prompt_hit_tokens == 0 and engine.pool.num_cached == 0


# ---- random interleavings ----------------------------------------------------------------------------------------
op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 5), st.integers(1, 24), st.integers(1, 20)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0)),
    st.tuples(st.just("preempt"), st.integers(0, 50), st.booleans(), st.just(0)),
)
PREFIXES = [SYSTEM[:k] for k in (0, 8, 16, 20, 37)] + [[9] * 24]


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op, min_size=1, max_size=50), num_blocks=st.integers(8, 28), host=st.sampled_from([0, 16, 48]),
       overlap=st.booleans(), policy=st.sampled_from(["fcfs", "tokenflow"]))
def test_random_interleavings_keep_invariants_and_outputs(ops, num_blocks, host, overlap, policy):
    """Shared prefixes under add, finish, abort, preempt (to the host or to recompute) and eviction by a small pool:
    every output is the unbatched reference's, and integrity holds after every call."""
    engine, runner = make_fake_engine(num_blocks=num_blocks, block_size=8, max_num_seqs=6, num_host_blocks=host,
                                      max_num_batched_tokens=32, policy=policy, overlap=overlap)
    prompts: dict[str, tuple[list[int], int]] = {}
    tokens: dict[str, list[int]] = {}
    aborted: set[str] = set()
    rng = random.Random(len(ops))
    for kind, a, b, c in ops:
        if kind == "add":
            prompt = PREFIXES[a] + [rng.randrange(1, 200) for _ in range(b)]
            try:
                sid = engine.add_request(prompt, _greedy(c))
            except ValueError:
                continue  # too long for this pool: refused cleanly
            prompts[sid] = (prompt, c)
        elif kind == "step":
            for _ in range(a):
                for out in engine.step():
                    tokens.setdefault(out.stream_id, []).extend(out.token_ids)
                engine.check_integrity()
        else:
            live = sorted(engine.scheduler.streams)
            if not live:
                continue
            sid = live[a % len(live)]
            if kind == "abort":
                if engine.abort(sid):
                    aborted.add(sid)
            else:
                engine.scheduler.preempt(sid, engine.clock.now(), to_host=b)
        engine.check_integrity()
    _run(engine, tokens)
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks
    cap = engine.max_total_tokens
    for sid, (prompt, n) in prompts.items():
        if sid not in aborted:
            assert tokens.get(sid, []) == runner.reference(prompt, min(n, cap - len(prompt))), sid


def test_the_stream_records_what_its_prompt_found_in_the_cache():
    engine, _ = make_fake_engine(num_blocks=64, block_size=8)
    a = engine.add_request(SYSTEM + [1], _greedy(2))
    _run(engine)
    streams = {}
    real_finish = engine.scheduler.finish
    engine.scheduler.finish = lambda sid, status, now: streams.setdefault(sid, real_finish(sid, status, now))
    b = engine.add_request(SYSTEM + [2], _greedy(2))
    _run(engine)
    assert streams[b].num_cached_tokens == 32 and a != b
    assert dataclasses.asdict(engine.scheduler.prefix_stats)["prompt_hit_tokens"] == 32


# ---- the host tier ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "tokenflow"])
def test_a_prefix_evicted_from_the_device_is_loaded_back_from_the_host(policy):
    engine, runner = make_fake_engine(num_blocks=12, block_size=8, num_host_blocks=64, policy=policy)
    plans = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: plans.append(plan) or execute(plan)
    prompt = SYSTEM + [250] * 3  # 40 tokens: 5 blocks
    engine.add_request(prompt, _greedy(10))  # decodes long enough for write-through to mirror the fifth
    _run(engine)
    assert engine.scheduler.kv.host.num_cached >= 5  # written through as they filled, for any policy
    big = [(11 * j) % 100 + 3 for j in range(90)]  # all 12 device blocks: evicts every cached one
    engine.add_request(big, _greedy(4))
    _run(engine)
    assert engine.pool.lookup(block_keys(prompt, 8)) == []
    plans.clear()
    again = engine.add_request(prompt + [5, 6], _greedy(6))
    assert _run(engine)[again] == runner.reference(prompt + [5, 6], 6)
    stats = engine.scheduler.prefix_stats
    assert stats.hit_tokens_host == 40 and stats.prompt_hit_tokens == 40
    assert sum(len(p.swap_in) for p in plans) == 5  # loaded, not computed
    assert sum(len(c.token_ids) for p in plans for c in p.prefills) <= 2


def test_the_host_tier_off_by_its_flag_computes_the_evicted_prefix_again():
    engine, runner = make_fake_engine(num_blocks=12, block_size=8, num_host_blocks=64, policy="tokenflow")
    engine.config = dataclasses.replace(engine.config, cache=dataclasses.replace(engine.config.cache,
                                                                                 host_prefix_caching=False))
    engine.scheduler.kv.host.caching = False  # what the flag builds (Scheduler.__init__)
    prompt = SYSTEM + [250] * 3
    engine.add_request(prompt, _greedy(2))
    _run(engine)
    engine.add_request([(11 * j) % 100 + 3 for j in range(80)], _greedy(4))
    _run(engine)
    again = engine.add_request(prompt + [5], _greedy(3))
    assert _run(engine)[again] == runner.reference(prompt + [5], 3)
    assert engine.scheduler.prefix_stats.hit_tokens_host == 0 and engine.scheduler.kv.host.num_cached == 0


def test_write_through_shares_a_block_the_host_holds_already():
    engine, runner = make_fake_engine(num_blocks=64, block_size=8, num_host_blocks=64, policy="tokenflow")
    a = engine.add_request(SYSTEM + [1], _greedy(3))
    b = engine.add_request(SYSTEM + [2], _greedy(3))  # same 4 full blocks, computed side by side
    tokens = _run(engine)
    assert tokens[a] == runner.reference(SYSTEM + [1], 3) and tokens[b] == runner.reference(SYSTEM + [2], 3)
    host = engine.scheduler.kv.host
    assert host.num_cached == 4 + 0  # one host copy of each shared block
