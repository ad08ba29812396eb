"""Persistent step state: the torch runner's preallocated block tables, kept by the plans' diffs, stay equal to
the scheduler's tables through joins, growth, preemption (host and recompute), reloads and finishes; the decode
and prefill metadata built from them equal what the whole tables give."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.plan import PENDING_TOKEN, ScheduledChunk, StepPlan
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus
from tokenflow_ray.runner.step_state import PersistentBatch


def _expected_slots(tables: dict[str, list[int]], plan: StepPlan, bs: int) -> list[int]:
    out = []
    for c in (*plan.decodes, *plan.prefills):
        t = tables[c.stream_id]
        out += [t[p // bs] * bs + p % bs for p in range(c.start_pos, c.start_pos + len(c.token_ids))]
    return out


@pytest.mark.parametrize("policy,host,seed", [("fcfs", 0, 0), ("tokenflow", 256, 1), ("andes", 0, 2),
                                              ("tokenflow", 256, 3)])
def test_tables_follow_the_scheduler_through_preemption(policy, host, seed):
    bs = 4
    engine, fake = make_fake_engine(num_blocks=40, block_size=bs, max_num_seqs=6, max_num_batched_tokens=24,
                                    policy=policy, num_host_blocks=host)
    # Fewer rows than live streams over the run: rows are reused, and the tensor grows if it must.
    batch = PersistentBatch(max_rows=4, max_blocks_per_seq=64, block_size=bs, device=torch.device("cpu"))
    # The CPU paged kernel's form of the same metadata, kept in lockstep: its rows and positions must name the
    # same tables and lengths as the gathered ones.
    by_row = PersistentBatch(max_rows=4, max_blocks_per_seq=64, block_size=bs, device=torch.device("cpu"),
                             tables_by_row=True)
    rng = random.Random(seed)
    execute = fake.execute
    checked = {"chunks": 0}
    fresh: dict[str, int] = {}  # stream -> chunks that started its table afresh

    def run(plan: StepPlan):
        batch.apply(plan)
        by_row.apply(plan)
        if plan.decodes or plan.prefills:
            step = batch.inputs(plan, scale=1.0)
            other = by_row.inputs(plan, scale=1.0)
            assert other.meta.slot_mapping.tolist() == step.meta.slot_mapping.tolist()
            assert other.input_ids.tolist() == step.input_ids.tolist()
            if plan.decodes:
                assert other.meta.decode_seq_lens is None
                assert (other.meta.decode_positions + 1).tolist() == step.meta.decode_seq_lens.tolist()
                width = step.meta.decode_block_tables.shape[1]
                rows = other.meta.decode_block_tables[other.meta.decode_rows, :width]
                for c, got, want in zip(plan.decodes, rows.tolist(), step.meta.decode_block_tables.tolist()):
                    n = -(-(c.start_pos + 1) // bs)  # the blocks the kernel reads
                    assert got[:n] == want[:n]
            else:
                assert other.meta.decode_rows is None
            assert step.meta.slot_mapping.tolist() == _expected_slots(fake.block_tables.tables | {
                c.stream_id: engine.scheduler.streams[c.stream_id].block_ids
                for c in (*plan.decodes, *plan.prefills)}, plan, bs)
            if plan.decodes:
                lens = step.meta.decode_seq_lens.tolist()
                assert lens == [c.start_pos + 1 for c in plan.decodes]
                for c, row in zip(plan.decodes, step.meta.decode_block_tables.tolist()):
                    want = engine.scheduler.streams[c.stream_id].block_ids
                    assert row[:len(want)] == want[:len(row)]
        result = execute(plan)
        for c in (*plan.decodes, *plan.prefills):  # after the step, the runner's tables are the scheduler's
            assert batch.table(c.stream_id) == fake.block_tables.tables[c.stream_id] == \
                engine.scheduler.streams[c.stream_id].block_ids
            # The host mirror decode slots are read from is the tensor's table, row for row.
            assert batch.host_tables[batch.row_of[c.stream_id]] == batch.table(c.stream_id)
            checked["chunks"] += 1
            if c.first_block == 0:
                fresh[c.stream_id] = fresh.get(c.stream_id, 0) + 1
        return result

    engine.runner.execute = run
    sids = []
    for step in range(600):
        if step < 40 and rng.random() < 0.5:
            n = rng.randint(3, 20)
            sids.append(engine.add_request([rng.randrange(200) for _ in range(n)],
                                           SamplingParams(max_tokens=rng.randint(4, 40), ignore_eos=True)))
        running = [s for s in engine.scheduler.streams.values() if s.status == StreamStatus.RUNNING]
        if running and rng.random() < 0.1:
            engine.scheduler.preempt(rng.choice(running).stream_id, engine.clock.now())
        if running and rng.random() < 0.03:
            engine.abort(rng.choice(running).stream_id)
        engine.step()
        engine.check_integrity()
        # No table outlives its stream: a finished one is dropped with the next plan's `finished`.
        assert set(batch.row_of) <= set(engine.scheduler.streams) | set(engine.scheduler._finished_since_plan)
        engine.clock.advance(0.01)
        if step >= 40 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert checked["chunks"] > 100 and max(fresh.values()) > 1  # resumed/recomputed streams restarted tables


def test_a_diff_that_skips_blocks_is_refused():
    batch = PersistentBatch(max_rows=2, max_blocks_per_seq=8, block_size=4, device=torch.device("cpu"))
    batch.apply(StepPlan(0, prefills=(ScheduledChunk("a", (1, 2, 3, 4, 5), 0, (7, 3), 0, True),)))
    assert batch.table("a") == [7, 3]
    with pytest.raises(RuntimeError, match="diff starts at 3"):
        batch.apply(StepPlan(1, decodes=(ScheduledChunk("a", (9,), 8, (5,), 3, True),)))
    with pytest.raises(RuntimeError, match="outgrows"):
        batch.apply(StepPlan(2, decodes=(ScheduledChunk("a", (9,), 8, tuple(range(7)), 2, True),)))


def test_pending_decode_input_is_the_last_sampled_token():
    batch = PersistentBatch(max_rows=2, max_blocks_per_seq=8, block_size=4, device=torch.device("cpu"))
    plan = StepPlan(0, decodes=(ScheduledChunk("a", (PENDING_TOKEN,), 4, (1, 2), 0, True),
                                ScheduledChunk("b", (11,), 0, (5,), 0, True)))
    batch.apply(plan)
    batch.last_sampled["a"] = 42
    step = batch.inputs(plan, scale=1.0)
    assert step.input_ids.tolist() == [42, 11]
    assert step.positions.tolist() == [4, 0] and step.meta.slot_mapping.tolist() == [8, 20]
