"""Per-stream KV mechanics over the device pool and the host spill store; plans the block copies of one step.

Host block i of a stream mirrors its device block i, and `num_host_tokens` says how much of the stream's prefix is
valid on the host. Full device blocks never change again, so write-through copies only full blocks; the partial
last block goes over when the stream is preempted (its "unsynced tail"). Blocks already mirrored are freed at the
moment of preemption; tail blocks are freed after their copy, at the end of the step (`pending_free`).

A load (host -> device) reserves all its device blocks when it starts and is then copied in chunks over as many
steps as the per-step copy budget needs, like write-through, so one large reload cannot stretch a step. The
stream stays LOADING until its last chunk has landed; the loads still waiting form the live copy queue that the
reload-or-recompute decision reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from tokenflow_ray.engine.block_pool import BlockPool
from tokenflow_ray.engine.plan import BlockCopy
from tokenflow_ray.engine.stream import Stream

_copy = tuple.__new__  # BlockCopy(...) without its NamedTuple __new__ (a Python call): tens a step


class KVManager:
    def __init__(self, device: BlockPool, host: BlockPool | None) -> None:
        self.device = device
        self.host = host
        self.block_size = device.block_size
        self.pending_free: list[int] = []  # device blocks a swap-out copy still reads this step
        self._write: list[BlockCopy] = []
        self._out: list[BlockCopy] = []
        self._in: list[BlockCopy] = []
        self._load_queue: deque[BlockCopy] = deque()  # loads started but not yet planned into a step (FIFO)
        self._loads_left: dict[str, int] = {}  # LOADING stream -> its blocks not yet landed

    def take_copies(self) -> tuple[tuple[BlockCopy, ...], tuple[BlockCopy, ...], tuple[BlockCopy, ...]]:
        """(write_through, swap_out, swap_in) planned since the last call."""
        out = (tuple(self._write), tuple(self._out), tuple(self._in))
        self._write, self._out, self._in = [], [], []
        return out

    def step_done(self) -> None:
        """The step's copies are complete: tail blocks of preempted streams can be reused."""
        if self.pending_free:
            self.device.free(self.pending_free)
            self.pending_free = []

    # ---- device blocks ----------------------------------------------------------------------------------------
    def grow(self, stream: Stream, num_new_tokens: int) -> bool:
        need = self.device.blocks_for_tokens(stream.num_computed_tokens + num_new_tokens) - len(stream.block_ids)
        if need <= 0:
            return True
        if not self.device.can_allocate(need):
            return False
        stream.block_ids.extend(self.device.allocate(need))
        return True

    def release_device(self, stream: Stream) -> None:
        if self._loads_left.pop(stream.stream_id, None) is not None:  # a load in flight: drop its queued chunks
            self._load_queue = deque(c for c in self._load_queue if c.stream_id != stream.stream_id)
            # Blocks not landed hold no content yet: never cached (block_pool.py), even if offered.
        if stream.block_ids:
            self.device.free(reversed(stream.block_ids))  # last block first: a cached tail goes before its prefix
            stream.block_ids = []
        stream.num_computed_tokens = 0
        stream.num_keyed_blocks = 0

    def release_host(self, stream: Stream) -> None:
        if stream.host_block_ids:
            assert self.host is not None
            self.host.free(reversed(stream.host_block_ids))  # last first: a cached tail goes before its prefix
            stream.host_block_ids = []
        stream.num_host_tokens = 0

    # ---- preempt / resume -------------------------------------------------------------------------------------
    def swap_out(self, stream: Stream) -> tuple[int, int] | None:
        """Preempt to the host: copy the unsynced tail, free the rest now.

        Returns (blocks freed at once, tail blocks freed after their copy), or None (nothing changed) if no room.
        """
        if self.host is None:
            return None
        computed = stream.num_computed_tokens
        first_tail = stream.num_host_tokens // self.block_size  # host block that is partial or missing
        num_blocks = self.device.blocks_for_tokens(computed)
        missing = num_blocks - len(stream.host_block_ids)
        if missing > 0 and not self.host.can_allocate(missing):
            return None
        if missing > 0:
            stream.host_block_ids.extend(self.host.allocate(missing))
        sid, blocks, host_blocks = stream.stream_id, stream.block_ids, stream.host_block_ids
        for i in range(first_tail, num_blocks):
            self._out.append(_copy(BlockCopy, (sid, blocks[i], host_blocks[i])))
        if self.host.caching:
            for i in range(first_tail, computed // self.block_size):  # full tail blocks: findable on the host
                self._offer_host(stream, i)
        self.device.free(reversed(stream.block_ids[:first_tail]))  # mirrored already: free at once
        self.pending_free.extend(stream.block_ids[first_tail:])  # read by this step's copy
        stream.num_keyed_blocks = 0
        # Host blocks past the computed prefix (from an earlier, longer stay) stay allocated for reuse.
        freed_now, tail = first_tail, len(stream.block_ids) - first_tail
        stream.block_ids = []
        stream.num_host_tokens = computed
        stream.num_computed_tokens = 0
        return freed_now, tail

    def blocks_freed_at_once(self, stream: Stream, to_host: bool) -> int:
        """Device blocks a preemption of the stream frees at the decision: to the host (`swap_out`), the blocks
        already mirrored, as the tail is freed after its copy; to recompute, or without room on the host, all."""
        if to_host and self.host is not None:
            missing = self.device.blocks_for_tokens(stream.num_computed_tokens) - len(stream.host_block_ids)
            if missing <= 0 or self.host.can_allocate(missing):
                return min(stream.num_host_tokens // self.block_size, len(stream.block_ids))
        return len(stream.block_ids)

    def start_load(self, stream: Stream, cached: list[int] | None = None) -> bool:
        """Allocate device blocks and queue host -> device copies of the stream's host prefix. `cached`: device
        blocks still holding the start of that prefix (prefix caching), taken instead of loaded. If they cover it
        all there is nothing to copy (`is_loading` is False) and the stream can run at once."""
        n = self.device.blocks_for_tokens(stream.num_host_tokens)
        cached = cached or []
        if cached:
            self.device.take(cached)  # before the check: an unowned cached block counts as free until taken
        if not self.device.can_allocate(n - len(cached)):
            if cached:
                self.device.free(reversed(cached))
            return False
        stream.block_ids = cached + self.device.allocate(n - len(cached))
        stream.num_keyed_blocks = len(cached)
        sid, blocks, host_blocks = stream.stream_id, stream.block_ids, stream.host_block_ids
        if n > len(cached):
            self._load_queue.extend(_copy(BlockCopy, (sid, blocks[i], host_blocks[i])) for i in range(len(cached), n))
            self._loads_left[stream.stream_id] = n - len(cached)
        return True

    def is_loading(self, stream: Stream) -> bool:
        return stream.stream_id in self._loads_left

    def plan_loads(self, budget_blocks: int) -> int:
        """Move up to budget_blocks queued loads into this step's copies (oldest first); returns how many."""
        n = min(budget_blocks, len(self._load_queue))
        for _ in range(n):
            self._in.append(self._load_queue.popleft())
        return n

    @property
    def queued_load_blocks(self) -> int:
        """Loads waiting for a later step's copy budget: the load queue a new reload would wait behind."""
        return len(self._load_queue)

    @property
    def planned_evict_blocks(self) -> int:
        """Swap-out tails planned for this step: the copy job runs them before any load."""
        return len(self._out)

    def loads_landed(self, copies: Iterable[BlockCopy]) -> list[str]:
        """Count a finished step's loads; returns the streams whose whole prefix is now on the device."""
        done = []
        for c in copies:
            left = self._loads_left.get(c.stream_id)
            if left is None:
                continue  # the stream ended while its copy ran
            if left == 1:
                del self._loads_left[c.stream_id]
                done.append(c.stream_id)
            else:
                self._loads_left[c.stream_id] = left - 1
        return done

    def finish_load(self, stream: Stream, keep_host_copy: bool = True) -> None:
        """The load landed. Without write-through the host copy is dropped (swap semantics: the KV lives in one
        place, and the next preemption copies every block again); with it, it stays the mirror of the prefix."""
        stream.num_computed_tokens = stream.num_host_tokens
        if not keep_host_copy:
            self.release_host(stream)

    # ---- write-through ----------------------------------------------------------------------------------------
    def unsynced_full_blocks(self, stream: Stream) -> int:
        return max(0, stream.num_computed_tokens // self.block_size - stream.num_host_tokens // self.block_size)

    def write_through(self, streams: Iterable[Stream], budget_blocks: int) -> int:
        """Mirror full blocks of the given streams (in the order given) to the host, up to budget_blocks."""
        if self.host is None:
            return 0
        planned = 0
        caching = self.host.caching
        for stream in streams:
            start = stream.num_host_tokens // self.block_size
            end = stream.num_computed_tokens // self.block_size
            for i in range(start, end):
                if planned >= budget_blocks:
                    return planned
                if i >= len(stream.host_block_ids):
                    if caching and self._share_host(stream, i):
                        continue  # the host holds this block already (another stream's): no copy
                    if not self.host.can_allocate(1):
                        return planned  # host full: stop mirroring; preemption falls back to recompute
                    stream.host_block_ids.extend(self.host.allocate(1))
                copy = (stream.stream_id, stream.block_ids[i], stream.host_block_ids[i])
                self._write.append(_copy(BlockCopy, copy))
                stream.num_host_tokens = (i + 1) * self.block_size
                if caching:
                    self._offer_host(stream, i)
                planned += 1
        return planned

    # ---- the host tier of the prefix cache --------------------------------------------------------------------
    def _offer_host(self, stream: Stream, i: int) -> None:
        """Host block i of the stream, full and copied this step, findable by its key (a load that finds it is
        planned in a later step, after this step's copy has landed)."""
        if i < len(stream.block_keys):
            bs = self.block_size
            self.host.cache(stream.host_block_ids[i], stream.block_keys[i], stream.token_ids(i * bs, (i + 1) * bs))

    def _share_host(self, stream: Stream, i: int) -> bool:
        """Write-through of block i finds it cached on the host: the stream takes that copy as its mirror."""
        if i >= len(stream.block_keys):
            return False
        bs = self.block_size
        found = self.host.lookup([stream.block_keys[i]], stream.token_ids(i * bs, (i + 1) * bs))
        if not found:
            return False
        self.host.take(found)
        stream.host_block_ids.append(found[0])
        stream.num_host_tokens = (i + 1) * bs
        return True

    # ---- invariants -------------------------------------------------------------------------------------------
    def check_integrity(self, streams: Iterable[Stream]) -> None:
        streams = list(streams)
        self.device.check_integrity([s.block_ids for s in streams] + [self.pending_free])
        if self.host is not None:
            self.host.check_integrity([s.host_block_ids for s in streams])
        live = {s.stream_id for s in streams}
        assert set(self._loads_left) <= live, "a load is queued for a stream that is gone"
        assert all(c.stream_id in self._loads_left for c in self._load_queue), "queued load without its stream"
        for s in streams:
            assert s.num_host_tokens <= s.num_tokens, f"{s.stream_id}: host holds more than the stream"
            assert self.device.blocks_for_tokens(s.num_host_tokens) <= len(s.host_block_ids), \
                f"{s.stream_id}: host prefix not covered by host blocks"
