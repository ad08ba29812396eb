"""Each remaining config knob changes behaviour (house rule: every knob has a test)."""

import pytest

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.config import ModelConfig
from tokenflow_ray.engine.policies import AndesConfig, AndesPolicy
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus


def test_max_num_seqs_caps_the_batch():
    engine, _ = make_fake_engine(max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(6):
        engine.add_request([i + 1] * 4, SamplingParams(max_tokens=5))
    engine.step()
    assert len(engine.scheduler.by_status(StreamStatus.RUNNING)) == 3


def test_write_budget_fraction_bounds_write_through_per_step():
    planned = {}
    for fraction in (0.01, 4.0):
        engine, runner = make_fake_engine(num_blocks=64, block_size=4, num_host_blocks=128, policy="tokenflow",
                                          write_budget_fraction=fraction)
        engine.add_request(list(range(1, 60)), SamplingParams(max_tokens=3), rate=5.0)
        engine.step()  # prefill: 14 full blocks become eligible
        for _ in range(30):  # measured: 10 ms steps, copies at 100 blocks/s -> one block per step at fraction 1
            engine.scheduler.cost.observe_step(0.01, 1, 0, 1.0, 100 * engine.scheduler.cost.block_bytes)
        plan = engine.scheduler.schedule(engine.clock.now())
        planned[fraction] = len(plan.write_through)
    assert planned[0.01] == 1 and planned[4.0] == 4


def test_a_stream_reads_at_the_rate_it_declares_and_unpaced_without_one():
    """The engine has no default rate: a server resolves its default_rate where a request comes in
    (tests/serve/front/test_default_rate.py)."""
    engine, _ = make_fake_engine()
    assert engine.scheduler.streams[engine.add_request([1, 2], SamplingParams())].rate == 0.0
    assert engine.scheduler.streams[engine.add_request([1, 2], SamplingParams(), rate=12.5)].rate == 12.5
    with pytest.raises(ValueError, match="rate"):
        engine.add_request([1, 2], SamplingParams(), rate=-1.0)


def test_record_history_bounds_kept_records():
    engine, _ = make_fake_engine()
    engine.finished_records = type(engine.finished_records)(maxlen=2)
    for i in range(4):
        engine.add_request([i + 1], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert len(engine.finished_records) == 2


def test_andes_preemption_cap():
    engine, _ = make_fake_engine(policy="andes")
    view = engine.scheduler.view(0.0)
    capped = AndesPolicy(AndesConfig(max_preemptions_per_s=2))
    stream = type("S", (), {})()
    assert capped.may_preempt(stream, view)
    capped.on_preempt(stream, view)
    capped.on_preempt(stream, view)
    assert not capped.may_preempt(stream, view)
    later = engine.scheduler.view(1.5)
    assert capped.may_preempt(stream, later)  # the window slid past


def test_andes_ttft_target_sets_when_a_waiting_stream_starts_losing_qoe():
    engine, _ = make_fake_engine(policy="andes")
    sid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=20), rate=10.0)
    stream = engine.scheduler.streams[sid]
    now = 0.2
    assert AndesPolicy(AndesConfig(ttft_target_s=0.1)).qoe_gain(stream, now) > 0
    assert AndesPolicy(AndesConfig(ttft_target_s=5.0)).qoe_gain(stream, now) == 0


def test_engine_reports_idle_steps_when_every_running_stream_is_held():
    engine, _ = make_fake_engine(policy="tokenflow")
    engine.add_request([1] * 4, SamplingParams(max_tokens=5), rate=10.0)
    engine.step()  # prefill
    engine.scheduler.policy.hold = lambda running, view: {s.stream_id for s in running}
    assert engine.step() == [] and engine.idle
    del engine.scheduler.policy.hold  # the class method again
    engine.step()
    assert not engine.idle


def test_num_threads_knob_is_validated():
    with pytest.raises(ValueError, match="num_threads"):
        ModelConfig(num_threads=0)
