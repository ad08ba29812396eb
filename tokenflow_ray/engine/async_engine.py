"""AsyncLLMEngine: the engine loop on a background thread, per-stream async iterators of deltas.

All engine state is touched only by the loop thread; callers send commands (add, abort, any call) through a queue
and await a future, so ValueErrors from validation reach the caller. Outputs of one step are handed to each event
loop in one `call_soon_threadsafe`. A consumer that stops iterating (client disconnect, cancellation) aborts its
stream, which frees its blocks. If a step fails, the live streams fail with the error and are aborted, and the loop
keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from tokenflow_ray.engine.llm_engine import LLMEngine
from tokenflow_ray.engine.migration import ExportedStream, StreamNotExportable
from tokenflow_ray.engine.outputs import StreamOutput
from tokenflow_ray.engine.sampling import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    pass


class StreamMoved(Exception):
    """Raised in a stream's iterator when the stream left this engine for another (migration): `where` says
    where the rest of its outputs come from."""

    def __init__(self, stream_id: str, where: Any) -> None:
        super().__init__(f"stream {stream_id} moved")
        self.stream_id = stream_id
        self.where = where


IDLE_STEP_WAIT_S = 0.002  # about a fifth of a decode step here: pacing resolution, not CPU burn


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._exports: dict[str, concurrent.futures.Future] = {}  # streams leaving once they can (migration)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenflow-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread / event loop) ----------------------------------------------------------------
    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread between steps and return its result (or raise its exception)."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        if self._stop.is_set():
            raise EngineDeadError("engine is shut down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    async def generate(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                       stream_id: str | None = None, arrival_time: float | None = None,
                       on_added: Callable[[str], None] | None = None,
                       rate: float = 0.0) -> AsyncIterator[StreamOutput | None]:
        async for out in self._iterate(lambda: self.engine.add_request(prompt, sampling, stream_id, arrival_time,
                                                                       rate), on_added):
            yield out

    async def _iterate(self, enter: Callable[[], str],
                       on_added: Callable[[str], None] | None = None) -> AsyncIterator[StreamOutput | None]:
        """Enter a stream on the engine thread (`enter` returns its id) and yield its outputs until it ends; a
        consumer that stops early aborts it. A None between outputs is a tick (`tick`)."""
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()

        def add() -> str:
            sid = enter()
            self._sinks[sid] = (loop, sink)
            return sid

        sid = await self.call(add)
        if on_added is not None:
            on_added(sid)
        finished = False
        try:
            while True:
                item = await sink.get()
                if item is None:
                    yield None
                    continue
                if isinstance(item, StreamMoved):
                    finished = True  # not ours to abort any more
                    raise item
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished and not self._stop.is_set():
                self.submit(lambda: self._abort(sid))

    def tick(self, stream_id: str) -> None:
        """Wake the stream's iterator with a None (a tick) if it is live here: its consumer may act on time alone,
        e.g. send tokens it holds for a stream that makes no new one (paused). Call on the consumer's event loop."""
        entry = self._sinks.get(stream_id)
        if entry is not None:
            entry[1].put_nowait(None)

    async def abort(self, stream_id: str) -> bool:
        return await self.call(lambda: self._abort(stream_id))

    # ---- migration --------------------------------------------------------------------------------------------
    async def export(self, stream_id: str) -> ExportedStream | None:
        """Pause a live stream and take it out of the engine once no copy of its KV is in flight; None if it
        finished first. Its iterator stays open, waiting: end it with `handed_off`, or `take_back` the stream."""
        def start() -> concurrent.futures.Future:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self.engine.begin_export(stream_id)  # raises for unknown ids
            self._exports[stream_id] = fut
            self._poll_exports()
            return fut

        return await asyncio.wrap_future(await self.call(start))

    async def handed_off(self, stream_id: str, where: Any) -> None:
        """The exported stream lives elsewhere now: its iterator raises StreamMoved(where) after its last outputs."""
        def deliver() -> None:
            target = self._sinks.pop(stream_id, None)
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, StreamMoved(stream_id, where))

        await self.call(deliver)

    async def take_back(self, exported: ExportedStream) -> None:
        """The move failed: continue the exported stream here; its open iterator gets its outputs again."""
        def back() -> None:
            if exported.stream_id in self._sinks:  # else its reader is gone: nothing to continue for
                # Same clock: no shift (elapsed is exactly the time since the export).
                self.engine.import_stream(exported, self.engine.clock.now() - exported.exported_at, moved=False)

        await self.call(back)

    async def adopt(self, exported: ExportedStream, elapsed_s: float = 0.0,
                    on_added: Callable[[str], None] | None = None) -> AsyncIterator[StreamOutput | None]:
        """Continue a stream another engine exported; yields its outputs from here on, like `generate`."""
        async for out in self._iterate(lambda: self.engine.import_stream(exported, elapsed_s), on_added):
            yield out

    def _poll_exports(self) -> None:
        for sid, fut in list(self._exports.items()):
            try:
                exported = self.engine.try_export(sid)
            except StreamNotExportable:  # it finished (or was aborted) before it could leave
                exported = None
            except Exception as exc:  # noqa: BLE001 - delivered to the caller
                del self._exports[sid]
                if self.engine.get_stream(sid) is not None:
                    self.engine.cancel_export(sid)  # it keeps running here
                fut.set_exception(exc)
                continue
            else:
                if exported is None and self.engine.get_stream(sid) is not None:
                    continue  # not yet: after the next step
            del self._exports[sid]
            fut.set_result(exported)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _abort(self, stream_id: str) -> bool:
        self._sinks.pop(stream_id, None)
        aborted = self.engine.abort(stream_id)
        self.engine.step_outputs_discard(stream_id)
        return aborted

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # keep serving: fail the live streams, free their blocks
                log.exception("engine step failed; aborting %d live streams", len(self._sinks))
                self._fail_all(exc)
                continue
            self._dispatch(outputs)
            if self._exports:
                self._poll_exports()
            if self.engine.idle:  # every live stream is paced for now: wait a little, or a command, not spin
                self._wake.wait(IDLE_STEP_WAIT_S)
                self._wake.clear()
        self._fail_all(EngineDeadError("engine shut down"))

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # delivered to the awaiting caller
                fut.set_exception(exc)

    def _dispatch(self, outputs: list[StreamOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamOutput]]] = defaultdict(list)
        for out in outputs:
            target = self._sinks.get(out.stream_id)
            if target is None:
                continue
            if out.finished:
                del self._sinks[out.stream_id]
            by_loop[target[0]].append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: its consumers are gone
                for _, out in items:
                    if not out.finished:
                        self.engine.abort(out.stream_id)

    def _fail_all(self, exc: BaseException) -> None:
        exports, self._exports = self._exports, {}
        for fut in exports.values():
            fut.set_exception(exc)
        sinks, self._sinks = self._sinks, {}
        for sid, (loop, sink) in sinks.items():
            self.engine.abort(sid)
            try:
                loop.call_soon_threadsafe(sink.put_nowait, exc)
            except RuntimeError:
                pass
        self.engine.step_outputs_discard(None)


def _deliver(items: list[tuple[asyncio.Queue, StreamOutput]]) -> None:
    for sink, out in items:
        sink.put_nowait(out)
