"""Migration on the scheduler's side, a part of Scheduler (scheduler.py): a stream held for export (never admitted
or resumed here again), released once paused with no copy in flight, and an imported stream adopted, paused
(the engine's half: engine_migration.py).

A mixin: it uses the scheduler's `streams`, `check_admissible`, `_enter`/`_leave`, block pool, KV manager and the
runner-facing state (`_leaving`, `_swap_blocks`, `_preempted_since_plan`, `_announced`, `_table_sent`,
`_finished_since_plan`), all set in Scheduler.__init__.
"""

from __future__ import annotations

from tokenflow_ray.engine.migration import StreamNotExportable
from tokenflow_ray.engine.stream import Stream, StreamStatus


class SchedulerMigration:
    # ---- an exit that is not an abort, an entry for a paused stream -------------------------------------------
    def hold_for_export(self, stream_id: str) -> None:
        """The stream is to leave: from now on it is never admitted or resumed here (a running one is paused by
        the caller with `preempt`). Unknown or finished ids raise StreamNotExportable."""
        if stream_id not in self.streams:
            raise StreamNotExportable(f"stream {stream_id!r} is unknown or finished")
        self._leaving.add(stream_id)

    def is_leaving(self, stream_id: str) -> bool:
        return stream_id in self._leaving

    def cancel_export(self, stream_id: str) -> None:
        self._leaving.discard(stream_id)

    def exportable(self, stream_id: str) -> bool:
        """Paused (host KV complete, or none) with no copy of its KV in flight: it can leave between steps."""
        stream = self.streams.get(stream_id)
        return (stream is not None and stream.status in (StreamStatus.PREEMPTED, StreamStatus.WAITING)
                and stream_id not in self._swap_blocks and stream_id not in self._preempted_since_plan)

    def release(self, stream_id: str) -> Stream:
        """Take an exportable stream out, unfinished: its host blocks are freed (the caller has read them), the
        runner drops its state with the next plan, and its reader and record are left as they are."""
        if not self.exportable(stream_id):
            raise StreamNotExportable(f"stream {stream_id!r} cannot leave now (running, loading or copying)")
        stream = self._leave(stream_id)
        self._leaving.discard(stream_id)
        self.kv.release_host(stream)
        self._table_sent.pop(stream_id, None)
        if stream_id in self._announced:
            self._announced.discard(stream_id)
            self._finished_since_plan.append(stream_id)
        return stream

    def adopt(self, stream: Stream, num_kv_tokens: int) -> list[int]:
        """Enter an imported stream, paused. With KV for its first num_kv_tokens tokens and room in the host
        store it is PREEMPTED on host blocks allocated here (returned: the caller writes the data into them), and
        resumes by load or recompute like any paused stream; otherwise it is WAITING and recomputes."""
        self.check_admissible(stream)
        if not 0 <= num_kv_tokens < stream.num_tokens + 1:
            raise ValueError(f"adopt: {num_kv_tokens} KV tokens for a stream of {stream.num_tokens}")
        stream.block_ids, stream.num_computed_tokens = [], 0
        needed = self.pool.blocks_for_tokens(num_kv_tokens)
        host_ids: list[int] = []
        if num_kv_tokens and self.kv.host is not None and self.kv.host.can_allocate(needed):
            host_ids = self.kv.host.allocate(needed)
            stream.host_block_ids, stream.num_host_tokens = list(host_ids), num_kv_tokens
            stream.status = StreamStatus.PREEMPTED
        else:
            if num_kv_tokens:
                stream.record.record_recompute(num_kv_tokens)
                stream.num_dropped_tokens = num_kv_tokens
            stream.host_block_ids, stream.num_host_tokens = [], 0
            stream.status = StreamStatus.WAITING
        self._enter(stream)
        return host_ids
