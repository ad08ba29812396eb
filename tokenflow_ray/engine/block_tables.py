"""The runner's side of the block-table contract, in pure Python: every scheduled stream's device block table,
kept by applying each plan's diffs (ScheduledChunk.new_blocks / first_block, plan.finished / plan.preempted).

The fake runner computes every KV slot through it, so a diff the scheduler gets wrong corrupts the fake model's
output in every scheduler test; the torch runner keeps the same tables in a preallocated tensor
(runner/step_state.py) and is checked against this one.
"""

from __future__ import annotations

from tokenflow_ray.engine.plan import ScheduledChunk, StepPlan


class BlockTables:
    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, plan: StepPlan) -> None:
        for sid in (*plan.finished, *plan.preempted):
            self.tables.pop(sid, None)
        for chunk in (*plan.decodes, *plan.prefills):
            self.extend(chunk)

    def extend(self, chunk: ScheduledChunk) -> list[int]:
        if chunk.first_block == 0:
            table = self.tables[chunk.stream_id] = []
        else:
            table = self.tables.get(chunk.stream_id)
            if table is None or len(table) != chunk.first_block:
                raise AssertionError(f"{chunk.stream_id}: block-table diff starts at {chunk.first_block}, the "
                                     f"runner holds {None if table is None else len(table)} blocks")
        table.extend(chunk.new_blocks)
        return table
