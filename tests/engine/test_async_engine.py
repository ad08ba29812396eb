"""AsyncLLMEngine over the fake runner: concurrent streams, disconnects free blocks, a failing step is contained."""

import asyncio

import pytest

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.async_engine import AsyncLLMEngine
from tokenflow_ray.engine.clock import WallClock
from tokenflow_ray.engine.sampling import SamplingParams


@pytest.fixture
def engines():
    engine, runner = make_fake_engine(num_blocks=64)
    engine.clock = WallClock()
    aengine = AsyncLLMEngine(engine, idle_wait_s=0.01)
    yield aengine, runner
    aengine.shutdown()


async def _collect(aengine, prompt, n):
    tokens = []
    async for out in aengine.generate(prompt, SamplingParams(max_tokens=n)):
        tokens.extend(out.token_ids)
        last = out
    return tokens, last.finish_reason


async def test_concurrent_streams_match_reference(engines):
    aengine, runner = engines
    prompts = [[i + 1] * (3 + i) for i in range(8)]
    results = await asyncio.gather(*(_collect(aengine, p, 10 + i) for i, p in enumerate(prompts)))
    for i, (tokens, reason) in enumerate(results):
        assert tokens == runner.reference(prompts[i], 10 + i) and reason == "length"
    await aengine.call(aengine.engine.check_integrity)
    assert await aengine.call(lambda: aengine.engine.pool.num_free) == 64


async def test_consumer_that_stops_reading_frees_its_blocks(engines):
    aengine, _ = engines
    gen = aengine.generate([1, 2, 3], SamplingParams(max_tokens=10_000))
    async for _ in gen:
        break  # the client went away after its first token
    await gen.aclose()
    for _ in range(100):
        if await aengine.call(lambda: aengine.engine.pool.num_free) == 64:
            break
        await asyncio.sleep(0.01)
    assert await aengine.call(lambda: aengine.engine.pool.num_free) == 64
    await aengine.call(aengine.engine.check_integrity)


async def test_bad_request_raises_to_caller_only(engines):
    aengine, runner = engines
    with pytest.raises(ValueError, match="prompt"):
        async for _ in aengine.generate([], SamplingParams()):
            pass
    tokens, _ = await _collect(aengine, [5, 6], 4)
    assert tokens == runner.reference([5, 6], 4)


async def test_failing_step_fails_live_streams_and_engine_keeps_serving(engines):
    aengine, runner = engines
    real = runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device error")
        return real(plan)

    runner.execute = flaky
    with pytest.raises(RuntimeError, match="device error"):
        await _collect(aengine, [7, 7, 7], 50)
    await aengine.call(aengine.engine.check_integrity)
    assert await aengine.call(lambda: aengine.engine.pool.num_free) == 64
    tokens, _ = await _collect(aengine, [8], 5)
    assert len(tokens) == 5


async def test_a_tick_wakes_the_iterator_with_none_and_no_output_is_lost(engines):
    # A stream held until 0.3 s from now makes no output meanwhile; ticks put by its consumer's loop come out of
    # its iterator as None, then every token in order (the replica sends held tokens of a paused stream so).
    aengine, runner = engines
    start = aengine.engine.clock.now()
    sid = None

    async def ticker():
        while sid is None or not aengine.engine.get_stream(sid):
            await asyncio.sleep(0.005)
        for _ in range(3):
            aengine.tick(sid)
            await asyncio.sleep(0.02)

    def added(s):
        nonlocal sid
        sid = s

    gen = aengine.generate([4, 5, 6], SamplingParams(max_tokens=12), arrival_time=start + 0.3, on_added=added)
    task = asyncio.create_task(ticker())
    tokens, ticks = [], 0
    async for out in gen:
        if out is None:
            ticks += 1
            assert not tokens  # the ticks came while nothing was made
            continue
        tokens.extend(out.token_ids)
    await task
    assert ticks == 3 and tokens == runner.reference([4, 5, 6], 12)
    aengine.tick(sid)  # finished: no longer live, nothing to wake
