"""The replica's token path (LLMServer._deltas) with grouping: a stream holding tokens is listed for the flusher,
held tokens leave on a tick when due, with no new token from the engine (a paused stream); ticks with nothing held
send nothing. The engine iterator's ticks themselves are tested on a real AsyncLLMEngine
(tests/engine/test_async_engine.py)."""

import asyncio
import time
from types import SimpleNamespace

from tokenflow_ray.engine.outputs import StreamOutput
from tokenflow_ray.serve.replica.grouping import GroupingConfig
from tokenflow_ray.serve.replica.server import LLMServer
from tokenflow_ray.serve.replica.stopping import ReplicaStopping

CFG = GroupingConfig(min_interval_s=0.05, max_interval_s=0.25, events_per_s=200)


class _Changes:
    def remove(self, stream_id: str) -> None:
        pass


class _Replica(ReplicaStopping):
    """What _deltas reads of the replica: its grouping settings, the count of active streams, the streams holding
    tokens, the change log, and whether it is stopping (never, here)."""

    def __init__(self) -> None:
        self.settings = SimpleNamespace(grouping=CFG)
        self._active = 0
        self._holding = {}
        self.changes = _Changes()


def _out(n: int, text: str, finished: bool = False) -> StreamOutput:
    return StreamOutput("s", (n,), text, finished, "length" if finished else None, 3, n)


async def _collect(events, holding: list | None = None) -> list[tuple[float, object]]:
    replica = _Replica()
    start = time.monotonic()

    async def outputs():
        for e in events:
            if holding is not None:
                holding.append(sorted(replica._holding))
            if isinstance(e, float):
                await asyncio.sleep(e)
                yield None  # a tick, as the replica's flusher puts one through AsyncLLMEngine.tick
            else:
                yield e

    got = [(time.monotonic() - start, d) async for d in LLMServer._deltas(replica, outputs(), "s", 20.0)]
    assert replica._holding == {}  # an ended stream is off the flusher's list
    return got


async def test_a_held_token_leaves_on_a_tick_when_due():
    # First token at once; the second is held (the reader holds 50 ms); no third comes (the stream was paused):
    # a tick after 80 ms sends it; the last goes at once.
    holding = []
    got = await _collect([_out(1, "a"), _out(2, "b"), 0.08, 0.08, _out(3, "c", finished=True)], holding)
    assert holding == [[], [], ["s"], [], []]  # listed while it held "b", off once that was sent
    deltas = [d for _, d in got]
    assert [(d.text, d.num_new_tokens, d.num_output_tokens, d.finished) for d in deltas] == [
        ("a", 1, 1, False), ("b", 1, 2, False), ("c", 1, 3, True)]
    assert got[1][0] >= 0.05  # sent by the tick, not before its interval


async def test_ticks_with_nothing_held_send_nothing():
    got = await _collect([_out(1, "a"), 0.06, 0.06, _out(2, "b", finished=True)])
    assert [(d.text, d.num_new_tokens) for _, d in got] == [("a", 1), ("b", 1)]
