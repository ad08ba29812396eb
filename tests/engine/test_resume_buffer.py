"""tokenflow resumes a paused stream by reloading its host copy whenever its reader's buffer covers the reload
(issue 16 (b): with the paper's sooner-of-the-two rule the H200 profile recomputed 14x its output, since a
rebalance that resumes many streams at once makes every reload behind the first few look slow)."""

from tests.engine.factories import make_fake_engine, step_engine
from tests.engine.test_resume_cost import PROMPTS, _paused
from tokenflow_ray.engine.policies import FCFSPolicy, TokenFlowConfig, TokenFlowPolicy
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus


def _queue_loads(sched, streams):
    for s in streams:  # big reloads start, as admission does: their chunks queue for later steps' budgets
        assert sched.kv.start_load(s)
        s.status = StreamStatus.LOADING


def _engine():
    return make_fake_engine(num_blocks=256, block_size=4, num_host_blocks=512, policy="tokenflow",
                            max_num_batched_tokens=64)


def test_the_rule_reloads_when_the_buffer_covers_it_and_else_takes_the_sooner():
    engine, _ = _engine()
    sched = engine.scheduler
    small, bigs = _paused(engine)
    _queue_loads(sched, bigs)
    view = sched.view(engine.clock.now())
    buffer_s = small.buffer_s(view.now)
    assert buffer_s > 0.1
    # recompute_weight="one": the buffer rule, else the sooner of the two for this stream alone.
    tf, paper = TokenFlowPolicy(TokenFlowConfig(recompute_weight="one")), FCFSPolicy()  # base: the paper's rule
    assert tf.resume_by_load(small, buffer_s * 0.9, buffer_s * 0.1, view)  # slower, but hidden by the buffer
    assert not paper.resume_by_load(small, buffer_s * 0.9, buffer_s * 0.1, view)
    assert not tf.resume_by_load(small, buffer_s * 2, buffer_s, view)  # the reader would wait: the sooner
    assert tf.resume_by_load(small, buffer_s * 2, buffer_s * 3, view)
    # The default weighs a recompute by the batch it holds up (the device holds view.max_device_batch streams).
    batch = TokenFlowPolicy()
    b = view.max_device_batch
    assert b > 2 and batch.resume_by_load(small, buffer_s * 2, buffer_s, view)  # 2x slower < the batch's wait
    assert not batch.resume_by_load(small, buffer_s * (b + 1), buffer_s, view)
    small.rate = 0.0  # an unpaced stream has no reader to hide the wait: the sooner, or the batch-weighted rule
    assert not tf.resume_by_load(small, buffer_s * 0.9, buffer_s * 0.1, view)
    assert batch.resume_by_load(small, buffer_s * 0.9, buffer_s * 0.1, view) == (0.9 <= b * 0.1)


def test_behind_a_long_queue_a_buffered_stream_still_reloads_and_nothing_is_recomputed():
    """The same queue that makes the small stream recompute when its reader has nothing left
    (test_resume_cost.py) is hidden by a reader that still holds seconds of buffer: it reloads."""
    engine, runner = _engine()
    sched = engine.scheduler
    tokens: dict[str, list[int]] = {}
    small, bigs = _paused(engine, tokens)
    _queue_loads(sched, bigs)
    now = engine.clock.now()
    t_io = sched.cost.t_io(load_blocks=sched.pool.blocks_for_tokens(small.num_host_tokens),
                           queued_blocks=sched.kv.queued_load_blocks)
    assert t_io > sched.cost.t_recompute(small.num_host_tokens)  # the paper's rule would recompute
    assert small.buffer_s(now) >= t_io
    plans = step_engine(engine, 1, tokens)
    assert small.status == StreamStatus.LOADING
    while engine.has_unfinished():  # integrity is checked after every step
        plans += step_engine(engine, 1, tokens)
    assert any(c.stream_id == small.stream_id for p in plans for c in p.swap_in)
    assert all(sched_stream.num_recomputed_tokens == 0 for sched_stream in (small, *bigs))
    for name, prompt in PROMPTS.items():  # reloaded in chunks: the reference's tokens
        assert tokens[name] == runner.reference(prompt, 200)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_rotation_under_memory_pressure_recomputes_nothing_while_buffers_cover_the_reloads():
    """Many paced streams rotating through a small device pool with a host store: every resume of a stream whose
    buffer covers its reload is a reload, so no token is recomputed while a host copy exists."""
    engine, runner = make_fake_engine(num_blocks=48, block_size=4, num_host_blocks=1024, policy="tokenflow",
                                      max_num_batched_tokens=64, max_num_seqs=16)
    prompts = {f"s{i}": [3 + i] * 12 for i in range(12)}
    for sid, prompt in prompts.items():
        engine.add_request(prompt, SamplingParams(max_tokens=60), stream_id=sid, rate=4.0)
    sched = engine.scheduler
    decisions: list[tuple[bool, float, float]] = []
    decide = sched.policy.resume_by_load

    def spy(stream, t_io, t_recompute, view):
        load = decide(stream, t_io, t_recompute, view)
        decisions.append((load, t_io, stream.buffer_s(view.now)))
        return load

    sched.policy.resume_by_load = spy
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        step_engine(engine, 1, tokens)  # integrity after every step
        steps += 1
        assert steps < 20_000
    assert sum(r.preemptions for r in engine.finished_records) > 0  # it did rotate
    assert sum(r.tokens_recomputed for r in engine.finished_records) == 0
    assert decisions and all(load for load, t_io, buffer_s in decisions if t_io <= buffer_s)
    for sid, prompt in prompts.items():
        assert tokens[sid] == runner.reference(prompt, 60)
    assert engine.pool.num_free == engine.pool.num_blocks
