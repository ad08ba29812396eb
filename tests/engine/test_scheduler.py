"""Scheduler behaviour on the fake runner: batching, chunked prefill, preemption, stop conditions, accounting."""

import pytest

from tests.engine.factories import make_fake_engine, run_to_completion
from tokenflow_ray.engine.config import SchedulerConfig
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus


def _prompt(i: int, n: int) -> list[int]:
    return [(i * 31 + j * 7) % 200 + 1 for j in range(n)]


@pytest.mark.parametrize("chunked", [True, False])
def test_batched_outputs_equal_unbatched_reference(chunked):
    engine, runner = make_fake_engine(num_blocks=128, max_num_batched_tokens=48, chunked_prefill=chunked)
    prompts = {engine.add_request(_prompt(i, 5 + 9 * i), SamplingParams(max_tokens=12 + i)): (i, _prompt(i, 5 + 9 * i))
               for i in range(5)}
    tokens = run_to_completion(engine)
    for sid, (i, prompt) in prompts.items():
        assert tokens[sid] == runner.reference(prompt, 12 + i)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_chunked_prefill_respects_token_budget():
    engine, _ = make_fake_engine(num_blocks=64, max_num_batched_tokens=16, max_num_seqs=8)
    engine.add_request(_prompt(0, 40), SamplingParams(max_tokens=3))
    plan = engine.scheduler.schedule(0.0)
    assert plan.num_tokens == 16 and not plan.prefills[0].sample
    engine.runner.execute(plan)  # keep the fake KV consistent
    engine.scheduler.update(plan, engine.runner.execute(plan), 0.0)


def test_requests_join_mid_batch():
    engine, runner = make_fake_engine(num_blocks=64)
    first = engine.add_request(_prompt(1, 6), SamplingParams(max_tokens=20))
    tokens: dict[str, list[int]] = {}
    late = None
    for step in range(200):
        if step == 5:
            late = engine.add_request(_prompt(2, 11), SamplingParams(max_tokens=7))
        for out in engine.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
        engine.check_integrity()
        if step > 5 and not engine.has_unfinished():
            break
    assert tokens[first] == runner.reference(_prompt(1, 6), 20)
    assert tokens[late] == runner.reference(_prompt(2, 11), 7)


def test_memory_pressure_preempts_newest_and_output_is_unchanged():
    # 6 streams that each grow to 4 blocks, in a 12-block pool: recompute preemption must happen.
    engine, runner = make_fake_engine(num_blocks=12, block_size=8, max_num_batched_tokens=64)
    ids = {engine.add_request(_prompt(i, 10), SamplingParams(max_tokens=20)): _prompt(i, 10) for i in range(6)}
    plans = []
    execute = runner.execute
    runner.execute = lambda plan: plans.append(plan) or execute(plan)
    tokens = run_to_completion(engine)
    assert sum(len(p.preempted) for p in plans) > 0
    for sid, prompt in ids.items():
        assert tokens[sid] == runner.reference(prompt, 20)
    assert engine.pool.num_free == 12


def test_preemption_is_counted_and_victim_is_newest():
    engine, _ = make_fake_engine(num_blocks=6, block_size=8, max_num_batched_tokens=64)
    old = engine.add_request(_prompt(0, 15), SamplingParams(max_tokens=30))
    engine.clock.advance(1.0)
    new = engine.add_request(_prompt(1, 15), SamplingParams(max_tokens=30))
    preempted = []
    for _ in range(200):
        plan = engine.scheduler.schedule(engine.clock.now())
        preempted.extend(plan.preempted)
        res = engine.runner.execute(plan)
        engine.scheduler.update(plan, res, engine.clock.now())
        engine.check_integrity()
        if not engine.has_unfinished():
            break
    assert preempted and preempted[0] == new and old not in preempted[:1]


def test_stop_token_and_eos_and_max_tokens_free_blocks():
    engine, runner = make_fake_engine(num_blocks=32)
    prompt = _prompt(3, 9)
    ref = runner.reference(prompt, 30)
    stop_tok = ref[4]
    a = engine.add_request(prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop_tok,)))
    b = engine.add_request(prompt, SamplingParams(max_tokens=3))
    tokens = run_to_completion(engine)
    assert tokens[a] == ref[:ref.index(stop_tok) + 1]
    assert tokens[b] == ref[:3]
    assert engine.pool.num_free == 32


def test_abort_returns_blocks_and_others_continue():
    engine, runner = make_fake_engine(num_blocks=32)
    keep = engine.add_request(_prompt(0, 8), SamplingParams(max_tokens=10))
    drop = engine.add_request(_prompt(1, 8), SamplingParams(max_tokens=10))
    first = [out for _ in range(2) for out in engine.step()]
    assert engine.abort(drop)
    assert not engine.abort(drop)  # second abort is a no-op
    engine.check_integrity()
    tokens = run_to_completion(engine)
    early = [t for out in first if out.stream_id == keep for t in out.token_ids]
    assert early + tokens[keep] == runner.reference(_prompt(0, 8), 10)
    assert tokens[drop] == []  # the abort is reported once, with no tokens
    assert engine.pool.num_free == 32


def test_context_limit_finishes_with_length():
    engine, runner = make_fake_engine(num_blocks=4, block_size=8)  # 32-token pool caps every stream
    sid = engine.add_request(_prompt(0, 20), SamplingParams(max_tokens=100))
    tokens = run_to_completion(engine)
    assert len(tokens[sid]) == 12


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(max_tokens=-3), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=float("nan")),
    dict(temperature=-1.0), dict(top_k=-1), dict(stop=("",)),
])
def test_bad_sampling_params_name_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_bad_prompts_are_rejected_and_engine_keeps_serving():
    engine, runner = make_fake_engine(num_blocks=8, block_size=8, max_model_len=40)
    ok = engine.add_request(_prompt(0, 5), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request(_prompt(1, 40), SamplingParams())  # no room within the 40-token context
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([1, 2, 999_999])
    tokens = run_to_completion(engine)
    assert tokens[ok] == runner.reference(_prompt(0, 5), 4)


def test_scheduler_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_status_order():
    assert StreamStatus.RUNNING < StreamStatus.FINISHED_STOPPED
    assert StreamStatus.FINISHED_ABORTED.finished and not StreamStatus.WAITING.finished


def test_fcfs_reserve_ratio_holds_back_admission():
    admitted = {}
    for ratio in (0.0, 1.0):
        engine, _ = make_fake_engine(num_blocks=40, block_size=8, max_num_batched_tokens=256)
        engine.scheduler.policy.reserve_ratio = ratio
        for i in range(6):
            engine.add_request(_prompt(i, 8), SamplingParams(max_tokens=100))
        engine.step()
        admitted[ratio] = len(engine.scheduler.by_status(StreamStatus.RUNNING))
    assert admitted[0.0] == 6 and admitted[1.0] == 3  # 40 blocks of 8: three full 100-token reserves fit
