"""Scheduler.update (the synchronous engine's one pass over a step's chunks) leaves exactly the state and returns
exactly the tokens of its two halves, advance then apply_result, which overlapped scheduling runs apart: two
engines on the same seeded workload (joins, eos and stop tokens, length limits, preemption to the host and back,
recompute, aborts), one through each, compared after every step."""

from __future__ import annotations

import random

import pytest

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus


def _two_halves(scheduler):
    def update(plan, result, now, step_s=0.0):
        scheduler.advance(plan)
        return scheduler.apply_result(plan, result, now, step_s)

    scheduler.update = update


def _state(engine) -> tuple:
    s = engine.scheduler
    streams = tuple(sorted((x.stream_id, x.status, x.num_computed_tokens, tuple(x.output_token_ids),
                            tuple(x.block_ids), tuple(x.host_block_ids), x.num_host_tokens,
                            tuple(x.record.token_times), tuple(x.record.token_buffers), x.reader.generated)
                           for x in s.streams.values()))
    return (streams, engine.pool.num_free, s.bytes_to_host, s.bytes_from_host, tuple(s.preempt_costs_s),
            sorted(s._finishing), engine.stats())


@pytest.mark.parametrize("policy,host,seed", [("fcfs", 0, 0), ("tokenflow", 256, 1), ("andes", 256, 2),
                                              ("tokenflow", 0, 3)])
def test_update_equals_advance_then_apply_result(policy, host, seed):
    fused, _ = make_fake_engine(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
                                policy=policy, num_host_blocks=host, eos_token_id=7)
    halves, _ = make_fake_engine(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
                                 policy=policy, num_host_blocks=host, eos_token_id=7)
    _two_halves(halves.scheduler)
    rng = random.Random(seed)
    specs = []
    for _ in range(20):
        prompt = [rng.randrange(200) for _ in range(rng.randint(2, 30))]
        sp = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.5,
                            stop_token_ids=(rng.randrange(256),) if rng.random() < 0.3 else ())
        specs.append((rng.randint(0, 40), prompt, sp, rng.choice([0.0, 5.0, 40.0])))
    added: set[int] = set()
    finished = 0
    for step in range(3000):
        for i, (at, prompt, sp, rate) in enumerate(specs):
            if i not in added and at <= step:
                added.add(i)
                for e in (fused, halves):
                    e.add_request(prompt, sp, stream_id=f"s{i}", rate=rate)
        running = sorted(s.stream_id for s in fused.scheduler.streams.values() if s.status == StreamStatus.RUNNING)
        if running and step % 9 == 4:
            for e in (fused, halves):
                e.scheduler.preempt(running[step % len(running)], e.clock.now())
        if running and step % 31 == 17:
            for e in (fused, halves):
                e.abort(running[-1])
        outs = [e.step() for e in (fused, halves)]
        assert outs[0] == outs[1]
        finished += sum(o.finished for o in outs[0])
        for e in (fused, halves):
            e.check_integrity()
            e.clock.advance(0.01)
        assert _state(fused) == _state(halves)
        if len(added) == len(specs) and not fused.has_unfinished():
            break
    assert not fused.has_unfinished() and not halves.has_unfinished()
    assert finished == len(specs)
    assert fused.pool.num_free == fused.pool.num_blocks
