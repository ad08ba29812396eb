"""The token path of an LLMServer replica (server.py): a stream's engine outputs grouped into deltas for whoever
answers HTTP, and the backend the HTTP routes call in the direct placement.

The first token goes alone and at once, later tokens grouped by an interval that adapts to the reader's buffer and
the replica's load (grouping.py; ray-notes §5 and §6.3: a per-token item costs ~0.7 ms, batching the first token
costs TTFT). A stream that moves to another replica goes on from there (migration.py), in order, as if it had
stayed.

A mixin: it uses the replica's engine (`engine`, `aengine`), settings, change log, central actor handle, `_relayed`
`_holding`/`_active` and `_claims`, set in LLMServer.__init__.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from tokenflow_ray.cluster.messages import Delta, GenerateRequest, Report
from tokenflow_ray.engine.async_engine import StreamMoved
from tokenflow_ray.serve.control.central import report_with_retry
from tokenflow_ray.serve.http.ingress import queue_full
from tokenflow_ray.serve.replica.admission import stream_claim
from tokenflow_ray.serve.replica.grouping import DeltaGrouper


def _counts(out) -> tuple[int, int]:
    """(prompt tokens, output tokens so far) of an engine output; (0, 0) before the first."""
    return (0, 0) if out is None else (out.num_prompt_tokens, out.num_output_tokens)


def _cached(out) -> int:
    return 0 if out is None else out.num_cached_tokens


class TokenPath:
    """A stream's way from the engine to whoever answers HTTP."""

    async def generate(self, req: GenerateRequest, follow_moves: bool = False) -> AsyncIterator[Delta]:
        """The stream's deltas. If it moves to another replica: with `follow_moves` (the ingress placement) the last
        delta from here names the new replica's port and the caller pulls the rest there, so this replica's part
        ends at the move; else (this replica holds the client's response) the rest is relayed from there."""
        self._check_stopping()  # the app is stopping: ServerStopping, a 503 before any SSE header
        prompt = req.prompt if req.messages is None else self._chat_prompt(req.messages)

        def on_added(sid: str) -> None:
            # The central table learns of it in the next batch: the first token never waits for the actor. A
            # report that beats the batch there waits for it (CentralScheduler.register_grace_s).
            self.changes.add(sid, req.rate)

        outputs = self.aengine.generate(prompt, req.sampling, stream_id=req.stream_id, on_added=on_added,
                                        rate=req.rate)
        async for delta in self._deltas(outputs, req.stream_id, req.rate, follow_moves):
            yield delta

    async def _deltas(self, outputs: AsyncIterator, stream_id: str, rate: float,
                      follow_moves: bool = False) -> AsyncIterator[Delta]:
        """The engine's outputs of one stream grouped into deltas (grouping.py); a stream holding tokens is in
        `_holding`, and `_flush_loop` ticks its iterator (a None) when they are due before a next output comes. If
        the stream moves to another replica, the rest comes from there through its port (migration), in order, as
        if it had stayed: relayed here, or pulled there by a caller that follows moves (`generate`)."""
        grouper = DeltaGrouper(self.settings.grouping, rate)
        text: list[str] = []
        last = None
        self._active += 1
        active = True
        try:
            try:
                async for out in outputs:
                    self._check_stopping()  # woken by a tick (stopping.py) if it has no output coming
                    now = time.monotonic()
                    if out is not None:
                        last = out
                        text.append(out.text)
                        grouper.hold(len(out.token_ids))
                    elif not grouper.held:
                        continue
                    if grouper.due(now, out is not None and out.finished, self._active):
                        self._holding.pop(stream_id, None)
                        yield Delta("".join(text), grouper.held, *_counts(last), last.finished, last.finish_reason,
                                    num_cached_tokens=last.num_cached_tokens)
                        grouper.sent_now(now)
                        text.clear()
                    else:
                        self._holding[stream_id] = grouper
            except StreamMoved as moved:
                self._active -= 1
                active = False
                if follow_moves:  # what this replica generated, and where the rest is
                    yield Delta("".join(text), grouper.held, *_counts(last), moved_to=moved.where,
                                num_cached_tokens=_cached(last))
                    return
                if grouper.held and last is not None:  # what this replica generated goes out before the relay
                    yield Delta("".join(text), grouper.held, last.num_prompt_tokens, last.num_output_tokens,
                                num_cached_tokens=last.num_cached_tokens)
                async for delta in self._relay(stream_id, moved.where):
                    yield delta
        finally:
            self._holding.pop(stream_id, None)
            if active:
                self._active -= 1
            self.changes.remove(stream_id)

    async def _flush_loop(self) -> None:
        """Tokens held for a group go out when due even if their stream makes no new token by then (it was
        paused): every min_interval_s, a tick to each holding stream whose group is due. One timer for the
        replica, not one per stream and output."""
        period = max(self.settings.grouping.min_interval_s, 0.01)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for sid, grouper in list(self._holding.items()):
                if grouper.flush_due(now, self._active):
                    self.aengine.tick(sid)

    def _chat_prompt(self, messages: tuple[tuple[str, str], ...]) -> list[int]:
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None) is None:
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=True,
                                      add_generation_prompt=True)
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    # ---- the HTTP routes' backend in the direct placement (serve/http/ingress.py) ----------------------------
    def _new_stream_id(self, prefix: str) -> str:
        # The owner's id rides in the stream id, so the router sends the stream's reports here (slack_router.py).
        return f"{prefix}{uuid.uuid4().hex}-{self.replica_id}"

    async def _open_stream(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """Admission by what the stream claims (admission.py): its prompt and its max_tokens, in KV blocks, against
        the replica's budget; past it a 429 with Retry-After, before any SSE header."""
        claims = self._claims
        claim = 0
        if claims.budget:
            ids = (self._chat_prompt(req.messages) if req.messages is not None
                   else self.engine.prompt_token_ids(req.prompt))
            req = replace(req, prompt=tuple(ids), messages=None)  # tokenized once, here
            cache = self.engine.config.cache
            claim = stream_claim(len(ids), req.sampling.max_tokens, self.engine.max_total_tokens, cache.block_size,
                                 claims.budget)
            if not claims.try_claim(claim):
                raise queue_full(self.settings.retry_after_s)
        try:
            async for delta in self.generate(req):
                yield delta
        finally:
            claims.release(claim)

    async def _route_report(self, report: Report) -> bool:
        if report.stream_id in self.changes.live:
            return await self.apply_report(report)
        port = self._relayed.get(report.stream_id)
        if port is not None:  # it moved from here: straight to its new replica
            port.report.remote(report)
            return True
        # Not ours (another router sent it here, or the stream moved): the central actor knows the owner.
        return await report_with_retry(self.central, report, self.http.report_retry_s)

    def _stream_lost(self, stream_id: str) -> None:  # a live replica loses no stream
        pass
