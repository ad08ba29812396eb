"""Admission honours the set the rebalance chose; reloads are chunked across steps (issue 13, item 4)."""

from tests.engine.factories import make_fake_engine, step_engine
from tokenflow_ray.engine.policies import TokenFlowConfig
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus


def test_admission_takes_the_refined_set_not_the_ranking():
    """A long-paused stream `a` ranks first but needs most of the pool; refine trades it for the smaller `b` plus
    one more (`c`, `d` fit beside b). Admission must start that set; walking the ranking again would reload `a` and
    then stop at `b` for want of memory, so refine would only have decided who is paused. (The utility ranking,
    where a long wait alone puts a paused stream first; with tiers a paused stream that is not due ranks after
    new ones.)"""
    engine, _ = make_fake_engine(num_blocks=13, block_size=4, num_host_blocks=4096, policy="tokenflow",
                                 max_num_seqs=8, max_num_batched_tokens=64,
                                 tokenflow=TokenFlowConfig(delta_t=0.5, t_critical=1.0, ranking="utility"))
    sched = engine.scheduler
    a = engine.add_request([1] * 8, SamplingParams(max_tokens=400), stream_id="a", rate=2.0)
    step_engine(engine, 30)  # 30 tokens read at 2 tok/s: ~14 s of buffer
    assert sched.preempt(a, engine.clock.now())
    step_engine(engine)  # its tail goes to the host
    engine.clock.advance(5.0)  # kept off the device for 5 s: its wait gives it the top rank; ~12 s of buffer left
    b = engine.add_request([2] * 12, SamplingParams(max_tokens=400), stream_id="b", rate=2.0)
    c = engine.add_request([3] * 8, SamplingParams(max_tokens=400), stream_id="c", rate=2.0)
    d = engine.add_request([4] * 8, SamplingParams(max_tokens=400), stream_id="d", rate=2.0)
    view = sched.view(engine.clock.now())
    ranked = sched.policy.rank(list(sched.streams.values()), view)
    assert [s.stream_id for s in ranked][:2] == [a, b]
    need = {s.stream_id: sched.pool.blocks_for_tokens(s.num_tokens + 1) for s in ranked}
    assert need[a] + need[b] > 13 >= need[a] + need[c] and need[b] + need[c] + need[d] <= 13  # the premise

    step_engine(engine)
    status = {sid: sched.streams[sid].status for sid in (a, b, c, d)}
    assert status[b] == status[c] == status[d] == StreamStatus.RUNNING, status
    assert status[a] == StreamStatus.PREEMPTED


def test_a_large_reload_is_chunked_across_steps():
    engine, runner = make_fake_engine(num_blocks=128, block_size=4, num_host_blocks=256, policy="tokenflow",
                                      resume_mode="load", max_num_batched_tokens=256)
    sched = engine.scheduler
    prompt = list(range(1, 200))
    sid = engine.add_request(prompt, SamplingParams(max_tokens=40), stream_id="long", rate=5.0)
    tokens: dict[str, list[int]] = {}
    step_engine(engine, 5, tokens=tokens)
    assert sched.preempt(sid, engine.clock.now())
    step_engine(engine, tokens=tokens)
    stream = sched.streams[sid]
    blocks = sched.pool.blocks_for_tokens(stream.num_host_tokens)
    per_step = sched.cost.copy_budget_blocks()
    assert blocks > 3 * per_step  # the premise: one step cannot carry the whole reload

    plans: list = []
    while stream.status != StreamStatus.RUNNING:
        plans += step_engine(engine, tokens=tokens)
        assert len(plans) < 50
    loads = [sum(c.stream_id == sid for c in p.swap_in) for p in plans]
    assert sum(loads) == blocks and max(loads) <= per_step and sum(n > 0 for n in loads) >= 4
    assert not any(c.stream_id == sid for p in plans for c in p.decodes + p.prefills[:-1])  # no compute mid-load
    while engine.has_unfinished():
        step_engine(engine, tokens=tokens)
    assert tokens[sid] == runner.reference(prompt, 40)


def test_aborting_a_stream_mid_load_drops_its_queued_chunks():
    engine, _ = make_fake_engine(num_blocks=128, block_size=4, num_host_blocks=256, policy="tokenflow",
                                 resume_mode="load", max_num_batched_tokens=256)
    sched = engine.scheduler
    sid = engine.add_request(list(range(1, 200)), SamplingParams(max_tokens=40), rate=5.0)
    step_engine(engine, 5)
    sched.preempt(sid, engine.clock.now())
    step_engine(engine, 2)  # the tail, then the first chunk of the reload
    assert sched.streams[sid].status == StreamStatus.LOADING and sched.kv.queued_load_blocks > 0
    engine.abort(sid)
    engine.check_integrity()
    assert sched.kv.queued_load_blocks == 0
    assert engine.pool.num_free == engine.pool.num_blocks
    assert sched.kv.host.num_free == sched.kv.host.num_blocks
    step_engine(engine)  # and the next step plans nothing for it
