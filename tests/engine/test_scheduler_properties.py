"""Property test: random add / step / abort sequences never leak, double-own or corrupt a block."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.sampling import SamplingParams

op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op, min_size=1, max_size=40), num_blocks=st.integers(6, 24),
       budget=st.sampled_from([16, 32, 64]), chunked=st.booleans())
def test_random_operations_keep_invariants(ops, num_blocks, budget, chunked):
    engine, runner = make_fake_engine(num_blocks=num_blocks, block_size=8, max_num_seqs=8,
                                      max_num_batched_tokens=budget, chunked_prefill=chunked)
    live: list[str] = []
    prompts: dict[str, tuple[list[int], int]] = {}
    tokens: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for kind, a, b in ops:
        if kind == "add":
            prompt = [(a * 13 + j) % 250 + 1 for j in range(a)]
            try:
                sid = engine.add_request(prompt, SamplingParams(max_tokens=b))
            except ValueError:
                continue  # too long for this pool: rejected cleanly
            live.append(sid)
            prompts[sid] = (prompt, b)
        elif kind == "step":
            for _ in range(a):
                for out in engine.step():
                    tokens.setdefault(out.stream_id, []).extend(out.token_ids)
                engine.check_integrity()
        elif live:
            sid = live[a % len(live)]
            if engine.abort(sid):
                aborted.add(sid)
        engine.check_integrity()
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
        engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.pool.num_free == engine.pool.num_blocks
    cap = engine.max_total_tokens
    for sid, (prompt, max_tokens) in prompts.items():
        if sid in aborted:
            continue
        expected = runner.reference(prompt, min(max_tokens, cap - len(prompt)))
        assert tokens.get(sid, []) == expected
