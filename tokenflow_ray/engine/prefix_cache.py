"""Prefix caching in the scheduler, a part of Scheduler (scheduler.py): full blocks offered to the device pool's
cache as their KV is computed, a stream starting from the longest cached prefix of its tokens, and the hits
counted.

A stream takes cached blocks only when it starts from nothing on the device (new, or paused and coming back): its
computed prefix then is those blocks, and its next chunk starts after them. At least its last token is computed,
since that step samples its next token. Cached blocks are full and the stream writes past them, so no block with
two owners is ever written.

A mixin: it uses the scheduler's block pool and `prefix_stats`, set in Scheduler.__init__.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenflow_ray.engine.block_pool import ROOT_KEY, block_keys
from tokenflow_ray.engine.stream import Stream


@dataclass
class PrefixCacheStats:
    """Tokens looked up and found, over every start from nothing on the device; and over first starts (prompts),
    what a request's usage reports as cached."""

    lookup_tokens: int = 0
    hit_tokens_device: int = 0
    hit_tokens_host: int = 0  # found on the host past what the device held: loaded, not computed
    prompt_tokens: int = 0
    prompt_hit_tokens: int = 0  # both tiers
    prompt_hit_tokens_device: int = 0
    prompt_hit_tokens_host: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class SchedulerPrefixCache:
    def _keys_through(self, stream: Stream, num_blocks: int) -> list[int]:
        """The stream's block keys, extended from its tokens to `num_blocks` where they are known."""
        keys = stream.block_keys
        if len(keys) < num_blocks:
            bs = self.pool.block_size
            start = len(keys)
            keys.extend(block_keys(stream.token_ids(start * bs, num_blocks * bs), bs,
                                   keys[-1] if keys else ROOT_KEY))
        return keys

    def _take_prefix(self, stream: Stream) -> int:
        """A stream with nothing on the device takes the longest cached prefix of its full blocks, leaving its last
        token to compute; returns the tokens it took. `_drop_prefix` gives them back if it does not start."""
        pool = self.pool
        hits = self._cached_prefix(stream, (stream.num_tokens - 1) // pool.block_size)
        if hits:
            pool.take(hits)
            stream.block_ids = hits
            stream.num_computed_tokens = len(hits) * pool.block_size
            stream.num_keyed_blocks = len(hits)
        return len(hits) * pool.block_size

    def _cached_prefix(self, stream: Stream, num_blocks: int) -> list[int]:
        """Device blocks still holding the stream's first `num_blocks` full blocks, as far as they go (looked up,
        not taken)."""
        if not self.pool.caching or num_blocks <= 0:
            return []
        bs = self.pool.block_size
        keys = self._keys_through(stream, num_blocks)[:num_blocks]
        return self.pool.lookup(keys, stream.token_ids(0, len(keys) * bs))

    def _host_prefix(self, stream: Stream, view) -> tuple[list[int], list[int]] | None:
        """For a stream with nothing anywhere: (host blocks of its longest prefix cached on the host, device blocks
        still holding the start of it) when the host holds more of it than the device and the cost model would
        load those blocks rather than compute them; else None."""
        host, bs = self.kv.host, self.pool.block_size
        limit = (stream.num_tokens - 1) // bs
        if limit <= 0 or not host.num_cached:
            return None
        keys = self._keys_through(stream, limit)[:limit]
        tokens = stream.token_ids(0, len(keys) * bs)
        host_hits = host.lookup(keys, tokens)
        if not host_hits:
            return None
        cached = self.pool.lookup(keys[:len(host_hits)], tokens)
        if len(host_hits) <= len(cached) or not self._resume_by_load(stream, view, (len(host_hits) - len(cached)) * bs):
            return None
        return host_hits, cached

    def _start_host_load(self, stream: Stream, host_hits: list[int], cached: list[int]) -> bool:
        """The stream takes the host's blocks as its host copy and starts loading what the device lacks."""
        self.kv.host.take(host_hits)
        stream.host_block_ids = list(host_hits)
        stream.num_host_tokens = len(host_hits) * self.pool.block_size
        if self.kv.start_load(stream, cached):
            return True
        self.kv.release_host(stream)
        return False

    def _drop_prefix(self, stream: Stream) -> None:
        if stream.block_ids:
            self.pool.free(reversed(stream.block_ids))
            stream.block_ids = []
        stream.num_computed_tokens = 0
        stream.num_keyed_blocks = 0

    def _count_start(self, stream: Stream, hit_tokens: int, first: bool, host_tokens: int = 0) -> None:
        """A stream starts (first=True: for the first time) from `hit_tokens` cached on the device and
        `host_tokens` after them loaded from the host's cache."""
        stats = self.prefix_stats
        found = hit_tokens + host_tokens
        if found and stream.num_dropped_tokens:  # what its last drop lost, found again: not recomputed
            stream.record.record_recompute_avoided(min(found, stream.num_dropped_tokens))
        stream.num_dropped_tokens = 0
        stats.lookup_tokens += stream.num_tokens
        stats.hit_tokens_device += hit_tokens
        stats.hit_tokens_host += host_tokens
        if first:
            stats.prompt_tokens += stream.num_prompt_tokens
            stats.prompt_hit_tokens += found
            stats.prompt_hit_tokens_device += hit_tokens
            stats.prompt_hit_tokens_host += host_tokens
            stream.num_cached_tokens = found

    def _cache_blocks(self, stream: Stream) -> None:
        """Offer the stream's device blocks that its computed tokens have filled to the pool's cache."""
        bs = self.pool.block_size
        full = min(stream.num_computed_tokens // bs, len(stream.block_ids))
        done = stream.num_keyed_blocks
        if full <= done:
            return
        keys = self._keys_through(stream, full)
        end = min(full, len(keys))  # a block holding a token not sampled yet waits for a later step
        pool, blocks = self.pool, stream.block_ids
        for i in range(done, end):
            pool.cache(blocks[i], keys[i], stream.token_ids(i * bs, (i + 1) * bs))
        stream.num_keyed_blocks = end
