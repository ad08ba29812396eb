"""Copies that land late, as a GPU's do, make copy-safety bugs visible on CPU: a paused stream's tail freed before
its copy lands, a host block that an import reuses while an earlier owner's copy still writes it, an import while a
step is in flight. With copies landing before the step's writes (the fake runner's default) the first of these
passes every engine test; with late copies (tests/engine/conftest.py runs every fake-engine test both ways) it
fails them."""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine import factories, test_overlap, test_resume_buffer
from tokenflow_ray.engine import scheduler as scheduler_module
from tokenflow_ray.engine.kv_manager import KVManager
from tokenflow_ray.engine.sampling import SamplingParams


class EarlyFreeKV(KVManager):
    """The bug to catch: a preempted stream's tail blocks freed at the preemption, not after their copy."""

    def swap_out(self, stream):
        result = super().swap_out(stream)
        if self.pending_free:
            self.device.free(self.pending_free)
            self.pending_free = []
        return result


def _run(engine, tokens, on_step=None, max_steps=500):
    plans = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan: plans.append(plan) or execute(plan)
    for step in range(max_steps):
        if not engine.has_unfinished():
            return plans
        if on_step is not None:
            on_step(step)
        for out in engine.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
        engine.check_integrity()
        engine.clock.advance(0.01)
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("kv_manager, late, output_intact", [
    (KVManager, False, True), (KVManager, True, True),
    (EarlyFreeKV, False, True),  # copies before the writes cannot see the bug: what the engine tests missed
    (EarlyFreeKV, True, False)])
def test_a_tail_reused_before_its_copy_lands_corrupts_the_paused_stream(kv_manager, late, output_intact):
    """Two streams fill a two-block pool; one is paused to the host and the other then needs a block. A tail freed
    at once is that block: the other stream writes it in the very step whose copy reads it."""
    engine, runner = factories.make_fake_engine(num_blocks=2, block_size=4, num_host_blocks=8, policy="tokenflow",
                                                max_num_seqs=2, max_num_batched_tokens=16, resume_mode="load",
                                                late_copies=late)
    engine.scheduler.kv = kv_manager(engine.scheduler.kv.device, engine.scheduler.kv.host)
    prompts = {"a": [11, 12, 13], "b": [21, 22, 23, 24]}
    for sid, prompt in prompts.items():
        engine.add_request(prompt, SamplingParams(max_tokens=6), stream_id=sid)
    tokens: dict[str, list[int]] = {}
    plans = _run(engine, tokens, lambda step: step == 1 and engine.scheduler.preempt("a", 0.0, to_host=True))
    pause = plans[1]
    tail = {c.device_block for c in pause.swap_out if c.stream_id == "a"}
    written = {b for c in (*pause.decodes, *pause.prefills) for b in c.new_blocks}
    assert tail and bool(tail & written) == (kv_manager is EarlyFreeKV)  # the hazard is there, or not
    assert engine.scheduler.bytes_from_host > 0  # "a" came back by load
    limit = engine.max_total_tokens
    intact = all(tokens[sid] == runner.reference(p, min(6, limit - len(p))) for sid, p in prompts.items())
    assert intact == output_intact


@pytest.mark.parametrize("existing_test, args", [
    (test_overlap.test_overlapped_tokens_equal_the_synchronous_engine, ("tokenflow", 512, 2, False, True)),
    (test_resume_buffer.test_rotation_under_memory_pressure_recomputes_nothing_while_buffers_cover_the_reloads, ())],
    ids=["overlap", "rotation"])
def test_existing_engine_tests_fail_when_a_tail_is_freed_early_and_copies_land_late(existing_test, args,
                                                                                  monkeypatch):
    """Engine tests of preemption under memory pressure, unchanged: they pass with the real KVManager in both
    modes (conftest.py), and fail with the early free once copies land late."""
    monkeypatch.setattr(scheduler_module, "KVManager", EarlyFreeKV)
    monkeypatch.setattr(factories, "LATE_COPIES", True)
    with pytest.raises(AssertionError):
        existing_test(*args)


def _exported_stream(num_kv_blocks: int, block_size: int = 4):
    """A stream paused and exported from another engine after three steps, with KV for num_kv_blocks host blocks;
    returns it, its tokens so far and the reference output."""
    src, runner = factories.make_fake_engine(num_blocks=32, block_size=block_size, num_host_blocks=16)
    prompt = [(7 * j) % 200 + 1 for j in range(num_kv_blocks * block_size - 2)]
    sid = src.add_request(prompt, SamplingParams(max_tokens=12), stream_id="moved")
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for out in src.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
    src.begin_export(sid)
    for _ in range(10):
        exported = src.try_export(sid)
        if exported is not None:
            assert src.pool.blocks_for_tokens(exported.num_kv_tokens) == num_kv_blocks
            return exported, tokens[sid], runner.reference(prompt, 12)
        src.step()
    raise AssertionError("never exportable")


def test_an_import_into_host_blocks_a_late_copy_still_writes_keeps_its_own_kv():
    """A stream's write-through is in flight when it is aborted; an import reuses those host blocks at once. The
    runner settles before writing them, so the late copy lands first, not on top of the imported KV."""
    exported, before, reference = _exported_stream(4)
    dst, runner = factories.make_fake_engine(num_blocks=32, block_size=4, num_host_blocks=4, policy="tokenflow",
                                             late_copies=True)
    dst.add_request(list(range(1, 17)), SamplingParams(max_tokens=40), stream_id="old")
    tokens: dict[str, list[int]] = {}
    plans = []
    while dst.get_stream("old").num_host_tokens < 16:
        plans += factories.step_engine(dst, 1, tokens)
    in_flight = {c.host_block for c in plans[-1].write_through}
    assert in_flight and runner.late_copies
    dst.abort("old")  # its host blocks are free while their copy is still to land
    dst.import_stream(exported)
    assert set(dst.get_stream("moved").host_block_ids) & in_flight  # reused
    _run(dst, tokens)
    assert before + tokens["moved"] == reference
    assert dst.scheduler.bytes_from_host > 0 and dst.finished_records[-1].tokens_recomputed == 0


def test_an_import_waits_for_the_step_in_flight():
    """With overlapped scheduling a step is running between calls; an import must not write host blocks that
    step may still copy into (a stream aborted meanwhile frees them), so it finishes that step first."""
    exported, before, reference = _exported_stream(4)
    dst, runner = factories.make_fake_engine(num_blocks=32, block_size=4, num_host_blocks=8, policy="tokenflow",
                                             late_copies=True)
    dst.config = dataclasses.replace(dst.config, overlap_scheduling=True)
    dst.add_request(list(range(1, 17)), SamplingParams(max_tokens=20), stream_id="other")
    tokens: dict[str, list[int]] = {}
    for _ in range(2):
        for out in dst.step():
            tokens.setdefault(out.stream_id, []).extend(out.token_ids)
    assert dst._inflight is not None  # a step on the runner thread
    in_flight_at_import = []
    import_kv = runner.import_kv
    runner.import_kv = lambda blocks, data: in_flight_at_import.append(dst._inflight) or import_kv(blocks, data)
    dst.import_stream(exported)
    assert in_flight_at_import == [None]
    _run(dst, tokens)
    assert before + tokens["moved"] == reference
    assert tokens["other"] == runner.reference(list(range(1, 17)), 20)
