"""LLMEngine: add_request / abort / step, plus blocking helpers. Single-threaded; see async_engine for the loop.
Moving a live stream to another engine (export, import) is its other half: engine_migration.py.

Pure Python: the runner (torch) is passed in; runner/factory.py's `build_engine` puts the two together.

A step has two halves so several engines can share one virtual clock (the simulator, tokenflow_ray/sim/):
`begin_step` schedules at the clock's now and returns the plan; `finish_step` applies the runner's result at the
time the step ended. `step()` is the two back to back around `runner.execute`. Requests may arrive in the future:
they are held, already validated, until the clock reaches their arrival; `next_event_time` says when the engine
next has something to do.
"""

from __future__ import annotations

import heapq
import itertools
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tokenflow_ray.engine.block_pool import BlockPool
from tokenflow_ray.engine.clock import Clock, WallClock
from tokenflow_ray.engine.config import EngineConfig
from tokenflow_ray.engine.cost_model import CostModel
from tokenflow_ray.engine.detokenizer import DecoderFactory, StopMatcher, TextState
from tokenflow_ray.engine.engine_migration import EngineMigration
from tokenflow_ray.engine.outputs import EngineStats, GenerationResult, StreamOutput
from tokenflow_ray.engine.plan import StepPlan, StepResult
from tokenflow_ray.engine.runner_api import ModelRunner, encode_prompt
from tokenflow_ray.engine.sampling import SamplingParams
from tokenflow_ray.engine.scheduler import Scheduler
from tokenflow_ray.engine.stream import Stream, StreamStatus
from tokenflow_ray.metrics.stream_metrics import StreamRecord

_DONE = StreamStatus.FINISHED_STOPPED  # a status at or above it is terminal (without the property call per token)
_new_tuple = tuple.__new__  # a NamedTuple made as the tuple it is: its own __new__ is a Python call (2.5x)


class UnknownStreamError(LookupError):
    """A report or abort named a stream that is unknown or already finished."""


@dataclass
class BegunStep:
    """The first half of a step: the plan to run (None when there is nothing to run now), when it was planned,
    and outputs produced outside the step (aborts) that `finish_step` hands back with the step's own."""

    plan: StepPlan | None
    start: float
    outputs: list[StreamOutput]


class LLMEngine(EngineMigration):
    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: Any,
                 clock: Clock | None = None) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.clock = clock or WallClock()
        self.pool = BlockPool(config.cache.num_device_blocks, config.cache.block_size,
                              caching=config.cache.enable_prefix_caching)
        block_bytes = runner.info.kv_bytes_per_token * config.cache.block_size
        cost = CostModel(block_bytes, prefill_chunk_tokens=config.scheduler.max_num_batched_tokens)
        self.scheduler = Scheduler(config.scheduler, self.pool, config.cache, cost)
        self._decoders = DecoderFactory(tokenizer) if tokenizer is not None else None
        self._text: dict[str, TextState] = {}
        self._pending: list[StreamOutput] = []  # outputs produced outside step(): aborts
        # Validated streams whose arrival is still in the future: a heap of (arrival, order, id) and the streams.
        self._arrivals: list[tuple[float, int, str]] = []
        self._future: dict[str, Stream] = {}
        self.idle = False  # the last step had nothing to run (loops wait briefly instead of spinning)
        info = runner.info
        # A stream may not outgrow the model's context nor the whole device pool (it would preempt itself forever).
        self.max_total_tokens = min(info.max_model_len, config.cache.num_device_blocks * config.cache.block_size)
        self._ids = itertools.count()
        # Records of finished streams for benchmarks and metrics; bounded so a long-running server stays small.
        self.finished_records: deque[StreamRecord] = deque(maxlen=config.record_history)
        self._totals = {"preemptions": 0, "tokens_recomputed": 0, "streams_finished": 0, "steps": 0}
        # Overlapped scheduling (config.overlap_scheduling): the step the runner thread is running, and that thread.
        self._inflight: tuple[BegunStep, Future] | None = None
        self.last_finished: tuple[StepPlan, StepResult] | None = None  # the plan and result `finish_step` applied last
        self._runner_thread: ThreadPoolExecutor | None = None

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                    stream_id: str | None = None, arrival_time: float | None = None,
                    rate: float = 0.0) -> str:
        """Queue a stream; rate is the reader's declared consumption rate in tokens/s (0: unpaced; a server resolves
        its default where the request comes in, serve/config.py `default_rate`).
        An arrival_time after now holds the stream, validated, until the clock reaches it."""
        sampling = sampling or SamplingParams()
        token_ids = self.prompt_token_ids(prompt)
        vocab = self.runner.info.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        now = self.clock.now()
        stream_id = stream_id or f"cmpl-{uuid.uuid4().hex[:16]}-{next(self._ids)}"
        if stream_id in self._future:
            raise ValueError(f"stream id {stream_id!r} is already live")
        stream = Stream(stream_id=stream_id, prompt_token_ids=tuple(token_ids), sampling=sampling,
                        arrival_time=now if arrival_time is None else arrival_time,
                        max_total_tokens=self.max_total_tokens, eos_token_ids=self.runner.info.eos_token_ids,
                        rate=rate)
        if arrival_time is not None and arrival_time > now:
            self.scheduler.check_admissible(stream)
            self._future[stream_id] = stream
            heapq.heappush(self._arrivals, (arrival_time, next(self._ids), stream_id))
        else:
            self.scheduler.add(stream)
            self.idle = False  # new work may be runnable now
        if self._decoders is not None:
            self._text[stream_id] = TextState(self._decoders.new(), StopMatcher(sampling.stop))
        return stream_id

    def prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt as token ids, validated (a ValueError names what is wrong); safe off the engine thread."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass token ids")
            return encode_prompt(self.tokenizer, prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError("prompt: token ids must be integers")
        return ids

    def report_consumption(self, stream_id: str, consumed_tokens: int | None = None, rate: float | None = None,
                           paused: bool | None = None) -> None:
        """A client's report replaces the reader model of its stream from now on (validated, all or nothing)."""
        stream = self.scheduler.streams.get(stream_id)
        if stream is None:
            raise UnknownStreamError(f"stream {stream_id!r} is unknown or finished")
        stream.reader.apply_report(self.clock.now(), consumed_tokens=consumed_tokens, rate=rate, paused=paused)
        if rate is not None:
            stream.rate = stream.reader.rate
            self.scheduler.rates_changed()
        self.idle = False  # a report may make a held stream runnable

    def abort(self, stream_id: str) -> bool:
        held = self._future.pop(stream_id, None)
        if held is not None:  # not arrived yet: it never entered the scheduler (its heap entry is skipped later)
            self._text.pop(stream_id, None)
            self._pending.append(StreamOutput(stream_id, (), "", True, "abort", held.num_prompt_tokens, 0))
            return True
        stream = self.scheduler.finish(stream_id, StreamStatus.FINISHED_ABORTED, self.clock.now())
        if stream is None:
            return False
        self._retire(stream)
        self._pending.append(StreamOutput(stream_id, (), "", True, "abort", stream.num_prompt_tokens,
                                          stream.num_output_tokens))
        return True

    def step_outputs_discard(self, stream_id: str | None) -> None:
        """Drop pending abort notices (of one stream, or all): their consumer already knows."""
        self._pending = [o for o in self._pending if stream_id is not None and o.stream_id != stream_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending) or bool(self._future)

    def next_arrival_time(self) -> float | None:
        """When the earliest held (future) request arrives, or None."""
        while self._arrivals and self._arrivals[0][2] not in self._future:
            heapq.heappop(self._arrivals)  # aborted before it arrived
        return self._arrivals[0][0] if self._arrivals else None

    def next_event_time(self) -> float | None:
        """When a step next has something to do: now when work is runnable (or outputs wait), the next arrival
        when nothing is live, and when every live stream is held (paced) the sooner of the next arrival and one
        estimated step from now (the policy re-decides each step; this is the cadence a real loop polls at).
        None: nothing live and nothing to come."""
        now = self.clock.now()
        arrival = self.next_arrival_time()
        if self._pending or (self.scheduler.num_unfinished and not self.idle):
            return now if arrival is None else min(now, max(arrival, now))
        if self.scheduler.num_unfinished:
            poll = now + max(self.scheduler.cost.step_s, 1e-4)
            return poll if arrival is None else min(poll, max(arrival, now))
        return None if arrival is None else max(arrival, now)

    def _admit_arrivals(self, now: float) -> None:
        while (t := self.next_arrival_time()) is not None and t <= now:
            _, _, sid = heapq.heappop(self._arrivals)
            self.scheduler.add(self._future.pop(sid))

    def _settle(self) -> None:
        """Finish the step in flight (overlapped scheduling), so the scheduler's and runner's state agree; its
        outputs go out with the next step's."""
        if self._inflight is not None:
            begun, future = self._inflight
            self._inflight = None
            self._pending.extend(self.finish_step(begun, future.result(), advanced=True))

    def get_stream(self, stream_id: str) -> Stream | None:
        return self.scheduler.streams.get(stream_id) or self._future.get(stream_id)

    def live_stream_ids(self) -> set[str]:
        """Every stream this engine holds: in its scheduler, or accepted to arrive at a later time."""
        return set(self.scheduler.streams) | set(self._future)

    # ---- one step ---------------------------------------------------------------------------------------------
    def step(self) -> list[StreamOutput]:
        if self.config.overlap_scheduling or self._inflight is not None:
            return self._step_overlapped()
        if self._runner_thread is not None:  # overlap was switched off: end the runner thread (and the OpenMP
            self._runner_thread.shutdown(wait=True)  # team it owns, which would stay beside this thread's)
            self._runner_thread = None
        begun = self.begin_step()
        if begun.plan is None:
            return begun.outputs
        return self.finish_step(begun, self.runner.execute(begun.plan))

    def begin_step(self) -> BegunStep:
        """Admit arrivals due by now and plan a step. `plan` is None when there is nothing to run now (`idle`);
        the outputs are then complete. Otherwise run the plan and pass its result to `finish_step`."""
        outputs, self._pending = self._pending, []
        start = self.clock.now()
        self._admit_arrivals(start)
        plan = self.scheduler.schedule(start)
        self.idle = plan.is_empty and not plan.finished  # nothing to run now (e.g. every stream paced)
        return BegunStep(None if self.idle else plan, start, outputs)

    def _step_overlapped(self) -> list[StreamOutput]:
        """One step's outputs, with the next step planned while this one runs (SGLang's overlap scheduler, vLLM's
        async scheduling): the runner thread executes step N while this thread plans N+1 from the state after N
        (`Scheduler.advance`: placeholders where N's tokens go; the runner feeds its own sampled tokens into N+1's
        decodes), then N+1 is launched and N's result applied and detokenised while N+1 runs. The runner runs
        steps in order, so N+1's copies and KV writes come after N's. Same greedy output; a stream that stops on
        a sampled token (eos, a stop string) costs one decode that is thrown away. Between calls a step is in
        flight and the scheduler's state is the state after it, but its tokens."""
        if self._inflight is None:
            begun = self.begin_step()
            if begun.plan is None:
                return begun.outputs
            self._inflight = self._launch(begun)
            self.scheduler.advance(begun.plan)
        begun, future = self._inflight
        if not self.config.overlap_scheduling:  # switched off with a step in flight: finish that one first
            self._inflight = None
            return self.finish_step(begun, future.result(), advanced=True)
        nxt = self.begin_step()  # planned while `begun` runs
        result = future.result()
        self._inflight = self._launch(nxt) if nxt.plan is not None else None
        outputs = self.finish_step(begun, result, advanced=True)
        if self._inflight is not None:
            self.scheduler.advance(nxt.plan)  # after `begun`'s tokens are in: their stop checks count right
        outputs.extend(nxt.outputs)  # aborts since the last call go out now, not a step later
        nxt.outputs.clear()
        return outputs

    def _launch(self, begun: BegunStep) -> tuple[BegunStep, Future]:
        if self._runner_thread is None:
            # torch's intra-op thread count is per thread: the runner sets its own (init_thread) on first use.
            self._runner_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenflow-runner",
                                                     initializer=getattr(self.runner, "init_thread", None))
        # The step's time runs from its launch (planning overlapped the step before).
        launched = BegunStep(begun.plan, self.clock.now(), begun.outputs)
        return launched, self._runner_thread.submit(self.runner.execute, begun.plan)

    def finish_step(self, begun: BegunStep, result: StepResult, now: float | None = None,
                    advanced: bool = False) -> list[StreamOutput]:
        """Apply a step's result at `now` (default: the clock's now, i.e. when the runner returned). `advanced`:
        `Scheduler.advance` already ran for this plan (overlapped scheduling)."""
        if begun.plan is None:
            raise ValueError("finish_step: the step had no plan to run")
        self._totals["steps"] += 1
        self.last_finished = (begun.plan, result)
        now = self.clock.now() if now is None else now
        outputs = begun.outputs
        apply = self.scheduler.apply_result if advanced else self.scheduler.update
        emitted = apply(begun.plan, result, now, step_s=now - begun.start)
        if self._text:  # streams with text: detokenised, stop strings matched
            output, append = self._output, outputs.append
            for stream, token in emitted:
                out = output(stream, token, now)
                append(out)
                if out.finished:
                    self._retire(stream)
            return outputs
        # Token ids only (no tokenizer): `_output` without the text, inline (every running stream, every step).
        new, append = _new_tuple, outputs.append
        for stream, token in emitted:
            status = stream.status
            finished = status >= _DONE
            append(new(StreamOutput, (stream.stream_id, (token,), "", finished,
                                      status.finish_reason if finished else None, len(stream.prompt_token_ids),
                                      len(stream.output_token_ids), stream.num_cached_tokens)))
            if finished:
                self._retire(stream)
        return outputs

    def _retire(self, stream: Stream) -> None:
        self._text.pop(stream.stream_id, None)
        self.finished_records.append(stream.record)
        self._totals["preemptions"] += stream.num_preemptions
        self._totals["tokens_recomputed"] += stream.num_recomputed_tokens
        self._totals["streams_finished"] += 1

    def _output(self, stream: Stream, token: int, now: float) -> StreamOutput:
        sid, status = stream.stream_id, stream.status
        text = ""
        state = self._text.get(sid)
        if state is not None:
            text, stopped = state.decoder.feed(token), False
            if state.stops.stops:  # most streams have no stop strings: their text goes out as is
                text, stopped = state.stops.push(text)
            if stopped:
                if status < _DONE:
                    self.scheduler.finish(sid, StreamStatus.FINISHED_STOPPED, now)
                    status = stream.status
            elif status >= _DONE:  # its last token: the text held back goes out with it
                text += state.stops.push(state.decoder.flush())[0] + state.stops.flush()
        finished = status >= _DONE  # the reason is looked up only for a finished stream
        reason = status.finish_reason if finished else None
        return _new_tuple(StreamOutput, (sid, (token,), text, finished, reason, len(stream.prompt_token_ids),
                                         len(stream.output_token_ids), stream.num_cached_tokens))

    # ---- blocking helpers -------------------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None) -> Iterator[StreamOutput]:
        """Run the engine until this stream ends, yielding its deltas (other streams advance too)."""
        stream_id = self.add_request(prompt, sampling)
        try:
            while True:
                for out in self.step():
                    if out.stream_id == stream_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(stream_id)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        ids = [self.add_request(p, s) for p, s in zip(prompts, params)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        reasons: dict[str, str | None] = {}
        prompt_ids = {i: self.scheduler.streams[i].prompt_token_ids for i in ids}
        while len(reasons) < len(ids):
            for out in self.step():
                if out.stream_id in tokens:
                    tokens[out.stream_id].extend(out.token_ids)
                    texts[out.stream_id].append(out.text)
                    if out.finished:
                        reasons[out.stream_id] = out.finish_reason
        return [GenerationResult(i, prompt_ids[i], tuple(tokens[i]), "".join(texts[i]), reasons[i]) for i in ids]

    def stats(self) -> EngineStats:
        live = list(self.scheduler.streams.values())
        now = self.clock.now()
        running = [s for s in live if s.status == StreamStatus.RUNNING]
        host = self.scheduler.kv.host
        prefix = self.scheduler.prefix_stats
        return EngineStats(
            num_running=len(running), num_waiting=sum(s.status == StreamStatus.WAITING for s in live),
            num_preempted=sum(s.status in (StreamStatus.PREEMPTED, StreamStatus.LOADING) for s in live),
            host_blocks_total=host.num_blocks if host else 0, host_blocks_free=host.num_free if host else 0,
            bytes_to_host=self.scheduler.bytes_to_host, bytes_from_host=self.scheduler.bytes_from_host,
            device_blocks_total=self.pool.num_blocks, device_blocks_free=self.pool.num_free,
            min_buffer_s=min((s.buffer_s(now) for s in running if s.rate > 0), default=0.0),
            sum_rate=sum(s.rate for s in live),
            preemptions=self._totals["preemptions"] + sum(s.num_preemptions for s in live),
            tokens_recomputed=self._totals["tokens_recomputed"] + sum(s.num_recomputed_tokens for s in live),
            streams_finished=self._totals["streams_finished"], steps=self._totals["steps"],
            device_blocks_cached=self.pool.num_cached, prefix_lookup_tokens=prefix.lookup_tokens,
            prefix_hit_tokens_device=prefix.hit_tokens_device, prompt_tokens_total=prefix.prompt_tokens,
            prompt_cached_tokens_total=prefix.prompt_hit_tokens)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
