"""Continuous batching with chunked prefill under a per-step token budget.

There are no prefill/decode phases: each step every scheduled stream gets tokens so that its computed tokens catch
up with its total (vLLM v1's rule). Running streams are served first, in policy order; then waiting streams are
admitted while the budget, the batch cap and free blocks allow. When a running stream cannot grow, the policy's
victim is preempted by recompute (its blocks are freed and it re-prefills later); no stream is admitted in a step
that preempted one, which keeps a full pool from thrashing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from tokenflow_ray.engine.block_pool import BlockPool
from tokenflow_ray.engine.config import SchedulerConfig
from tokenflow_ray.engine.plan import ScheduledChunk, StepPlan, StepResult
from tokenflow_ray.engine.policy import SchedulingPolicy, make_policy
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.stream import Stream, StreamStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool,
                 policy: SchedulingPolicy | None = None) -> None:
        self.config = config
        self.pool = block_pool
        self.policy = policy or make_policy(config.policy)
        self.streams: dict[str, Stream] = {}  # live (unfinished) streams
        self._finished_since_plan: list[str] = []
        self._announced: set[str] = set()  # streams whose sampling params the runner already has
        self._step_ids = itertools.count()

    # ---- stream lifecycle -------------------------------------------------------------------------------------
    def add(self, stream: Stream) -> None:
        if stream.stream_id in self.streams:
            raise ValueError(f"stream id {stream.stream_id!r} is already live")
        if self.pool.blocks_for_tokens(stream.num_prompt_tokens + 1) > self.pool.num_blocks:
            raise ValueError(f"prompt: {stream.num_prompt_tokens} tokens do not fit the KV cache "
                             f"({self.pool.num_blocks} blocks of {self.pool.block_size})")
        if not self.config.chunked_prefill and stream.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt: {stream.num_prompt_tokens} tokens exceed max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens} and chunked prefill is off")
        stream.status = StreamStatus.WAITING
        self.streams[stream.stream_id] = stream

    def finish(self, stream_id: str, status: StreamStatus) -> Stream | None:
        """End a live stream (abort, stop string, ...) and return its blocks; unknown or finished ids are a no-op."""
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            return None
        self._release(stream)
        stream.status = status
        if stream_id in self._announced:
            self._announced.discard(stream_id)
            self._finished_since_plan.append(stream_id)
        return stream

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)

    def running(self) -> list[Stream]:
        return [s for s in self.streams.values() if s.status == StreamStatus.RUNNING]

    def waiting(self) -> list[Stream]:
        return [s for s in self.streams.values() if s.status == StreamStatus.WAITING]

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled: set[str] = set()

        queue = self.policy.order_running(self.running(), now)
        while queue and budget > 0:
            stream = queue.pop(0)
            n = self._chunk_len(stream, budget)
            if n == 0:
                continue
            while not self._grow(stream, n):
                candidates = [s for s in queue if s.stream_id not in scheduled] or [stream]
                victim = self.policy.choose_victim(candidates, now)
                self._preempt(victim)
                preempted.append(victim.stream_id)
                if victim is stream:
                    break
                queue.remove(victim)
            if stream.status != StreamStatus.RUNNING:
                continue
            chunk = self._chunk(stream, n)
            (decodes if n == 1 else prefills).append(chunk)
            scheduled.add(stream.stream_id)
            budget -= n

        new_streams: list[tuple[str, SamplingParams]] = []
        if not preempted:
            num_running = len(scheduled)
            for stream in self.policy.order_waiting(self.waiting(), now):
                if budget <= 0 or num_running >= self.config.max_num_seqs:
                    break
                n = self._chunk_len(stream, budget)
                if n == 0 or not self._grow(stream, n):
                    break  # head-of-line: admission keeps the policy's order
                stream.status = StreamStatus.RUNNING
                prefills.append(self._chunk(stream, n))
                if stream.stream_id not in self._announced:
                    self._announced.add(stream.stream_id)
                    new_streams.append((stream.stream_id, stream.sampling))
                num_running += 1
                budget -= n

        finished, self._finished_since_plan = tuple(self._finished_since_plan), []
        return StepPlan(step_id=next(self._step_ids), decodes=tuple(decodes), prefills=tuple(prefills),
                        preempted=tuple(preempted), finished=finished, new_streams=tuple(new_streams))

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[tuple[Stream, int]]:
        """Advance computed counts, append sampled tokens, end streams that hit a stop condition.

        Returns (stream, new_token) pairs in plan order; a stream that finished has its terminal status set.
        """
        emitted: list[tuple[Stream, int]] = []
        for chunk in itertools.chain(plan.decodes, plan.prefills):
            stream = self.streams.get(chunk.stream_id)
            if stream is None:  # aborted while the step ran
                continue
            stream.num_computed_tokens += len(chunk.token_ids)
            if not chunk.sample:
                continue
            token = result.sampled[chunk.stream_id]
            stream.output_token_ids.append(token)
            if stream.first_token_time is None:
                stream.first_token_time = now
            emitted.append((stream, token))
            stop = stream.stop_reason_after_append(token)
            if stop is not None:
                self.finish(stream.stream_id, stop)
        return emitted

    # ---- mechanics --------------------------------------------------------------------------------------------
    def _chunk_len(self, stream: Stream, budget: int) -> int:
        remaining = stream.num_uncomputed_tokens
        if remaining <= budget:
            return remaining
        if self.config.chunked_prefill:
            return budget
        # Unchunked, a recompute that outgrew the budget would never run: let it chunk when it has the step alone.
        return budget if budget == self.config.max_num_batched_tokens else 0

    def _grow(self, stream: Stream, n: int) -> bool:
        need = self.pool.blocks_for_tokens(stream.num_computed_tokens + n) - len(stream.block_ids)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        stream.block_ids.extend(self.pool.allocate(need))
        return True

    def _chunk(self, stream: Stream, n: int) -> ScheduledChunk:
        start = stream.num_computed_tokens
        return ScheduledChunk(stream_id=stream.stream_id, token_ids=stream.token_ids(start, start + n),
                              start_pos=start, block_ids=tuple(stream.block_ids),
                              sample=start + n == stream.num_tokens)

    def _preempt(self, stream: Stream) -> None:
        # Tokens already generated must be recomputed: everything but the last (which has no KV yet).
        stream.num_recomputed_tokens += stream.num_computed_tokens
        self._release(stream)
        stream.status = StreamStatus.WAITING
        stream.num_preemptions += 1

    def _release(self, stream: Stream) -> None:
        if stream.block_ids:
            self.pool.free(stream.block_ids)
            stream.block_ids = []
        stream.num_computed_tokens = 0

    # ---- invariants -------------------------------------------------------------------------------------------
    def check_integrity(self, extra_owners: Iterable[list[int]] = ()) -> None:
        self.pool.check_integrity(itertools.chain((s.block_ids for s in self.streams.values()), extra_owners))
        for s in self.streams.values():
            assert not s.status.finished, f"{s.stream_id}: finished stream still live"
            lo, hi = self.pool.blocks_for_tokens(s.num_computed_tokens), self.pool.blocks_for_tokens(s.num_tokens)
            assert lo <= len(s.block_ids) <= hi, f"{s.stream_id}: block table does not match its tokens"
            assert s.num_computed_tokens <= s.num_tokens, f"{s.stream_id}: computed beyond its tokens"
            if s.status == StreamStatus.WAITING:
                assert not s.block_ids and s.num_computed_tokens == 0, f"{s.stream_id}: waiting but owns blocks"
