"""Continuous batching with chunked prefill, buffer-aware preemption and a host spill store.

No prefill/decode phases: each step every scheduled stream gets tokens so that its computed tokens catch up with
its total (vLLM v1's rule), under a per-step token budget. One step, in order:
1. Rebalance (proactive policies, when the policy says so): take the policy's ranking, choose greedily the streams
   that should hold the device, and pause running streams outside that set that the policy lets go, as many as
   the incoming ones need (blocks and sequence slots).
2. Serve running streams in rank order; when one cannot grow, the lowest-ranked unserved running stream is
   preempted (memory-forced).
3. Unless memory forced a preemption (so a full pool does not thrash), admit or resume streams: the set the
   rebalance chose first, then the rest in rank order. A preempted stream resumes by loading its host copy or by
   recompute, whichever the cost model finds cheaper given the copies queued ahead of it.
4. Copies share one budget per step (what finishes within the step's compute time): the tails of streams
   preempted this step, then queued loads (chunked over steps), then write-through of full blocks, larger buffers
   first (likelier victims).
Preemption goes to the host store when the policy uses it and the store has room, else to recompute.
"""

from __future__ import annotations

import itertools

from tokenflow_ray.engine.block_pool import BlockPool
from tokenflow_ray.engine.config import CacheConfig, SchedulerConfig
from tokenflow_ray.engine.cost_model import CostModel
from tokenflow_ray.engine.kv_manager import KVManager
from tokenflow_ray.engine.migration import StreamNotExportable
from tokenflow_ray.engine.plan import PENDING_TOKEN, ScheduledChunk, StepPlan, StepResult
from tokenflow_ray.engine.policies import SchedulerView, SchedulingPolicy, make_policy
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import Stream, StreamStatus

_ACTIVE = (StreamStatus.RUNNING, StreamStatus.LOADING)
_new_tuple = tuple.__new__


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, cache: CacheConfig | None = None,
                 cost: CostModel | None = None, policy: SchedulingPolicy | None = None) -> None:
        self.config = config
        self.cache = cache or CacheConfig(block_size=block_pool.block_size, num_device_blocks=block_pool.num_blocks)
        self.pool = block_pool
        self.policy = policy or make_policy(config.policy, config.tokenflow, config.andes, config.fcfs_reserve_ratio)
        host = BlockPool(self.cache.num_host_blocks, block_pool.block_size) if self.cache.num_host_blocks else None
        self.kv = KVManager(block_pool, host)
        self.cost = cost or CostModel(block_bytes=64 * block_pool.block_size,
                                      prefill_chunk_tokens=config.max_num_batched_tokens)
        self.streams: dict[str, Stream] = {}  # live (unfinished) streams: entered and left by _enter and _leave
        # Σ over live streams of their blocks at full length and of their average holding (view()), kept as they
        # enter and leave rather than summed every step.
        self._full_blocks = self._life_blocks = 0
        # view()'s counts and rate sums over the live streams, kept until a stream enters, leaves, joins the
        # working set or changes its rate (None: count again, in the same order, so the float sums are the same).
        self._working_sums: tuple[int, float, int, float] | None = None
        # Preemption cost (decision -> device blocks free), per block of each swap-out preemption: mirrored blocks
        # are free at the decision (0); tail blocks when their own copy to the host is done (StepResult.swap_out_s).
        self.preempt_costs_s: list[float] = []  # per preemption: block-weighted mean time to free its blocks
        self.preempt_tail_s: list[float] = []  # per preemption: time until its last block was free
        self._swap_blocks: dict[str, tuple[int, int]] = {}  # stream -> (freed at once, tail), until its result
        self._finishing: set[str] = set()  # streams whose pending token is their last (overlapped scheduling)
        self.bytes_to_host = 0
        self.bytes_from_host = 0
        self._finished_since_plan: list[str] = []
        self._preempted_since_plan: list[str] = []  # by preempt() between steps
        self._announced: set[str] = set()  # streams whose sampling params the runner already has
        # Stream -> how many blocks of its current device table the runner holds: plans carry only the rest.
        self._table_sent: dict[str, int] = {}
        self._leaving: set[str] = set()  # streams to be exported (migration): never admitted or resumed again here
        self._step_ids = itertools.count()

    # ---- stream lifecycle -------------------------------------------------------------------------------------
    def add(self, stream: Stream) -> None:
        self.check_admissible(stream)
        stream.status = StreamStatus.WAITING
        self._enter(stream)

    def check_admissible(self, stream: Stream) -> None:
        """Raise ValueError if `add` would refuse the stream (the engine checks arrivals it holds for later)."""
        if stream.stream_id in self.streams:
            raise ValueError(f"stream id {stream.stream_id!r} is already live")
        if self.pool.blocks_for_tokens(stream.num_prompt_tokens + 1) > self.pool.num_blocks:
            raise ValueError(f"prompt: {stream.num_prompt_tokens} tokens do not fit the KV cache "
                             f"({self.pool.num_blocks} blocks of {self.pool.block_size})")
        if not self.config.chunked_prefill and stream.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt: {stream.num_prompt_tokens} tokens exceed max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens} and chunked prefill is off")

    def finish(self, stream_id: str, status: StreamStatus, now: float) -> Stream | None:
        """End a live stream (abort, stop string, ...) and return its blocks; unknown or finished ids are a no-op."""
        stream = self._leave(stream_id)
        if stream is None:
            return None
        self.kv.release_device(stream)
        self.kv.release_host(stream)
        self._table_sent.pop(stream_id, None)  # the runner drops the table with plan.finished
        self._finishing.discard(stream_id)
        self._leaving.discard(stream_id)
        stream.status = status
        now = max(now, stream.reader.first_token_time or now)
        stream.reader.finish(now)
        stream.record.mark_finished(stall_s=stream.reader.stall_time_at(now))
        if stream_id in self._announced:
            self._announced.discard(stream_id)
            self._finished_since_plan.append(stream_id)
        return stream

    def preempt(self, stream_id: str, now: float, to_host: bool | None = None) -> bool:
        """Pause a running stream between steps (to the host if the policy uses it, or as `to_host` says); it
        lands in the next plan."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.status != StreamStatus.RUNNING:
            return False
        self._preempt(stream, self.view(now), to_host)
        self._preempted_since_plan.append(stream_id)
        return True

    # ---- migration: an exit that is not an abort, an entry for a paused stream ---------------------------------
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
            stream.host_block_ids, stream.num_host_tokens = [], 0
            stream.status = StreamStatus.WAITING
        self._enter(stream)
        return host_ids

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

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        view = self.view(now)
        live = list(self.streams.values())
        ranked = self.policy.rank(live, view)
        preempted, self._preempted_since_plan = self._preempted_since_plan, []
        chosen: list[Stream] = []
        if self.policy.proactive and self.policy.should_rebalance(live, view):
            chosen, paused = self._rebalance(ranked, view)
            preempted += paused

        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        forced = False
        running = StreamStatus.RUNNING
        queue = [s for s in ranked if s.status == running]
        held = self.policy.hold(queue, view)
        skip = held | self._finishing if held else self._finishing
        bs, table_sent = self.pool.block_size, self._table_sent
        served = 0  # queue[served:] are the running streams not served yet; victims are taken from its end
        while served < len(queue) and budget > 0:
            stream = queue[served]
            served += 1
            sid = stream.stream_id
            if sid in skip:
                continue
            # Per running stream, every step: lengths read once, the chunk length, the block check and a decode's
            # chunk (`_chunk`) inline.
            computed, out = stream.num_computed_tokens, stream.output_token_ids
            p = len(stream.prompt_token_ids)
            total = p + len(out)
            remaining = total - computed
            n = remaining if remaining <= budget else self._chunk_len(stream, budget)
            if n == 0:
                continue
            if computed + n > len(stream.block_ids) * bs:  # needs a new block
                while not self.kv.grow(stream, n):
                    # The lowest-ranked running stream not yet served, else this one.
                    victim = queue[-1] if len(queue) > served else stream
                    self._preempt(victim, view)
                    preempted.append(victim.stream_id)
                    forced = True
                    if victim is stream:
                        break
                    queue.pop()
                if stream.status != running:
                    continue
            if n == 1 and computed >= p:
                blocks = stream.block_ids
                sent, held = table_sent.get(sid, 0), len(blocks)
                if held != sent:
                    table_sent[sid] = held
                decodes.append(_new_tuple(ScheduledChunk, (sid, (out[computed - p],), computed,
                                                           tuple(blocks[sent:]) if held > sent else (), sent,
                                                           computed + 1 == total)))
            else:
                (decodes if n == 1 else prefills).append(self._chunk(stream, n))
            budget -= n

        new_streams: list[tuple[str, SamplingParams]] = []
        if not forced:
            # The set the rebalance chose is admitted first (refine may have traded a stream for smaller ones).
            if chosen:
                members = {s.stream_id for s in chosen}
                order = chosen + [s for s in ranked if s.stream_id not in members]
            else:
                order = ranked
            budget = self._admit(order, view, budget, prefills, new_streams, set(preempted))
        self._plan_copies(now)
        write_through, swap_out, swap_in = self.kv.take_copies()
        finished, self._finished_since_plan = tuple(self._finished_since_plan), []
        return StepPlan(step_id=next(self._step_ids), decodes=tuple(decodes), prefills=tuple(prefills),
                        preempted=tuple(preempted), finished=finished, new_streams=tuple(new_streams),
                        write_through=write_through, swap_out=swap_out, swap_in=swap_in)

    def _plan_copies(self, now: float) -> None:
        """Copies beside the model step must not outlast it. Tails already planned and queued loads (a reader
        waits on them; at least a block a step) share what fits in the step's compute time; write-through, the
        background work, gets `write_budget_fraction` of it, less what the others took."""
        urgent = self.kv.planned_evict_blocks
        if self.kv.queued_load_blocks:
            urgent += self.kv.plan_loads(max(1, self.cost.copy_budget_blocks() - urgent))
        budget = self.cost.copy_budget_blocks(self.cache.write_budget_fraction) - urgent
        if budget > 0 and self.policy.uses_host_store and self.cache.write_through and self.kv.host is not None:
            running = self.by_status(StreamStatus.RUNNING)
            by_buffer = sorted(running, key=lambda s: -s.reader.buffer_seconds_at(now))
            self.kv.write_through(by_buffer, budget)

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
        # The incoming streams need blocks and sequence slots: the set is capped by max_num_seqs as well as memory.
        deficit = sum(self.pool.blocks_for_tokens(s.num_tokens + 1) for s in incoming) - self.pool.num_free
        slots = len(self.by_status(*_ACTIVE)) + len(incoming) - self.config.max_num_seqs
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
        limit = self.policy.admission_limit(view)
        working = view.num_working
        waiting, paused = StreamStatus.WAITING, StreamStatus.PREEMPTED
        max_num_seqs, leaving = self.config.max_num_seqs, self._leaving
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
                    if not self.kv.start_load(stream):
                        break  # no memory: keep rank order
                    stream.status = StreamStatus.LOADING
                    self._announce(stream, new_streams)  # an imported stream's first plan here may be its load
                    num_active += 1
                    reserve += self.policy.reserve_tokens([stream])
                    continue
                first = self.pool.blocks_for_tokens(min(stream.num_tokens, budget))
                if not self.pool.can_allocate(first):
                    break  # keep the host copy: nothing is gained by dropping it without room to recompute
                stream.record.record_recompute(stream.num_host_tokens)
                self.kv.release_host(stream)
                stream.status = StreamStatus.WAITING
            n = self._chunk_len(stream, budget)
            if is_new and self.pool.num_free - self.pool.blocks_for_tokens(n) < self.pool.blocks_for_tokens(reserve):
                break  # memory-aware admission: running streams keep room to grow
            if n == 0 or not self.kv.grow(stream, n):
                break  # head-of-line: admission keeps the policy's order
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

    def _resume_by_load(self, stream: Stream, view: SchedulerView | None = None) -> bool:
        """Reload or recompute, with the copies queued ahead of it now: tails being evicted this step and loads
        still waiting (paper §4.2.3, t_IO against t_recompute). The policy weighs the two (`resume_by_load`);
        without a view, the paper's rule: the sooner."""
        if stream.num_host_tokens == 0 or self.cache.resume_mode == "recompute":
            return False
        if self.cache.resume_mode == "load":
            return True
        t_io = self.cost.t_io(load_blocks=self.pool.blocks_for_tokens(stream.num_host_tokens),
                              evict_blocks=self.kv.planned_evict_blocks, queued_blocks=self.kv.queued_load_blocks)
        t_recompute = self.cost.t_recompute(stream.num_host_tokens)
        if view is None:
            return t_io <= t_recompute
        return self.policy.resume_by_load(stream, t_io, t_recompute, view)

    def update(self, plan: StepPlan, result: StepResult, now: float, step_s: float = 0.0) -> list[tuple[Stream, int]]:
        """Apply a finished step: loads land, tails free, computed counts advance, sampled tokens append.

        `step_s`: the step's time on the engine's clock, planning included. Capacity is what the engine delivers
        per step, so the cost model learns from it when it exceeds the runner's compute time (the scheduler's own
        work, a shared CPU); on a virtual clock it is 0 and the runner's time stands.

        Returns (stream, new_token) pairs in plan order; a stream that finished has its terminal status set.
        Equal to `advance(plan)` then `apply_result(...)`, the two halves overlapped scheduling runs apart, in one
        pass over the chunks: no placeholder goes in to be overwritten, and a stream that reaches its length is
        finished by its stop check rather than marked finishing first (tests/engine/test_scheduler_update.py).
        """
        self._step_landed(plan)
        self._learn_timings(plan, result, step_s)
        emitted: list[tuple[Stream, int]] = []
        streams, sampled = self.streams, result.sampled  # per-stream loop below: locals, not attribute lookups
        for sid, tokens, _, _, _, sample in itertools.chain(plan.decodes, plan.prefills):
            stream = streams.get(sid)
            if stream is None:  # aborted while the step ran
                continue
            stream.num_computed_tokens += len(tokens)
            if not sample:
                continue
            token = sampled[sid]
            out = stream.output_token_ids
            out.append(token)
            # Buffer first, then the token: the record keeps what the reader had unread when it was generated.
            stream.record.record_token(now, stream.reader.buffer_then_token(now))
            emitted.append((stream, token))
            # stop_reason_after_append's two tests inline; the reason is looked up only for a stream that ends.
            if token in stream.stop_token_set or len(out) >= stream.max_output_tokens:
                self.finish(sid, stream.stop_reason_after_append(token), now)
        return emitted

    def advance(self, plan: StepPlan) -> None:
        """What a planned step will have done once the runner has run it, but its sampled tokens: loads landed,
        tails freed, computed counts advanced, and a PENDING_TOKEN placeholder appended where a token is sampled.
        Overlapped scheduling calls this as soon as the step is launched, so the next plan is made from the state
        after it (the runner runs steps in order, so the next plan's copies and writes come after this step's)."""
        self._step_landed(plan)
        streams, finishing = self.streams, self._finishing
        # Chunks unpack as tuples: per running stream, every step.
        for sid, tokens, _, _, _, sample in itertools.chain(plan.decodes, plan.prefills):
            stream = streams.get(sid)
            if stream is None:  # aborted while the step ran
                continue
            stream.num_computed_tokens += len(tokens)
            if sample:
                out = stream.output_token_ids
                out.append(PENDING_TOKEN)
                if len(out) >= stream.max_output_tokens:
                    finishing.add(sid)  # ends with that token: nothing more to plan for it

    def apply_result(self, plan: StepPlan, result: StepResult, now: float,
                     step_s: float = 0.0) -> list[tuple[Stream, int]]:
        """The rest of `update`, once the step's result is in: timings learnt, sampled tokens in place of their
        placeholders, reader and record updated, streams that stop finished."""
        self._learn_timings(plan, result, step_s)
        emitted: list[tuple[Stream, int]] = []
        streams, sampled = self.streams, result.sampled  # per-stream loop below: locals, not attribute lookups
        for sid, tokens, start, _, _, sample in itertools.chain(plan.decodes, plan.prefills):
            if not sample:
                continue
            stream = streams.get(sid)
            if stream is None:  # aborted, or stopped (eos, a stop string) by the step before it
                continue
            token = sampled[sid]
            # The placeholder sits at the position after the chunk (a later step's may follow it).
            stream.output_token_ids[start + len(tokens) - len(stream.prompt_token_ids)] = token
            # Buffer first, then the token: the record keeps what the reader had unread when it was generated.
            stream.record.record_token(now, stream.reader.buffer_then_token(now))
            emitted.append((stream, token))
            stop = stream.stop_reason_after_append(token)
            if stop is not None:
                self.finish(stream.stream_id, stop, now)
        return emitted

    def _step_landed(self, plan: StepPlan) -> None:
        """A step's copies as done: loads that landed make their streams run, bytes moved are counted."""
        self.kv.step_done()
        for sid in self.kv.loads_landed(plan.swap_in):  # a chunked load is done when its last chunk lands
            stream = self.streams[sid]
            self.kv.finish_load(stream, keep_host_copy=self.cache.write_through)
            stream.status = StreamStatus.RUNNING
        self.bytes_to_host += (len(plan.write_through) + len(plan.swap_out)) * self.cost.block_bytes
        self.bytes_from_host += len(plan.swap_in) * self.cost.block_bytes

    def _learn_timings(self, plan: StepPlan, result: StepResult, step_s: float) -> None:
        """What the step's result teaches: when preempted streams' tails were free, the step's and copies' costs."""
        for sid in plan.preempted:
            swapped = self._swap_blocks.pop(sid, None)
            if swapped is not None:
                now_blocks, tail = swapped
                tail_s = result.swap_out_s.get(sid, 0.0) if tail else 0.0
                self.preempt_tail_s.append(tail_s)
                self.preempt_costs_s.append(tail_s * tail / max(1, now_blocks + tail))
        self.cost.observe_step(result.compute_s, len(plan.decodes), sum(len(c.token_ids) for c in plan.prefills),
                               result.copy_s, result.copy_bytes, step_s=step_s)

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
        return _new_tuple(ScheduledChunk, (sid, tokens, start, new_blocks, sent, start + n == p + len(out)))

    def _preempt(self, stream: Stream, view: SchedulerView, to_host: bool | None = None) -> None:
        self._table_sent.pop(stream.stream_id, None)  # its blocks go; the runner drops the table (plan.preempted)
        to_host = self.policy.uses_host_store if to_host is None else to_host
        swapped = self.kv.swap_out(stream) if to_host else None
        if swapped is not None:
            self._swap_blocks[stream.stream_id] = swapped
            stream.status = StreamStatus.PREEMPTED
        else:  # recompute: everything computed so far is computed again later
            stream.record.record_recompute(stream.num_computed_tokens)
            self.kv.release_device(stream)
            self.kv.release_host(stream)
            stream.status = StreamStatus.WAITING
        stream.last_preempted_at = view.now
        stream.record.record_preemption()
        self.policy.on_preempt(stream, view)

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
            if s.status == StreamStatus.RUNNING:
                lo, hi = self.pool.blocks_for_tokens(s.num_computed_tokens), self.pool.blocks_for_tokens(s.num_tokens)
                assert lo <= len(s.block_ids) <= hi, f"{s.stream_id}: block table does not match its tokens"
            elif s.status == StreamStatus.LOADING:
                assert len(s.block_ids) == self.pool.blocks_for_tokens(s.num_host_tokens), s.stream_id
            else:
                assert not s.block_ids and s.num_computed_tokens == 0, f"{s.stream_id}: paused but owns blocks"
            if s.status == StreamStatus.PREEMPTED:
                assert s.num_host_tokens > 0, f"{s.stream_id}: preempted to the host with nothing there"
