"""Persistent step state: the torch runner's preallocated block tables, kept by the plans' diffs, stay equal to
the scheduler's tables through joins, growth, preemption (host and recompute), reloads and finishes; the decode
and prefill metadata built from them equal what the whole tables give."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.engine.factories import make_fake_engine
from tokenflow_ray.engine.plan import PENDING_TOKEN, ScheduledChunk, StepPlan
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import StreamStatus
from tokenflow_ray.runner.step_staging import StagingBuffer
from tokenflow_ray.runner.step_state import PersistentBatch


def _expected_slots(tables: dict[str, list[int]], plan: StepPlan, bs: int) -> list[int]:
    out = []
    for c in (*plan.decodes, *plan.prefills):
        t = tables[c.stream_id]
        out += [t[p // bs] * bs + p % bs for p in range(c.start_pos, c.start_pos + len(c.token_ids))]
    return out


def _check_varlen(form, step, plan: StepPlan, engine, bs: int) -> None:
    """The varlen form names the same tokens, positions and slots as the gathered form, and through each sequence's
    table row the scheduler's blocks, its length after the step and where its tokens start."""
    meta = form.meta
    assert form.input_ids.tolist() == step.input_ids.tolist()
    assert form.positions.tolist() == step.positions.tolist()
    assert meta.slot_mapping.tolist() == step.meta.slot_mapping.tolist()
    assert (form.sample_rows, form.sample_ids) == (step.sample_rows, step.sample_ids)
    chunks = (*plan.decodes, *plan.prefills)
    assert meta.num_seqs == len(chunks) and meta.seq_lens.tolist() == [c.start_pos + len(c.token_ids)
                                                                       for c in chunks]
    lens = [len(c.token_ids) for c in chunks]
    assert meta.max_query_len == max(lens)
    if plan.prefills:
        assert meta.query_start.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    else:
        assert meta.query_start is None
    for c, row in zip(chunks, meta.seq_rows.tolist()):
        want = engine.scheduler.streams[c.stream_id].block_ids
        need = -(-(c.start_pos + len(c.token_ids)) // bs)
        assert meta.block_tables[row, :need].tolist() == want[:need]
    if form.sample_index is not None:
        assert form.sample_index.tolist() == form.sample_rows


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
    # The Triton backend's varlen form, built from host lists (CPU) and staged (the CUDA path: one copy a step,
    # table diffs sent with the inputs, a scratch row 0), in lockstep too.
    varlen = PersistentBatch(max_rows=4, max_blocks_per_seq=64, block_size=bs, device=torch.device("cpu"),
                             varlen=True)
    staged = PersistentBatch(max_rows=4, max_blocks_per_seq=64, block_size=bs, device=torch.device("cpu"),
                             varlen=True, staging=StagingBuffer(4096, torch.device("cpu")), scratch_block=39)
    rng = random.Random(seed)
    execute = fake.execute
    checked = {"chunks": 0}
    fresh: dict[str, int] = {}  # stream -> chunks that started its table afresh

    def run(plan: StepPlan):
        batch.apply(plan)
        by_row.apply(plan)
        varlen.apply(plan)
        staged.apply(plan)
        if plan.decodes or plan.prefills:
            step = batch.inputs(plan, scale=1.0)
            other = by_row.inputs(plan, scale=1.0)
            copies = staged.staging.copies
            for form in (varlen.inputs(plan, scale=1.0), staged.inputs(plan, scale=1.0)):
                _check_varlen(form, step, plan, engine, bs)
            assert staged.staging.copies == copies + 1
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
            assert varlen.table(c.stream_id) == staged.table(c.stream_id) == batch.table(c.stream_id)
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


def _staged(rows: int = 6) -> PersistentBatch:
    return PersistentBatch(max_rows=rows, max_blocks_per_seq=8, block_size=4, device=torch.device("cpu"),
                           varlen=True, staging=StagingBuffer(256, torch.device("cpu")), scratch_block=63)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_staged_step_is_one_copy_and_no_host_reads():
    """A step's inputs, a new block and a PENDING token included, reach the device in one copy: no tensor is made
    from host data (aten.lift_fresh: torch.tensor), nothing is converted on the way (_to_copy), nothing is read
    back (_local_scalar_dense: .item(); nonzero: boolean indexing), each of which is a copy or a sync on CUDA."""
    batch = _staged()
    start = StepPlan(0, prefills=(ScheduledChunk("a", (1, 2, 3, 4), 0, (7,), 0, True),
                                  ScheduledChunk("b", (4, 5), 0, (9,), 0, True)))
    batch.apply(start)
    batch.record_sampled(torch.tensor([11, 12]), batch.inputs(start, scale=1.0))
    plan = StepPlan(1, decodes=(ScheduledChunk("a", (PENDING_TOKEN,), 4, (8,), 1, True),
                                ScheduledChunk("b", (PENDING_TOKEN,), 2, (), 1, True)))
    copies = batch.staging.copies
    with _Recorder() as rec:
        batch.apply(plan)
        step = batch.inputs(plan, scale=1.0, pad_to=4)
    assert batch.staging.copies == copies + 1
    assert rec.ops.count("aten.copy_.default") == 1
    assert not {"aten.lift_fresh.default", "aten._to_copy.default", "aten._local_scalar_dense.default",
                "aten.nonzero.default"} & set(rec.ops)
    assert step.input_ids.tolist() == [11, 12, 0, 0]  # the sampled tokens, filled in on the device; padding
    assert step.positions.tolist() == [4, 2, 0, 0]
    assert step.meta.slot_mapping.tolist() == [8 * 4, 9 * 4 + 2, 63 * 4, 63 * 4]
    assert batch.tables[batch.row_of["a"], :2].tolist() == [7, 8]  # the new block, scattered on the device
    assert step.meta.seq_rows.tolist()[2:] == [0, 0] and batch.tables[0].tolist() == [63] * 8
    assert step.meta.seq_lens.tolist() == [5, 3, 1, 1] and step.sample_index is None


def test_pending_tokens_on_the_device_equal_the_host_substitution():
    """Overlapped scheduling: a decode and a recompute chunk whose last token is PENDING; the recomputed stream has
    a new table row, so its token is read from the row it was sampled at."""
    host = PersistentBatch(max_rows=6, max_blocks_per_seq=8, block_size=4, device=torch.device("cpu"), varlen=True)
    dev = _staged()
    start = StepPlan(0, prefills=(ScheduledChunk("a", (1, 2, 3), 0, (7,), 0, True),
                                  ScheduledChunk("b", (4, 5, 6, 7), 0, (9, 10), 0, True)))
    nxt = StepPlan(1, decodes=(ScheduledChunk("a", (PENDING_TOKEN,), 3, (), 1, True),),
                   prefills=(ScheduledChunk("c", (8, 9), 0, (2,), 0, True),
                             ScheduledChunk("b", (4, 5, 6, 7, PENDING_TOKEN), 0, (3, 5), 0, True)),
                   preempted=("b",))
    for batch in (host, dev):
        batch.apply(start)
        step = batch.inputs(start, scale=1.0)
        batch.last_sampled.update({"a": 31, "b": 32})
        batch.record_sampled(torch.tensor([31, 32]), step)
    rows_before = dict(dev.row_of)
    for batch in (host, dev):
        batch.apply(nxt)
    assert dev.row_of["b"] != rows_before["b"]
    want = host.inputs(nxt, scale=1.0)
    got = dev.inputs(nxt, scale=1.0)
    assert got.input_ids.tolist() == want.input_ids.tolist() == [31, 8, 9, 4, 5, 6, 7, 32]
    assert got.meta.slot_mapping.tolist() == want.meta.slot_mapping.tolist()
    assert got.sample_index.tolist() == want.sample_rows == [0, 2, 7]
