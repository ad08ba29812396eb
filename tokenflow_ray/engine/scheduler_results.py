"""A step's result applied, a part of Scheduler (scheduler.py): loads land, tails free, computed counts advance,
sampled tokens append and streams that stop finish; in one pass (`update`) or in the two halves overlapped
scheduling runs apart (`advance` when a step is launched, `apply_result` when its result is in).

A mixin: it uses the scheduler's `streams`, `finish`, KV manager, cache config, cost model, byte counters,
preemption timings (`preempt_costs_s`, `preempt_tail_s`, `_swap_blocks`) and `_finishing`, all set in
Scheduler.__init__.
"""

from __future__ import annotations

import itertools

from tokenflow_ray.engine.plan import PENDING_TOKEN, StepPlan, StepResult
from tokenflow_ray.engine.stream import Stream, StreamStatus


class SchedulerResults:
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
        bs = self.pool.block_size if self.pool.caching else 0
        for sid, tokens, _, _, _, sample in itertools.chain(plan.decodes, plan.prefills):
            stream = streams.get(sid)
            if stream is None:  # aborted while the step ran
                continue
            stream.num_computed_tokens += len(tokens)
            if bs and stream.num_computed_tokens // bs > stream.num_keyed_blocks:
                self._cache_blocks(stream)  # blocks this step filled: findable (prefix_cache.py)
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
        bs = self.pool.block_size if self.pool.caching else 0
        for sid, tokens, start, _, _, sample in itertools.chain(plan.decodes, plan.prefills):
            if not sample:
                if bs and (stream := streams.get(sid)) is not None \
                        and stream.num_computed_tokens // bs > stream.num_keyed_blocks:
                    self._cache_blocks(stream)  # a prompt chunk: its tokens are all known
                continue
            stream = streams.get(sid)
            if stream is None:  # aborted, or stopped (eos, a stop string) by the step before it
                continue
            token = sampled[sid]
            # The placeholder sits at the position after the chunk (a later step's may follow it).
            stream.output_token_ids[start + len(tokens) - len(stream.prompt_token_ids)] = token
            if bs and stream.num_computed_tokens // bs > stream.num_keyed_blocks:
                # With the token in place every computed token is known (block_keys stops at a later placeholder).
                self._cache_blocks(stream)
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
