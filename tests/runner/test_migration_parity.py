"""Real KV migration between two torch engines: a stream moved mid-generation (its host KV blocks through
pickling, as through Ray's object store) continues token for token: greedy equals HF, and a seeded sampled
stream equals the same stream run without moving, its generator state carried along."""

from __future__ import annotations

import pickle

import pytest

from tests.runner.test_parity import NEW_TOKENS, _hf_reference_cached, _prompts
from tests.runner.test_spill import _engine
from tokenflow_ray.engine.sampling import SamplingParams


def _run(engines, tokens, steps=None):
    for _ in range(steps or 5000):
        if not any(e.has_unfinished() for e in engines):
            return
        for engine in engines:
            if engine.has_unfinished():
                for out in engine.step():
                    tokens.setdefault(out.stream_id, []).extend(out.token_ids)
                engine.check_integrity()
    assert steps is not None, "engines did not finish"


def _move(src, dst, sid, tokens):
    src.begin_export(sid)
    for _ in range(50):
        exported = src.try_export(sid)
        if exported is not None:
            break
        _run([src], tokens, steps=1)
    else:
        raise AssertionError("never exportable")
    dst.import_stream(pickle.loads(pickle.dumps(exported)))
    return exported


@pytest.mark.parametrize("overlap_scheduling", [False, True])
def test_migrated_greedy_streams_match_hf(tiny_llama_dir, overlap_scheduling):
    prompts = _prompts()
    refs = _hf_reference_cached(str(tiny_llama_dir), tuple(map(tuple, prompts)))
    src = _engine(tiny_llama_dir, overlap_scheduling=overlap_scheduling)
    dst = _engine(tiny_llama_dir, overlap_scheduling=overlap_scheduling)
    sp = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [src.add_request(p, sp) for p in prompts]
    tokens: dict[str, list[int]] = {}
    _run([src], tokens, steps=4)
    moved = [_move(src, dst, sid, tokens) for sid in ids[::2]]
    assert all(e.num_kv_tokens > 0 for e in moved)  # the KV travelled
    _run([src, dst], tokens)
    assert [tokens[i] for i in ids] == refs
    assert dst.scheduler.bytes_from_host > 0 and all(r.tokens_recomputed == 0 for r in dst.finished_records)
    for e in (src, dst):
        assert e.pool.num_free == e.pool.num_blocks and e.scheduler.kv.host.num_free == e.scheduler.kv.host.num_blocks


def test_migrated_seeded_sampling_matches_the_unmoved_run(tiny_llama_dir):
    prompts = _prompts()[:3]
    sps = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
           for i in range(len(prompts))]
    alone = _engine(tiny_llama_dir)
    ref_ids = [alone.add_request(p, sp) for p, sp in zip(prompts, sps)]
    ref: dict[str, list[int]] = {}
    _run([alone], ref)
    src, dst = _engine(tiny_llama_dir), _engine(tiny_llama_dir)
    ids = [src.add_request(p, sp) for p, sp in zip(prompts, sps)]
    tokens: dict[str, list[int]] = {}
    _run([src], tokens, steps=5)
    exported = _move(src, dst, ids[1], tokens)
    assert exported.sampler_state is not None
    _run([src, dst], tokens)
    assert [tokens[i] for i in ids] == [ref[i] for i in ref_ids]
    assert len(set(map(tuple, tokens.values()))) == len(ids)  # sampled, not one greedy answer
