"""The migration half of LLMEngine (llm_engine.py): a live stream exported between steps, and one that another
engine exported imported here (what travels: migration.py).

A mixin: it uses the engine's scheduler, runner, block pool, clock, detokenizer state (`_text`, `_decoders`), held
arrivals (`_future`), context limit (`max_total_tokens`), `idle` and `_settle` (finish the step in flight), all set
in LLMEngine.__init__.
"""

from __future__ import annotations

from tokenflow_ray.engine.detokenizer import StopMatcher, TextState
from tokenflow_ray.engine.migration import ExportedStream, StreamNotExportable
from tokenflow_ray.engine.stream import Stream, StreamStatus


class EngineMigration:
    def begin_export(self, stream_id: str) -> None:
        """Start moving a live stream out: it is paused (a running one now, to the host store) and never resumed
        here. `try_export` hands it over once no copy of its KV is in flight."""
        self._settle()
        self.scheduler.hold_for_export(stream_id)
        # To the host store whatever the policy: the KV is what moves (recomputed only when the store is full).
        self.scheduler.preempt(stream_id, self.clock.now(), to_host=True)

    def cancel_export(self, stream_id: str) -> None:
        """The move is off (no target took it): the stream is scheduled here again."""
        self.scheduler.cancel_export(stream_id)
        self.idle = False

    def try_export(self, stream_id: str) -> ExportedStream | None:
        """Between steps: the stream, taken out of this engine with everything it needs to continue elsewhere,
        or None while it cannot leave yet (its tail copy or a load is in flight: call again after a step)."""
        self._settle()
        stream = self.scheduler.streams.get(stream_id)
        if stream is None or not self.scheduler.is_leaving(stream_id):
            raise StreamNotExportable(f"stream {stream_id!r} is unknown, finished or not being exported")
        if stream.status == StreamStatus.RUNNING:  # was loading when the export began
            self.scheduler.preempt(stream_id, self.clock.now(), to_host=True)
        if not self.scheduler.exportable(stream_id):
            return None
        paused_on_host = stream.status == StreamStatus.PREEMPTED
        num_kv = stream.num_host_tokens if paused_on_host else 0
        kv = self.runner.export_kv(stream.host_block_ids[:self.pool.blocks_for_tokens(num_kv)]) if num_kv else None
        sampler = self.runner.export_sampler(stream_id) if hasattr(self.runner, "export_sampler") else None
        text = self._text.pop(stream_id, None)
        self.scheduler.release(stream_id)
        return ExportedStream(
            stream_id=stream_id, prompt_token_ids=stream.prompt_token_ids,
            output_token_ids=tuple(stream.output_token_ids), sampling=stream.sampling, rate=stream.rate,
            block_size=self.pool.block_size, num_kv_tokens=num_kv, kv=kv, sampler_state=sampler,
            text_state=None if text is None else (text.decoder.state(), text.stops.pending),
            reader=stream.reader, record=stream.record, arrival_time=stream.arrival_time,
            last_preempted_at=stream.last_preempted_at, exported_at=self.clock.now())

    def import_stream(self, exported: ExportedStream, elapsed_s: float = 0.0, moved: bool = True) -> str:
        """Continue a stream another engine exported, paused here; `elapsed_s`: how long ago it was exported
        (the reader kept reading meanwhile). Its KV goes to this engine's host store when there is room (then it
        resumes by load), else it recomputes. Raises ValueError if the stream does not fit this engine.
        `moved`: counts as a migration in its record (False: a failed move taken back by its own engine)."""
        self._settle()  # the step in flight may still copy into host blocks that the import is about to reuse
        sid = exported.stream_id
        if sid in self._future:
            raise ValueError(f"stream id {sid!r} is already live")
        vocab = self.runner.info.vocab_size
        if any(not 0 <= t < vocab for t in exported.prompt_token_ids + exported.output_token_ids):
            raise ValueError(f"import: token ids must be in [0, {vocab})")
        now = self.clock.now()
        shift = now - max(0.0, elapsed_s) - exported.exported_at
        stream = Stream(stream_id=sid, prompt_token_ids=exported.prompt_token_ids, sampling=exported.sampling,
                        arrival_time=exported.arrival_time + shift, max_total_tokens=self.max_total_tokens,
                        eos_token_ids=self.runner.info.eos_token_ids, rate=exported.rate)
        if exported.num_tokens >= self.max_total_tokens:
            raise ValueError(f"import: {exported.num_tokens} tokens leave no room within this engine's context "
                             f"limit of {self.max_total_tokens}")
        stream.output_token_ids = list(exported.output_token_ids)
        self.scheduler.check_admissible(stream)  # before anything of the export is changed: a refusal leaves it as is
        stream.last_preempted_at = exported.last_preempted_at + shift
        exported.reader.shifted(shift)
        exported.record.shifted(shift)
        stream.reader, stream.record = exported.reader, exported.record
        same_layout = exported.block_size == self.pool.block_size
        host_ids = self.scheduler.adopt(stream, exported.num_kv_tokens if same_layout else 0)
        try:
            if host_ids:
                self.runner.import_kv(host_ids, exported.kv)
            if exported.sampler_state is not None:
                self.runner.import_sampler(sid, exported.sampler_state)
        except Exception:
            self.scheduler.finish(sid, StreamStatus.FINISHED_ABORTED, now)  # frees the host blocks it was given
            raise
        if moved:
            stream.record.record_migration()
        if self._decoders is not None:
            state = TextState(self._decoders.new(), StopMatcher(exported.sampling.stop))
            if exported.text_state is not None:
                state.decoder = self._decoders.restore(exported.text_state[0])
                state.stops.pending = exported.text_state[1]
            self._text[sid] = state
        self.idle = False
        return sid
