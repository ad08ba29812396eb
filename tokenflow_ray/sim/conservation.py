"""Conservation checks on every simulated step (cluster-notes.md §1.3: they would have caught BLIS's inflated
throughput and its preemption livelock).

- tokens out <= tokens scheduled: a step emits at most one token per sampled chunk, and over a run the tokens
  emitted never exceed the tokens the runner was fed;
- blocks in use <= capacity, device and host (the engine's own integrity check, which also proves every block is
  owned once);
- no stream both on the device and paused: a stream the plan feeds is not also preempted by it, and a paused
  stream owns no device blocks (integrity check);
- a bound on preemptions per step (at most the live streams);
- livelock: no token emitted and no prompt progress for `livelock_steps` steps in a row while streams are live
  (a stream larger than the cache preempting itself forever) raises with the stuck streams named.
"""

from __future__ import annotations

from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.outputs import StreamOutput
from tokenflow_ray.engine.plan import StepPlan, StepResult


class ConservationError(AssertionError):
    pass


class LivelockError(ConservationError):
    pass


class ConservationChecker:
    def __init__(self, engine: LLMEngine, integrity: bool = True, livelock_steps: int = 10_000) -> None:
        self.engine = engine
        self.integrity = integrity  # the full block-ownership walk (O(blocks)); the cheap checks always run
        self.livelock_steps = livelock_steps
        self.tokens_scheduled = 0
        self.tokens_out = 0
        self._stuck = 0

    def after_step(self, plan: StepPlan | None, result: StepResult | None, outputs: list[StreamOutput]) -> None:
        engine = self.engine
        emitted = sum(len(o.token_ids) for o in outputs)
        self.tokens_out += emitted
        if plan is not None and result is not None:
            fed = (*plan.decodes, *plan.prefills)
            self.tokens_scheduled += plan.num_tokens
            sampling = {c.stream_id for c in fed if c.sample}
            if not set(result.sampled) <= sampling or emitted > len(sampling):
                raise ConservationError(f"step {plan.step_id}: {emitted} tokens out for {len(sampling)} sampled chunks")
            both = {c.stream_id for c in fed} & set(plan.preempted)
            if both:
                raise ConservationError(f"step {plan.step_id}: fed and preempted at once: {sorted(both)[:5]}")
            if len(plan.preempted) > engine.scheduler.num_unfinished + len(plan.finished) + len(fed):
                raise ConservationError(f"step {plan.step_id}: {len(plan.preempted)} preemptions")
        if self.tokens_out > self.tokens_scheduled:
            raise ConservationError(f"{self.tokens_out} tokens out > {self.tokens_scheduled} scheduled")
        pool = engine.pool
        if not 0 <= pool.num_free <= pool.num_blocks:
            raise ConservationError(f"device pool: {pool.num_free} free of {pool.num_blocks}")
        if self.integrity:
            engine.check_integrity()
        self._watch_livelock(emitted)

    def _watch_livelock(self, emitted: int) -> None:
        """Steps (idle polls included) without a token while streams are live. A long prompt emits nothing for
        a few steps and a paced stream may be held for a while; thousands of steps without a token is a stream
        that cannot make progress (e.g. larger than the cache, preempting itself)."""
        sched = self.engine.scheduler
        if emitted or not sched.num_unfinished:
            self._stuck = 0
            return
        self._stuck += 1
        if self._stuck >= self.livelock_steps:
            stuck = sorted(sched.streams.values(), key=lambda s: -s.num_tokens)[:3]
            raise LivelockError(f"no token in {self._stuck} steps; largest live streams: "
                                + ", ".join(f"{s.stream_id} ({s.num_tokens} tokens, {s.status.name})" for s in stuck))
