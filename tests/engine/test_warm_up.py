"""LLMEngine.warm_up: one throwaway stream before serving that leaves only the cost model's measurements behind."""

from __future__ import annotations

import pytest

from tests.engine.factories import make_fake_engine, run_to_completion
from tokenflow_ray.engine.sampling import SamplingParams


@pytest.mark.parametrize("policy", ["fcfs", "tokenflow", "andes"])
def test_warm_up_measures_costs_and_leaves_no_other_trace(policy):
    engine, _ = make_fake_engine(num_blocks=32, block_size=4, policy=policy, num_host_blocks=32)
    cost = engine.scheduler.cost
    assert cost.steps.prefill_samples == 0
    engine.warm_up(prompt_tokens=(5, 30), new_tokens=6)
    engine.check_integrity()
    # Two prompt lengths, each prefill sampling its first token, then one decode step per further token.
    assert cost.steps.prefill_samples >= 2 and cost.steps.samples >= 12
    stats = engine.stats()
    assert not engine.has_unfinished() and not engine.finished_records
    assert (stats.steps, stats.streams_finished, stats.preemptions, stats.bytes_to_host, stats.bytes_from_host) \
        == (0, 0, 0, 0, 0)
    assert stats.device_blocks_free == stats.device_blocks_total and stats.host_blocks_free == stats.host_blocks_total
    # A stream after it runs as on an engine that never warmed up.
    cold, _ = make_fake_engine(num_blocks=32, block_size=4, policy=policy, num_host_blocks=32)
    for e in (engine, cold):
        e.add_request(list(range(1, 12)), SamplingParams(max_tokens=9, ignore_eos=True), stream_id="real")
    assert run_to_completion(engine) == run_to_completion(cold)
    assert [r.stream_id for r in engine.finished_records] == ["real"] and engine.stats().streams_finished == 1


def test_warm_up_refuses_a_busy_engine_and_bad_sizes():
    engine, _ = make_fake_engine()
    with pytest.raises(ValueError, match="warm_up"):
        engine.warm_up(prompt_tokens=(16, 0))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(RuntimeError, match="warm_up"):
        engine.warm_up()
    run_to_completion(engine)
    engine.warm_up()  # idle again: fine
    assert len(engine.finished_records) == 1  # the real stream's record stays, the warm-up's does not
