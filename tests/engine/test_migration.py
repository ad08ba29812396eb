"""Migration between two engines on the fake runner: the moved stream's tokens equal an unmoved run's, its KV
travels (resume by load, nothing recomputed), and both engines' block accounting holds after every step."""

import pytest

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.migration import StreamNotExportable
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus


def _prompt(i: int, n: int) -> list[int]:
    return [(i * 37 + j * 11) % 200 + 1 for j in range(n)]


def _step(engine, tokens, n=1):
    for _ in range(n):
        for out in engine.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
        engine.check_integrity()
        engine.clock.advance(0.01)


def _export(engine, sid, tokens, max_steps=20):
    engine.begin_export(sid)
    engine.check_integrity()
    for _ in range(max_steps):
        exported = engine.try_export(sid)
        engine.check_integrity()
        if exported is not None:
            return exported
        _step(engine, tokens)
    raise AssertionError("the stream never became exportable")


def _run_all(engine, tokens, max_steps=2000):
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        _step(engine, tokens)
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("policy", ["fcfs", "tokenflow"])
def test_a_moved_stream_continues_token_for_token_with_its_kv(policy):
    src, runner = make_fake_engine(num_blocks=64, num_host_blocks=64, policy=policy)
    dst, _ = make_fake_engine(num_blocks=64, num_host_blocks=64, policy=policy)
    prompts = {src.add_request(_prompt(i, 9 + 5 * i), SamplingParams(max_tokens=30)): _prompt(i, 9 + 5 * i)
               for i in range(3)}
    moved = next(iter(prompts))
    tokens: dict[str, list[int]] = {}
    _step(src, tokens, 8)
    assert 0 < len(tokens[moved]) < 30
    exported = _export(src, moved, tokens)
    assert moved not in src.scheduler.streams  # gone from the source, not finished there
    assert exported.num_kv_tokens == exported.num_tokens - 1  # all but the last sampled token's KV
    dst.import_stream(exported)
    assert dst.get_stream(moved).status == StreamStatus.PREEMPTED
    _run_all(dst, tokens)
    _run_all(src, tokens)
    for sid, prompt in prompts.items():
        assert tokens[sid] == runner.reference(prompt, 30), sid
    record = dst.finished_records[-1]
    assert record.stream_id == moved and record.migrations == 1 and record.tokens_recomputed == 0
    assert record.output_len == 30  # the token times of both engines are in one record
    assert dst.scheduler.bytes_from_host > 0  # resumed by load from the imported host blocks
    for engine in (src, dst):
        assert engine.pool.num_free == engine.pool.num_blocks
        assert engine.scheduler.kv.host.num_free == engine.scheduler.kv.host.num_blocks


def test_a_corrupted_kv_import_changes_the_output():
    """The test above can fail: the fake model reads its context back from the imported blocks."""
    src, runner = make_fake_engine(num_blocks=32, num_host_blocks=32)
    dst, _ = make_fake_engine(num_blocks=32, num_host_blocks=32, resume_mode="load")
    sid = src.add_request(_prompt(1, 12), SamplingParams(max_tokens=20))
    tokens: dict[str, list[int]] = {}
    _step(src, tokens, 6)
    exported = _export(src, sid, tokens)
    exported.kv[0][3] = (exported.kv[0][3] + 1) % 200
    dst.import_stream(exported)
    _run_all(dst, tokens)
    assert tokens[sid] != runner.reference(_prompt(1, 12), 20)


def test_without_room_on_the_target_the_stream_recomputes_with_the_same_output():
    src, runner = make_fake_engine(num_blocks=32, num_host_blocks=32)
    dst, _ = make_fake_engine(num_blocks=32, num_host_blocks=0)
    sid = src.add_request(_prompt(2, 10), SamplingParams(max_tokens=24))
    tokens: dict[str, list[int]] = {}
    _step(src, tokens, 5)
    exported = _export(src, sid, tokens)
    dst.import_stream(exported)
    assert dst.get_stream(sid).status == StreamStatus.WAITING
    _run_all(dst, tokens)
    assert tokens[sid] == runner.reference(_prompt(2, 10), 24)
    assert dst.finished_records[-1].tokens_recomputed == exported.num_kv_tokens


def test_a_waiting_stream_and_a_take_back_move_too():
    src, runner = make_fake_engine(num_blocks=32, num_host_blocks=32, max_num_seqs=1)
    first = src.add_request(_prompt(3, 8), SamplingParams(max_tokens=10))
    src.clock.advance(0.01)  # arrival order decides who runs first
    queued = src.add_request(_prompt(4, 8), SamplingParams(max_tokens=10))
    tokens: dict[str, list[int]] = {}
    _step(src, tokens, 2)
    assert src.get_stream(queued).status == StreamStatus.WAITING
    exported = _export(src, queued, tokens)
    assert exported.num_kv_tokens == 0 and exported.kv is None
    src.import_stream(exported)  # the move failed: the source takes it back
    _step(src, tokens, 3)
    again = _export(src, first, tokens)
    src.import_stream(again)
    _run_all(src, tokens)
    assert tokens[first] == runner.reference(_prompt(3, 8), 10)
    assert tokens[queued] == runner.reference(_prompt(4, 8), 10)


def test_a_held_stream_is_not_resumed_and_bad_exports_are_refused():
    src, _ = make_fake_engine(num_blocks=32, num_host_blocks=32, policy="tokenflow")
    sid = src.add_request(_prompt(5, 8), SamplingParams(max_tokens=40))
    tokens: dict[str, list[int]] = {}
    _step(src, tokens, 3)
    src.begin_export(sid)
    _step(src, tokens, 5)  # no one takes it: it stays paused, however long
    assert src.get_stream(sid).status == StreamStatus.PREEMPTED
    n = len(tokens[sid])
    src.cancel_export(sid)
    _step(src, tokens, 5)
    assert len(tokens[sid]) > n  # scheduled again
    with pytest.raises(StreamNotExportable):
        src.try_export(sid)  # not being exported
    with pytest.raises(StreamNotExportable):
        src.begin_export("nope")


def test_import_validates_and_times_move_onto_the_new_clock():
    src, _ = make_fake_engine(num_blocks=32, num_host_blocks=32)
    dst, _ = make_fake_engine(num_blocks=32, num_host_blocks=32)
    dst.clock.advance(1000.0)  # another process's monotonic clock
    sid = src.add_request(_prompt(6, 8), SamplingParams(max_tokens=20), rate=10.0)
    tokens: dict[str, list[int]] = {}
    _step(src, tokens, 6)
    exported = _export(src, sid, tokens)
    buffered = exported.reader.buffer_at(src.clock.now())
    age = src.clock.now() - exported.record.token_times[0]
    dst.import_stream(exported, elapsed_s=0.0)
    moved = dst.get_stream(sid)
    assert moved.reader.buffer_at(dst.clock.now()) == buffered
    assert dst.clock.now() - moved.record.token_times[0] == pytest.approx(age)
    dst.abort(sid)
    small, _ = make_fake_engine(num_blocks=2, block_size=4, num_host_blocks=4, max_model_len=8)
    sid2 = src.add_request(_prompt(7, 6), SamplingParams(max_tokens=20))
    _step(src, tokens, 4)
    refused = _export(src, sid2, tokens)
    with pytest.raises(ValueError, match="context limit"):
        small.import_stream(refused)
    times = list(refused.record.token_times)
    src.add_request(_prompt(8, 6), SamplingParams(max_tokens=5), stream_id=sid2)
    with pytest.raises(ValueError, match="already live"):
        src.import_stream(refused)  # its id is taken there now
    assert refused.record.token_times == times and refused.record.migrations == 0  # the export is left as it was
    assert small.scheduler.kv.host.num_free == 4  # nothing kept by the refused import


def test_a_stream_paused_by_recompute_is_picked_as_paused_and_moves_with_its_tokens():
    """fcfs without a host store pauses by recompute (WAITING with output): the relief picks such a stream with the
    paused ones, not with the streams waiting to start, and the target recomputes it to the same tokens."""
    from tokenflow_ray.cluster.migration_policy import pick_streams

    src, runner = make_fake_engine(num_blocks=10, block_size=8, num_host_blocks=0, policy="fcfs")
    dst, _ = make_fake_engine(num_blocks=32, block_size=8, num_host_blocks=0, policy="fcfs")
    prompts = {}
    for i in range(3):
        prompts[src.add_request(_prompt(i, 9), SamplingParams(max_tokens=30))] = _prompt(i, 9)
        src.clock.advance(0.01)
    tokens: dict[str, list[int]] = {}
    for _ in range(200):
        _step(src, tokens)
        paused = [s for s in src.scheduler.streams.values()
                  if s.status == StreamStatus.WAITING and s.num_output_tokens]
        if paused:
            break
    assert paused, "no stream was paused by recompute"
    sid = paused[0].stream_id
    assert pick_streams(src.scheduler, src.clock.now(), rate=1e9, max_streams=8, include_waiting=False) == [sid]
    exported = _export(src, sid, tokens)
    assert exported.kv is None and exported.num_kv_tokens == 0  # only its tokens travel
    dst.import_stream(exported)
    _run_all(dst, tokens)
    _run_all(src, tokens)
    for s, prompt in prompts.items():
        assert tokens[s] == runner.reference(prompt, 30), s
    assert dst.finished_records[-1].stream_id == sid and dst.finished_records[-1].migrations == 1
