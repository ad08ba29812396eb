"""Continuous batching with chunked prefill, buffer-aware preemption and a host spill store.

No prefill/decode phases: each step every scheduled stream gets tokens so that its computed tokens catch up with
its total (vLLM v1's rule), under a per-step token budget. One step, in order:
1. Rebalance (proactive policies, when the policy says so): take the policy's ranking, choose greedily the streams
   that should hold the device, and pause running streams outside that set that the policy lets go, as many as
   the incoming ones need (blocks and sequence slots).
2. Serve running streams in rank order; when one cannot grow, the lowest-ranked unserved running stream is
   preempted (memory-forced), until the victims free what it needs. A victim's unsynced tail is freed only after
   the step's copy: once the victims' tails cover the need and the next victim would free nothing sooner, the
   stream waits a step instead of taking more victims and, last, itself.
3. Unless memory forced a preemption (so a full pool does not thrash), admit or resume streams: the set the
   rebalance chose first, then the rest in rank order. A preempted stream resumes by loading its host copy or by
   recompute, whichever the cost model finds cheaper given the copies queued ahead of it; a load starts only
   when the pool also holds the block its next token writes (a recompute's first chunk includes that token).
4. Copies share one budget per step (what finishes within the step's compute time): the tails of streams
   preempted this step, then queued loads (chunked over steps), then write-through of full blocks, larger buffers
   first (likelier victims).
Preemption goes to the host store when the policy uses it and the store has room, else to recompute.

The parts, each a mixin of Scheduler: the live streams' books and the policy's view (scheduler_accounting.py),
who holds the device (scheduler_admission.py), a step's result applied (scheduler_results.py), migration
(scheduler_migration.py), prefix caching (prefix_cache.py). This file holds the state, the stream lifecycle and the step.
"""

from __future__ import annotations

import itertools

from tokenflow_ray.engine.block_pool import BlockPool
from tokenflow_ray.engine.config import CacheConfig, SchedulerConfig
from tokenflow_ray.engine.cost_model import CostModel
from tokenflow_ray.engine.kv_manager import KVManager
from tokenflow_ray.engine.plan import ScheduledChunk, StepPlan
from tokenflow_ray.engine.policies import SchedulingPolicy, make_policy
from tokenflow_ray.engine.prefix_cache import PrefixCacheStats, SchedulerPrefixCache
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.scheduler_accounting import SchedulerAccounting
from tokenflow_ray.engine.scheduler_admission import SchedulerAdmission, new_tuple
from tokenflow_ray.engine.scheduler_migration import SchedulerMigration
from tokenflow_ray.engine.scheduler_results import SchedulerResults
from tokenflow_ray.engine.stream import Stream, StreamStatus


class Scheduler(SchedulerAccounting, SchedulerAdmission, SchedulerResults, SchedulerMigration, SchedulerPrefixCache):
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, cache: CacheConfig | None = None,
                 cost: CostModel | None = None, policy: SchedulingPolicy | None = None) -> None:
        self.config = config
        self.cache = cache or CacheConfig(block_size=block_pool.block_size, num_device_blocks=block_pool.num_blocks)
        self.pool = block_pool
        self.policy = policy or make_policy(config.policy, config.tokenflow, config.andes, config.fcfs_reserve_ratio)
        host_caching = block_pool.caching and self.cache.host_prefix_caching
        host = BlockPool(self.cache.num_host_blocks, block_pool.block_size, caching=host_caching) \
            if self.cache.num_host_blocks else None
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
        self.prefix_stats = PrefixCacheStats()  # prefix caching's lookups and hits (prefix_cache.py)

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
        freeing = 0  # blocks this step's memory-forced victims free once their copies are done, not yet claimed
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
                    forced = True
                    # The lowest-ranked running stream not yet served, else this one.
                    victim = queue[-1] if len(queue) > served else stream
                    short = self.pool.blocks_for_tokens(computed + n) - len(stream.block_ids) - self.pool.num_free
                    if short <= freeing and (victim is stream or not self.kv.blocks_freed_at_once(
                            victim, self.policy.uses_host_store)):
                        # The victims taken so far free enough once their tails are on the host, and the next
                        # one would free nothing sooner (a tail is freed after the step's copy): the stream
                        # waits a step. Without write-through every block is tail: each block boundary in a
                        # full pool preempted the whole batch, itself last, and the batch resumed into the
                        # same full pool, for ever.
                        freeing -= short
                        break
                    freeing += self._preempt(victim, view)
                    preempted.append(victim.stream_id)
                    if victim is stream:
                        break
                    queue.pop()
                if stream.status != running or computed + n > len(stream.block_ids) * bs:
                    continue  # preempted, or waiting for its victims' blocks
            if n == 1 and computed >= p:
                blocks = stream.block_ids
                sent, held = table_sent.get(sid, 0), len(blocks)
                if held != sent:
                    table_sent[sid] = held
                decodes.append(new_tuple(ScheduledChunk, (sid, (out[computed - p],), computed,
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
        host = self.kv.host
        # Write-through feeds the policy's pauses and the host tier of the prefix cache (for any policy).
        if budget > 0 and self.cache.write_through and host is not None and (self.policy.uses_host_store
                                                                               or host.caching):
            # Only streams with a full block not yet mirrored (most have none on a given step); filtering before
            # the stable sort keeps the order the full sort gave them.
            bs = self.kv.block_size
            behind = [s for s in self.by_status(StreamStatus.RUNNING)
                      if s.num_host_tokens // bs < s.num_computed_tokens // bs]
            by_buffer = sorted(behind, key=lambda s: -s.reader.buffer_seconds_at(now))
            self.kv.write_through(by_buffer, budget)
