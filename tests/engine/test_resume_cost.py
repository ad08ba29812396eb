"""Reload or recompute (paper §4.2.3): the decision reads the live copy queue (issue 13, item 3)."""

from tests.engine.factories import make_fake_engine, step_engine
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus

PROMPTS = {"small": list(range(1, 9)), **{f"big{i}": [7 + i] * 60 for i in range(3)}}


def _paused(engine, tokens=None, pause_bigs=True):
    """A small and three big streams, run a little, then paused to the host (tails copied)."""
    sched = engine.scheduler
    ids = {name: engine.add_request(prompt, SamplingParams(max_tokens=200), stream_id=name, rate=5.0)
           for name, prompt in PROMPTS.items()}
    small, big = ids["small"], [ids[f"big{i}"] for i in range(3)]
    step_engine(engine, 10, tokens)
    paused = (small, *big) if pause_bigs else (small,)
    for sid in paused:
        assert sched.preempt(sid, engine.clock.now())
    step_engine(engine, 1, tokens)  # the step that copies their tails; nobody resumes in it
    assert all(sched.streams[s].status == StreamStatus.PREEMPTED for s in paused)
    return sched.streams[small], [sched.streams[s] for s in big]


def test_a_long_copy_queue_flips_a_resume_to_recompute_and_back():
    engine, _ = make_fake_engine(num_blocks=256, block_size=4, num_host_blocks=512, policy="tokenflow",
                                 max_num_batched_tokens=64)
    sched = engine.scheduler
    small, bigs = _paused(engine)
    assert sched._resume_by_load(small)  # alone, its few blocks load faster than its prefix recomputes

    for s in bigs:  # three big reloads start, as admission does: their chunks queue for later steps' budgets
        assert sched.kv.start_load(s)
        s.status = StreamStatus.LOADING
    assert sched.kv.queued_load_blocks > 2 * sched.cost.copy_budget_blocks()
    assert not sched._resume_by_load(small)  # behind that queue, recompute is sooner

    for _ in range(50):  # the queue drains, chunk by chunk
        if sched.kv.queued_load_blocks == 0:
            break
        step_engine(engine)
    assert all(s.status == StreamStatus.RUNNING for s in bigs)
    assert sched._resume_by_load(small)


def test_without_a_queue_the_same_pause_comes_back_by_reload():
    """The control for the next test: the same small stream, paused the same way, with nothing queued ahead."""
    engine, _ = make_fake_engine(num_blocks=256, block_size=4, num_host_blocks=512, policy="tokenflow",
                                 max_num_batched_tokens=64)
    small, _ = _paused(engine, pause_bigs=False)
    before = small.num_recomputed_tokens
    plans = step_engine(engine, 2)
    assert small.status == StreamStatus.RUNNING and small.num_recomputed_tokens == before
    assert any(c.stream_id == small.stream_id for p in plans for c in p.swap_in)


def test_the_scheduler_recomputes_behind_a_long_queue():
    """End to end: a stream resumed while big loads are queued, with nothing left in its reader's buffer to hide
    the wait, comes back by recompute, not by a load (with a buffer that covers it, it loads:
    test_resume_buffer.py)."""
    engine, runner = make_fake_engine(num_blocks=256, block_size=4, num_host_blocks=512, policy="tokenflow",
                                      max_num_batched_tokens=64)
    sched = engine.scheduler
    tokens: dict[str, list[int]] = {}
    small, bigs = _paused(engine, tokens)
    for s in bigs:
        assert sched.kv.start_load(s)
        s.status = StreamStatus.LOADING
    engine.clock.advance(60.0)  # the small stream's reader has read all it was sent
    assert small.buffer_s(engine.clock.now()) == 0.0
    before = small.num_recomputed_tokens
    plans = step_engine(engine, 1, tokens)
    assert small.status == StreamStatus.RUNNING and small.num_recomputed_tokens > before
    assert not any(c.stream_id == small.stream_id for p in plans for c in p.swap_in)
    while engine.has_unfinished():
        step_engine(engine, 1, tokens)
    for name, prompt in PROMPTS.items():  # reloaded in chunks or recomputed: the reference's tokens
        assert tokens[name] == runner.reference(prompt, 200)
    assert engine.pool.num_free == engine.pool.num_blocks
