"""TokenFlow's decisions on a virtual clock: the paper's toy example (Fig. 6), each knob, overload, bad reports."""

import math

import pytest

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.llm_engine import UnknownStreamError
from tokenflow_ray.engine.policies import TokenFlowConfig, TokenFlowPolicy
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus

DT = 0.05  # virtual seconds per step: each running stream makes 20 tok/s


def _toy(other_tokens: int = 200, **knobs):
    """A (slow reader: its buffer fills) and B (fast reader: empty buffer) run; then C arrives and needs memory.

    The pool (20 blocks of 4) holds A and B (7 blocks each after one second) with 6 blocks spare; C's 25-token prompt needs 7,
    so within the next few steps only a proactive preemption can admit it (memory alone forces none yet).
    """
    cfg = TokenFlowConfig(**{"delta_t": 0.1, "mu": 2.0, **knobs})
    engine, runner = make_fake_engine(num_blocks=20, block_size=4, num_host_blocks=256, policy="tokenflow",
                                      tokenflow=cfg)
    a = engine.add_request([1] * 8, SamplingParams(max_tokens=200), rate=2.0)
    b = engine.add_request([2] * 8, SamplingParams(max_tokens=other_tokens), rate=40.0)
    for _ in range(20):  # one virtual second: A's buffer ~9 s, B's ~0
        engine.step()
        engine.check_integrity()
        engine.clock.advance(DT)
    c = engine.add_request([3] * 25, SamplingParams(max_tokens=other_tokens), rate=20.0)
    return engine, a, b, c


def _steps(engine, n):
    for _ in range(n):
        engine.step()
        engine.check_integrity()
        engine.clock.advance(DT)


def _status(engine, sid):
    return engine.scheduler.streams[sid].status


def test_toy_example_largest_buffer_is_preempted_and_new_stream_admitted():
    engine, a, b, c = _toy()
    sa, sb = engine.scheduler.streams[a], engine.scheduler.streams[b]
    now = engine.clock.now()
    assert sa.buffer_s(now) > 5 and sb.buffer_s(now) < 0.5
    _steps(engine, 2)
    assert _status(engine, a) in (StreamStatus.PREEMPTED, StreamStatus.LOADING)
    assert _status(engine, b) == StreamStatus.RUNNING
    assert engine.scheduler.streams[c].first_token_time is not None  # admitted right away: low TTFT


def test_new_stream_waits_when_no_buffer_covers_the_switch():
    engine, a, b, c = _toy(mu=1000.0)  # no running buffer can cover 1000x the switch cost
    _steps(engine, 6)
    assert _status(engine, a) == StreamStatus.RUNNING and _status(engine, b) == StreamStatus.RUNNING
    assert engine.scheduler.streams[c].first_token_time is None


def test_delta_t_limits_how_often_the_working_set_is_rechosen():
    engine, a, b, c = _toy(delta_t=100.0)  # rebalanced once at t=0, not again for 100 s
    _steps(engine, 6)
    assert engine.scheduler.streams[c].first_token_time is None
    engine, a, b, c = _toy(delta_t=0.1)
    _steps(engine, 6)
    assert engine.scheduler.streams[c].first_token_time is not None


def test_paused_stream_resumes_before_its_buffer_runs_dry():
    # B and C finish within ~2 s; A's buffer holds ~9 s. No patience: A is paused for C at once.
    engine, a, b, c = _toy(other_tokens=40, patience_s=0.0)
    _steps(engine, 2)
    assert _status(engine, a) == StreamStatus.PREEMPTED
    for _ in range(400):
        _steps(engine, 1)
        if _status(engine, a) == StreamStatus.RUNNING:
            break
    stream = engine.scheduler.streams[a]
    assert stream.status == StreamStatus.RUNNING
    assert stream.reader.stall_time_at(engine.clock.now()) == 0.0  # its reader never waited


def test_a_new_stream_waits_for_memory_a_finishing_stream_frees_instead_of_a_pause():
    """Near capacity the pool turns over by itself: B ends within about a second (inside patience_s), so the
    rebalance does not pause A, whose buffer could cover a switch, for C; with no patience A is paused at once."""
    engine, a, b, c = _toy(other_tokens=40)
    for _ in range(8):  # until A and B grow into the spare blocks (then memory, not the policy, decides)
        _steps(engine, 1)
        assert _status(engine, a) == StreamStatus.RUNNING and _status(engine, c) == StreamStatus.WAITING
    assert engine.scheduler.streams[a].record.preemptions == 0
    engine, a, b, c = _toy(other_tokens=40, patience_s=0.0)
    _steps(engine, 2)
    assert _status(engine, a) == StreamStatus.PREEMPTED


def engine_step_s() -> float:
    return make_fake_engine()[1].step_cost_s


def _slots_full(num_new: int, delta_t: float = 0.1, b_rate: float = 40.0):
    """Two running streams fill max_num_seqs=2 with memory to spare; A's buffer is full, B's empty (at b_rate 40)."""
    engine, _ = make_fake_engine(num_blocks=256, block_size=4, num_host_blocks=256, policy="tokenflow",
                                 max_num_seqs=2, max_num_batched_tokens=16,
                                 tokenflow=TokenFlowConfig(delta_t=delta_t, mu=2.0))
    a = engine.add_request([1] * 8, SamplingParams(max_tokens=400), rate=2.0)
    b = engine.add_request([2] * 8, SamplingParams(max_tokens=400), rate=b_rate)
    _steps(engine, 20)
    new = [engine.add_request([3 + i] * 12, SamplingParams(max_tokens=50), rate=20.0) for i in range(num_new)]
    return engine, a, b, new


def test_sequence_slots_not_only_memory_make_room_for_a_new_stream():
    engine, a, b, (c,) = _slots_full(1)
    assert engine.scheduler.pool.num_free > 200  # memory forces nothing
    _steps(engine, 2)
    assert _status(engine, a) == StreamStatus.PREEMPTED  # the full buffer gives its slot
    assert _status(engine, b) == StreamStatus.RUNNING
    assert engine.scheduler.streams[c].first_token_time is not None


def test_rebalance_pauses_only_for_streams_it_can_start_before_the_next_one():
    # 16 tokens a step and a 12-token prompt: with Δt of one (fake) step, one new stream can start before the next
    # rebalance, so only one running stream is paused although two new streams rank above both and both running
    # buffers are full.
    engine, a, b, new = _slots_full(2, delta_t=engine_step_s(), b_rate=2.0)
    _, paused = engine.scheduler._rebalance(
        engine.scheduler.policy.rank(list(engine.scheduler.streams.values()), _policy_view(engine)),
        _policy_view(engine))
    assert len(paused) == 1


def _policy_view(engine):
    return engine.scheduler.view(engine.clock.now())


def test_gamma_trades_buffer_urgency_against_waiting_time():
    engine, _ = make_fake_engine(num_blocks=64, block_size=4, num_host_blocks=64, policy="tokenflow")
    x = engine.add_request([1] * 4, SamplingParams(max_tokens=50), rate=10.0)
    engine.clock.advance(2.0)
    y = engine.add_request([2] * 4, SamplingParams(max_tokens=50), rate=10.0)
    sx, sy = engine.scheduler.streams[x], engine.scheduler.streams[y]
    # x has waited 2 s longer; give y the emptier buffer by having x's reader hold many tokens.
    for s, n in ((sx, 30), (sy, 0)):
        if n:
            s.reader.on_tokens(engine.clock.now(), n)
    view = _policy_view(engine)
    # The utility alone (ranking="utility"): with tiers, x's 3 s of buffer would put it behind y whatever γ is.
    urgent_first = TokenFlowPolicy(TokenFlowConfig(gamma=100.0, ranking="utility")).rank([sx, sy], view)
    fair_first = TokenFlowPolicy(TokenFlowConfig(gamma=0.0, ranking="utility")).rank([sx, sy], view)
    assert [s.stream_id for s in urgent_first] == [y, x]
    assert [s.stream_id for s in fair_first] == [x, y]


def test_t_critical_sets_when_running_buffers_count_as_stress():
    engine, _ = make_fake_engine(num_blocks=64, block_size=4, num_host_blocks=64, policy="tokenflow")
    sid = engine.add_request([1] * 4, SamplingParams(max_tokens=50), rate=10.0)
    _steps(engine, 6)  # running, buffer about 2.5 s (6 tokens made at 20 tok/s, read at 10 tok/s)
    s = engine.scheduler.streams[sid]
    assert s.status == StreamStatus.RUNNING
    view = _policy_view(engine)
    buffer_s = s.buffer_s(view.now)
    assert 0 < buffer_s < 5
    assert TokenFlowPolicy(TokenFlowConfig(t_critical=buffer_s + 1)).should_rebalance([s], view)
    assert not TokenFlowPolicy(TokenFlowConfig(t_critical=buffer_s / 4)).should_rebalance([s], view)


def test_lambda_damps_working_set_growth():
    admitted = {}
    for lam in (0.0, 0.9):
        engine, _ = make_fake_engine(num_blocks=256, block_size=4, num_host_blocks=256, policy="tokenflow",
                                     max_num_seqs=64, max_num_batched_tokens=512,
                                     tokenflow=TokenFlowConfig(lam=lam))
        for i in range(40):
            engine.add_request([i + 1] * 4, SamplingParams(max_tokens=60), rate=5.0)
        engine.step()
        admitted[lam] = sum(s.status == StreamStatus.RUNNING for s in engine.scheduler.streams.values())
    assert admitted[0.9] < admitted[0.0]


def test_overload_falls_back_to_arrival_order():
    engine, _ = make_fake_engine(num_blocks=64, block_size=4, num_host_blocks=64, policy="tokenflow")
    old = engine.add_request([1] * 4, SamplingParams(max_tokens=50), rate=10_000.0)  # far beyond capacity
    _steps(engine, 20)  # admitted: the working set's Σ rates now exceed Γ
    new = engine.add_request([2] * 4, SamplingParams(max_tokens=50), rate=10_000.0)
    policy = engine.scheduler.policy
    ranked = policy.rank(list(engine.scheduler.streams.values()), _policy_view(engine))
    assert policy.overloaded and [s.stream_id for s in ranked] == [old, new]
    _steps(engine, 5)  # FCFS with memory-aware admission: nothing new joins an overloaded working set
    assert _status(engine, new) == StreamStatus.WAITING


def test_waiting_streams_alone_do_not_overload():
    """Eq. 6 sums rates over the working set: demand still queued outside it is not load on decode capacity."""
    engine, _ = make_fake_engine(num_blocks=64, block_size=4, num_host_blocks=64, policy="tokenflow")
    for i in range(3):
        engine.add_request([i + 1] * 4, SamplingParams(max_tokens=50), rate=10_000.0)
    policy = engine.scheduler.policy
    policy.rank(list(engine.scheduler.streams.values()), _policy_view(engine))
    assert not policy.overloaded


@pytest.mark.parametrize("knob", ["delta_t", "mu", "t_critical", "overload_margin"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_knobs_are_rejected(knob, bad):
    with pytest.raises(ValueError, match=knob):
        TokenFlowConfig(**{knob: bad})


@pytest.mark.parametrize("rate", [-1.0, math.nan, math.inf])
def test_bad_rate_is_rejected(rate):
    engine, _ = make_fake_engine()
    with pytest.raises(ValueError, match="rate"):
        engine.add_request([1, 2], SamplingParams(), rate=rate)
    assert engine.scheduler.streams == {}


def test_bad_reports_change_nothing():
    engine, _ = make_fake_engine()
    sid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=20), rate=10.0)
    _steps(engine, 5)
    reader = engine.scheduler.streams[sid].reader
    before = (reader.rate, reader.consumed_at(engine.clock.now()), reader.paused)
    with pytest.raises(ValueError, match="consumed_tokens"):
        engine.report_consumption(sid, consumed_tokens=reader.generated + 1)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="rate"):
            engine.report_consumption(sid, consumed_tokens=1, rate=bad)
    assert (reader.rate, reader.consumed_at(engine.clock.now()), reader.paused) == before
    with pytest.raises(UnknownStreamError):
        engine.report_consumption("no-such-stream", rate=5.0)
    engine.report_consumption(sid, consumed_tokens=2, rate=4.0, paused=True)
    assert reader.rate == 4.0 and reader.paused and engine.scheduler.streams[sid].rate == 4.0
    engine.abort(sid)
    with pytest.raises(UnknownStreamError):
        engine.report_consumption(sid, rate=5.0)  # finished


def _behind(behind_leads: float):
    """A (full buffer) and B (empty) run in 3 slots; E is paused with its reader holding 1.5 leads (due at 1),
    and two new streams arrive: the slots make one running stream a victim if the newcomers count."""
    engine, _ = make_fake_engine(num_blocks=256, block_size=4, num_host_blocks=256, policy="tokenflow",
                                 max_num_seqs=3, max_num_batched_tokens=16,
                                 tokenflow=TokenFlowConfig(delta_t=0.1, mu=2.0, patience_s=0.0,
                                                           behind_leads=behind_leads))
    a = engine.add_request([1] * 8, SamplingParams(max_tokens=400), rate=2.0)
    engine.add_request([2] * 8, SamplingParams(max_tokens=400), rate=40.0)
    e = engine.add_request([4] * 8, SamplingParams(max_tokens=400), rate=10.0)
    _steps(engine, 20)
    sched, policy = engine.scheduler, engine.scheduler.policy
    view = _policy_view(engine)
    stream = sched.streams[e]
    lead = policy.lead_s(stream, view)
    # The reader reports it has read all but 1.5 leads' worth of what it got, then E is paused.
    engine.report_consumption(e, consumed_tokens=stream.num_output_tokens - math.ceil(1.5 * lead * stream.rate))
    sched._preempt(stream, view)
    engine.check_integrity()
    new = [engine.add_request([5 + i] * 12, SamplingParams(max_tokens=50), rate=20.0) for i in range(2)]
    view = _policy_view(engine)
    assert lead < stream.buffer_s(view.now) < 2 * lead  # behind at 2 leads, not yet due
    _, paused = sched._rebalance(policy.rank(list(sched.streams.values()), view), view)
    engine.check_integrity()
    return engine, a, new, paused


def test_new_streams_displace_nobody_while_a_paused_stream_is_behind():
    """Near capacity each pause for a newcomer was one more reader to bring back (the Azure trace at 4x, minutes
    10-20: 9,199 pauses, QoE 0.78 against fcfs's 0.94); while a paused reader is within two leads of running dry, a
    rebalance pauses nobody for a new stream. With the rule off (0) the full buffer gives its slot as before."""
    engine, a, new, paused = _behind(2.0)
    assert paused == [] and _status(engine, a) == StreamStatus.RUNNING
    engine, a, new, paused = _behind(0.0)
    assert paused == [a] and _status(engine, a) == StreamStatus.PREEMPTED
