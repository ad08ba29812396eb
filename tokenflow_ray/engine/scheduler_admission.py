"""Who holds the device, a part of Scheduler (scheduler.py): the rebalance that chooses the device set and pauses
streams outside it, admission and resume in the policy's order (reload or recompute), and the mechanics the step
shares with them: a stream's next chunk and a preemption (to the host store or to recompute).

A mixin: it uses the scheduler's config, cache config, block pool, policy, KV manager, cost model, `streams`,
`by_status`, and the runner-facing state (`_announced`, `_table_sent`, `_swap_blocks`, `_leaving`,
`_working_sums`), all set in Scheduler.__init__.
"""

from __future__ import annotations

from tokenflow_ray.engine.plan import ScheduledChunk
from tokenflow_ray.engine.policies import SchedulerView
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import Stream, StreamStatus

_ACTIVE = (StreamStatus.RUNNING, StreamStatus.LOADING)
_PACE_TOKENS = 8  # a running stream's pace is read over this many of its last tokens (_freed_by_finishing)
new_tuple = tuple.__new__  # a chunk made as the tuple it is, without NamedTuple's Python __new__ (_chunk says why)


class SchedulerAdmission:
    # ---- rebalance and admission ------------------------------------------------------------------------------
    def _rebalance(self, ranked: list[Stream], view: SchedulerView) -> tuple[list[Stream], list[str]]:
        """Choose the device set and pause running streams outside it, as many as the incoming streams need.
        Returns (the chosen set in rank order, the streams paused)."""
        limit = self.policy.admission_limit(view)
        chosen: list[Stream] = []
        used = 0
        working = view.num_working
        for s in ranked:
            if len(chosen) >= self.config.max_num_seqs:
                break
            if s.stream_id in self._leaving:
                continue
            is_new = s.status == StreamStatus.WAITING and not s.num_preemptions
            if is_new and working >= limit:
                continue
            need = self.pool.blocks_for_tokens(s.num_tokens + 1 + self.policy.growth_tokens(s))
            if used + need <= self.pool.num_blocks:
                chosen.append(s)
                used += need
                working += is_new  # only a stream that joins the set grows the working set
        chosen = self.policy.refine(chosen, ranked, view)
        members = {s.stream_id for s in chosen}
        incoming = self._admissible_before_next_rebalance([s for s in chosen if s.status not in _ACTIVE],
                                                          len(chosen), view)
        if self.policy.resumes_behind(self.by_status(StreamStatus.PREEMPTED), view):
            # A paused stream is late: a pause for a new stream now would be one more reader to bring back.
            incoming = [s for s in incoming if s.num_preemptions]
        # The incoming streams need blocks and sequence slots: the set is capped by max_num_seqs as well as memory.
        deficit = sum(self.pool.blocks_for_tokens(s.num_tokens + 1) for s in incoming) - self.pool.num_free
        slots = len(self.by_status(*_ACTIVE)) + len(incoming) - self.config.max_num_seqs
        if (deficit > 0 or slots > 0) and (patience := self.policy.patience_s(view)) > 0:
            freed, ending = self._freed_by_finishing(patience, view)
            deficit, slots = deficit - freed, slots - ending
        paused: list[str] = []
        for s in reversed(ranked):
            if deficit <= 0 and slots <= 0:
                break
            if s.status == StreamStatus.RUNNING and s.stream_id not in members and self.policy.may_preempt(s, view):
                deficit -= len(s.block_ids)
                slots -= 1
                self._preempt(s, view)
                paused.append(s.stream_id)
        return chosen, paused

    def _freed_by_finishing(self, within_s: float, view: SchedulerView) -> tuple[int, int]:
        """(blocks, slots) that running streams free by finishing within `within_s`: near capacity the pool turns
        over by itself, and a stream paused for what would be free in a moment only adds a swap and a reader who may
        stall when it cannot come back. A stream's pace is the slower of a step a token and its own over its last
        `_PACE_TOKENS` tokens, so a stream that has been slow (held, or in long mixed steps) is not counted on to
        finish soon."""
        step_s = max(view.cost.step_s, 1e-6)
        blocks = ending = 0
        k = _PACE_TOKENS
        for s in self.by_status(StreamStatus.RUNNING):
            times = s.record.token_times
            if s.num_uncomputed_tokens > 1 or len(times) < 2:
                continue  # mid-prefill or just started: no pace of its own yet
            left = s.sampling.max_tokens - s.num_output_tokens
            recent = times[-k:]
            per_token = max(step_s, (recent[-1] - recent[0]) / (len(recent) - 1))
            if left * per_token <= within_s:
                blocks += len(s.block_ids)
                ending += 1
        return blocks, ending

    def _admissible_before_next_rebalance(self, incoming: list[Stream], set_size: int,
                                          view: SchedulerView) -> list[Stream]:
        """The incoming streams (rank order) whose prefill the steps until the next rebalance can take: pausing
        a running stream for one that cannot start yet only stalls its reader. Paused streams that come back by
        reload also share the policy's load budget (`load_budget_blocks`); one past it waits for a later rebalance
        while the streams behind it that need no reload still come in."""
        steps = max(1.0, self.policy.rebalance_interval_s / max(view.cost.step_s, 1e-4))
        per_step = max(1, self.config.max_num_batched_tokens - (set_size - len(incoming)))  # decodes come first
        budget = steps * per_step
        loads = self.policy.load_budget_blocks(view)
        taken: list[Stream] = []
        for s in incoming:
            if s.status == StreamStatus.PREEMPTED and s.num_host_tokens:
                need = self.pool.blocks_for_tokens(s.num_host_tokens)
                if taken and need > loads:
                    continue
                loads -= need
            budget -= s.num_uncomputed_tokens
            if taken and budget < 0:
                break
            taken.append(s)
        return taken

    def _admit(self, order: list[Stream], view: SchedulerView, budget: int, prefills: list[ScheduledChunk],
               new_streams: list[tuple[str, SamplingParams]], preempted_now: set[str]) -> int:
        """Admit or resume streams in the given order; a stream that cannot start stops the walk (the order is
        the policy's, so nobody behind it jumps ahead)."""
        num_active = reserve = -1  # computed at the first candidate: a step with none (all decoding) skips them
        pledged = 0  # blocks the loads started below need for their first token, beyond the blocks they load
        limit = self.policy.admission_limit(view)
        working = view.num_working
        waiting, paused = StreamStatus.WAITING, StreamStatus.PREEMPTED
        max_num_seqs, leaving = self.config.max_num_seqs, self._leaving
        caching = self.pool.caching
        host_caching = caching and self.kv.host is not None and self.kv.host.caching
        if working >= limit:
            # No new stream joins this step (the working set only grows below), and a stream's status changes
            # only when the walk reaches it: the walk meets exactly the paused streams and those to recompute.
            order = [s for s in order if s.status == paused or (s.status == waiting and s.record.preemptions)]
        # The walk passes every live stream each step: the skips first and cheapest. A skip changes nothing, so
        # taking a new stream's skip before the checks below that break the walk gives the same walk (a break
        # they would make at a skipped stream, the next stream that is not skipped makes, or the walk ends).
        for stream in order:
            status = stream.status
            if status == waiting:
                is_new = not stream.record.preemptions
                if is_new and working >= limit:
                    continue  # the working set is full: new streams wait, resumes still go ahead
            elif status == paused:
                is_new = False
            else:
                continue  # running or loading
            if num_active < 0:  # nothing below has changed a stream yet: the same as computing them up front
                active = self.by_status(*_ACTIVE)
                num_active = len(active)
                reserve = self.policy.reserve_tokens(active)  # grows with each stream admitted below
            if budget <= 0 or num_active >= max_num_seqs:
                break
            if stream.stream_id in preempted_now or stream.stream_id in leaving:
                continue  # paused this step (its tail is still being copied), or about to move to another engine
            if not is_new and self.policy.reserve_on_resume and self.pool.num_free - self.pool.blocks_for_tokens(
                    stream.num_tokens) < self.pool.blocks_for_tokens(reserve):
                break  # a resume, too, leaves the running streams room to grow (keep rank order)
            if status == paused:
                if self._resume_by_load(stream, view):
                    # Room for the load and its first token: a stream loaded at a block boundary into a pool
                    # with no block left is a memory-forced victim at its first decode (itself, when it ranks
                    # last), its load wasted; without write-through it is copied out whole again.
                    loaded = self.pool.blocks_for_tokens(stream.num_host_tokens)
                    first = self.pool.blocks_for_tokens(stream.num_host_tokens + 1)
                    # Its blocks still cached on the device are taken, not loaded (prefix caching).
                    cached = self._cached_prefix(stream, stream.num_host_tokens // self.pool.block_size)
                    if not self.pool.can_allocate(first + pledged) or not self.kv.start_load(stream, cached):
                        break  # no memory: keep rank order
                    pledged += first - loaded
                    if caching:
                        self._count_start(stream, len(cached) * self.pool.block_size, first=False)
                    if self.kv.is_loading(stream):
                        stream.status = StreamStatus.LOADING
                    else:  # all of it was still on the device
                        self.kv.finish_load(stream, keep_host_copy=self.cache.write_through)
                        stream.status = StreamStatus.RUNNING
                    self._announce(stream, new_streams)  # an imported stream's first plan here may be its load
                    num_active += 1
                    reserve += self.policy.reserve_tokens([stream])
                    continue
                first = self.pool.blocks_for_tokens(min(stream.num_tokens, budget))
                if not self.pool.can_allocate(first + pledged):
                    break  # keep the host copy: nothing is gained by dropping it without room to recompute
                stream.record.record_recompute(stream.num_host_tokens)
                stream.num_dropped_tokens = stream.num_host_tokens
                self.kv.release_host(stream)
                stream.status = StreamStatus.WAITING
            if host_caching and status == waiting and (found := self._host_prefix(stream, view)) is not None:
                # Its prompt's prefix is on the host, past what the device holds: it starts by loading it, as a
                # resume does (prefix_cache.py).
                host_hits, cached = found
                first = self.pool.blocks_for_tokens(len(host_hits) * self.pool.block_size + 1)
                if not self.pool.can_allocate(first + pledged) or not self._start_host_load(stream, host_hits, cached):
                    break  # no memory: keep rank order
                pledged += first - len(host_hits)
                self._count_start(stream, len(cached) * self.pool.block_size, first=is_new,
                                  host_tokens=(len(host_hits) - len(cached)) * self.pool.block_size)
                stream.status = StreamStatus.LOADING
                self._announce(stream, new_streams)
                if is_new:  # it joins the working set
                    working += 1
                    self._working_sums = None
                num_active += 1
                reserve += self.policy.reserve_tokens([stream])
                continue
            hit = self._take_prefix(stream) if caching else 0  # it starts after its cached prefix
            n = self._chunk_len(stream, budget)
            if (is_new and self.pool.num_free - self.pool.blocks_for_tokens(n) < self.pool.blocks_for_tokens(reserve)) \
                    or n == 0 or (pledged and not self.pool.can_allocate(self.pool.blocks_for_tokens(n) + pledged)) \
                    or not self.kv.grow(stream, n):
                # Memory-aware admission (running streams keep room to grow), or no room: head-of-line, admission
                # keeps the policy's order.
                if hit:
                    self._drop_prefix(stream)
                break
            self._count_start(stream, hit, first=is_new)  # with caching off too: the prompt tokens a hit rate divides
            stream.status = StreamStatus.RUNNING
            prefills.append(self._chunk(stream, n))
            self._announce(stream, new_streams)
            if is_new:  # it joins the working set
                working += 1
                self._working_sums = None
            num_active += 1
            budget -= n
            reserve += self.policy.reserve_tokens([stream])
        return budget

    def _announce(self, stream: Stream, new_streams: list[tuple[str, SamplingParams]]) -> None:
        """The runner learns a stream's sampling parameters with the first plan that schedules it."""
        if stream.stream_id not in self._announced:
            self._announced.add(stream.stream_id)
            new_streams.append((stream.stream_id, stream.sampling))

    def _resume_by_load(self, stream: Stream, view: SchedulerView | None = None, tokens: int | None = None) -> bool:
        """Reload or recompute, with the copies queued ahead of it now: tails being evicted this step and loads
        still waiting (paper §4.2.3, t_IO against t_recompute). The policy weighs the two (`resume_by_load`);
        without a view, the paper's rule: the sooner. `tokens`: what would load (its host prefix by default; a
        prompt's prefix found on the host, past what the device holds)."""
        tokens = stream.num_host_tokens if tokens is None else tokens
        if tokens == 0 or self.cache.resume_mode == "recompute":
            return False
        if self.cache.resume_mode == "load":
            return True
        t_io = self.cost.t_io(load_blocks=self.pool.blocks_for_tokens(tokens),
                              evict_blocks=self.kv.planned_evict_blocks, queued_blocks=self.kv.queued_load_blocks)
        t_recompute = self.cost.t_recompute(tokens)
        if view is None:
            return t_io <= t_recompute
        return self.policy.resume_by_load(stream, t_io, t_recompute, view)

    # ---- mechanics --------------------------------------------------------------------------------------------
    def _chunk_len(self, stream: Stream, budget: int) -> int:
        remaining = stream.num_uncomputed_tokens
        if remaining <= budget:
            return remaining
        if self.config.chunked_prefill:
            return budget
        # Unchunked, a recompute that outgrew the budget would never run: let it chunk when it has the step alone.
        return budget if budget == self.config.max_num_batched_tokens else 0

    def _chunk(self, stream: Stream, n: int) -> ScheduledChunk:
        start, blocks, sid = stream.num_computed_tokens, stream.block_ids, stream.stream_id
        table_sent = self._table_sent
        sent, held = table_sent.get(sid, 0), len(blocks)
        if held != sent:
            table_sent[sid] = held
        prompt, out = stream.prompt_token_ids, stream.output_token_ids
        p = len(prompt)
        # A decode's one token, read directly (every running stream, every step); longer chunks slice.
        tokens = (out[start - p],) if n == 1 and start >= p else stream.token_ids(start, start + n)
        # Positional: stream_id, token_ids, start_pos, new_blocks, first_block, sample; made as the tuple it is
        # (a NamedTuple's own __new__ is a Python call: 2.5x the cost, per running stream per step).
        new_blocks = tuple(blocks[sent:]) if held > sent else ()
        return new_tuple(ScheduledChunk, (sid, tokens, start, new_blocks, sent, start + n == p + len(out)))

    def _preempt(self, stream: Stream, view: SchedulerView, to_host: bool | None = None) -> int:
        """Pause a running stream; returns its blocks that are free only after this step (its tail's copy)."""
        self._table_sent.pop(stream.stream_id, None)  # its blocks go; the runner drops the table (plan.preempted)
        to_host = self.policy.uses_host_store if to_host is None else to_host
        swapped = self.kv.swap_out(stream) if to_host else None
        later = 0
        if swapped is not None:
            self._swap_blocks[stream.stream_id] = swapped
            stream.status = StreamStatus.PREEMPTED
            later = swapped[1]
        else:  # recompute: everything computed so far is computed again later
            stream.record.record_recompute(stream.num_computed_tokens)
            stream.num_dropped_tokens = stream.num_computed_tokens
            self.kv.release_device(stream)
            self.kv.release_host(stream)
            stream.status = StreamStatus.WAITING
        stream.last_preempted_at = view.now
        stream.record.record_preemption()
        self.policy.on_preempt(stream, view)
        return later
