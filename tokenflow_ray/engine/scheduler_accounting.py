"""The live streams' books, a part of Scheduler (scheduler.py): streams entering and leaving, the block footprints
and working-set sums kept as they do, the view the policy decides on, and the invariants check.

A mixin: it uses the scheduler's `streams`, block pool, config, cost model, KV manager and the kept sums
(`_full_blocks`, `_life_blocks`, `_working_sums`), with `_finishing`, `_table_sent` and `_leaving` for the checks,
all set in Scheduler.__init__.
"""

from __future__ import annotations

from tokenflow_ray.engine.policies import SchedulerView
from tokenflow_ray.engine.stream import Stream, StreamStatus


class SchedulerAccounting:
    # ---- the live streams and the policy's view ---------------------------------------------------------------
    def _footprint(self, stream: Stream) -> tuple[int, int]:
        """Blocks of the stream at its full length, and of its prompt plus half its output: over its life a stream
        holds that on average (the batch the device holds)."""
        bs = self.pool.block_size
        prompt, max_tokens = len(stream.prompt_token_ids), stream.sampling.max_tokens
        return -(-(prompt + max_tokens) // bs), -(-(prompt + max_tokens // 2) // bs)

    def _enter(self, stream: Stream) -> None:
        self.streams[stream.stream_id] = stream
        self._working_sums = None
        full, life = self._footprint(stream)
        self._full_blocks += full
        self._life_blocks += life

    def _leave(self, stream_id: str) -> Stream | None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self._working_sums = None
            full, life = self._footprint(stream)
            self._full_blocks -= full
            self._life_blocks -= life
        return stream

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)

    def by_status(self, *statuses: StreamStatus) -> list[Stream]:
        if len(statuses) == 1:  # a pass over every live stream, several a step: one comparison each
            status = statuses[0]
            return [s for s in self.streams.values() if s.status == status]
        return [s for s in self.streams.values() if s.status in statuses]

    def rates_changed(self) -> None:
        """A live stream's declared rate changed (a client report): the view's rate sums are counted again."""
        self._working_sums = None

    def _count_working(self) -> tuple[int, float, int, float]:
        # The working set (Eq. 6's W): streams admitted and not finished, on the device or paused; a stream that
        # has never run is demand still outside it. One pass over the live streams, in their order.
        num_working = num_paced = 0
        sum_working = sum_paced = 0.0
        waiting = StreamStatus.WAITING
        for s in self.streams.values():
            rate = s.rate
            if s.status != waiting or s.record.preemptions:
                num_working += 1
                sum_working += rate
            if rate > 0:
                num_paced += 1
                sum_paced += rate
        self._working_sums = (num_working, sum_working, num_paced, sum_paced)
        return self._working_sums

    def view(self, now: float) -> SchedulerView:
        # Every step: the sums are kept between steps (_count_working), the block footprints as streams enter
        # and leave.
        num_working, sum_working, num_paced, sum_paced = self._working_sums or self._count_working()
        n = len(self.streams)
        mean_life = self._life_blocks / n if n else 1.0
        return SchedulerView(now=now, cost=self.cost, device_blocks=self.pool.num_blocks,
                             host_blocks=self.kv.host.num_blocks if self.kv.host else 0,
                             block_size=self.pool.block_size, max_num_seqs=self.config.max_num_seqs,
                             num_working=num_working, sum_rate=sum_working,
                             mean_full_blocks=self._full_blocks / n if n else 1.0,
                             mean_rate=sum_paced / num_paced if num_paced else 0.0,
                             max_device_batch=max(1, min(self.config.max_num_seqs,
                                                         int(self.pool.num_blocks / max(mean_life, 1.0)))))

    # ---- invariants -------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.kv.check_integrity(self.streams.values())
        assert self._finishing <= set(self.streams), "a stream marked as finishing is gone"
        assert set(self._table_sent) <= set(self.streams), "the runner is sent a table of a stream that is gone"
        assert self._leaving <= set(self.streams), "a stream held for export is gone"
        full, life = zip(*(self._footprint(s) for s in self.streams.values())) if self.streams else ((), ())
        assert (self._full_blocks, self._life_blocks) == (sum(full), sum(life)), \
            "the kept block footprints differ from the live streams'"
        kept = self._working_sums
        assert kept is None or kept == self._count_working(), "the kept working-set sums differ from a recount"
        for s in self.streams.values():
            assert not s.status.finished, f"{s.stream_id}: finished stream still live"
            assert s.num_computed_tokens <= s.num_tokens, f"{s.stream_id}: computed beyond its tokens"
            assert s.num_keyed_blocks <= len(s.block_ids), f"{s.stream_id}: offered blocks it does not hold"
            # A cached block in its table holds the stream's own content (its key is the stream's, or it has none).
            keys, own = self.pool.keys_of(s.block_ids), s.block_keys
            if keys[:len(own)] != own[:len(keys)] or keys[len(own):].count(None) != len(keys[len(own):]):
                for i, key in enumerate(keys):  # the slow walk: blocks cached by another stream are plain here
                    assert key is None or (i < len(own) and key == own[i]), \
                        f"{s.stream_id}: block {i} is cached with another prefix"
            if s.status == StreamStatus.RUNNING:
                lo, hi = self.pool.blocks_for_tokens(s.num_computed_tokens), self.pool.blocks_for_tokens(s.num_tokens)
                assert lo <= len(s.block_ids) <= hi, f"{s.stream_id}: block table does not match its tokens"
                # The blocks it writes next are its own: a block with two owners is never written.
                assert all(self.pool.refcount(b) == 1 for b in s.block_ids[s.num_computed_tokens // self.pool.block_size:]), \
                    f"{s.stream_id}: would write a shared block"
            elif s.status == StreamStatus.LOADING:
                assert len(s.block_ids) == self.pool.blocks_for_tokens(s.num_host_tokens), s.stream_id
            else:
                assert not s.block_ids and s.num_computed_tokens == 0, f"{s.stream_id}: paused but owns blocks"
            if s.status == StreamStatus.PREEMPTED:
                assert s.num_host_tokens > 0, f"{s.stream_id}: preempted to the host with nothing there"
