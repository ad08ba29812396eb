"""How many streams a replica accepts, and how many more Serve may queue for it: derived from its working set.

A replica's engine holds every stream it accepts: RUNNING ones in the device KV pool, paused ones in the host spill
store, the rest WAITING (no KV yet) while its policy decides who runs. A stream Serve holds back in its own queue
is seen by no policy, so the replica should accept as many streams as its memory can keep, not just a batch.

The config speaks in streams of an expected size (`expected_stream_tokens`); in the direct placement the replica
admits by KV blocks: each stream claims its prompt plus its max_tokens, and the claims of the streams it holds stay
within the budget those streams of the expected size make (`direct_kv_budget`, `KVClaims`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    max_ongoing_requests: int  # Serve's per-replica concurrency: streams one replica's engine holds
    max_queued_requests: int  # Serve's bound on requests waiting in a caller's router (-1: unbounded)


def working_set_streams(num_device_blocks: int, num_host_blocks: int, block_size: int,
                        expected_stream_tokens: int) -> int:
    """Streams of the expected length whose KV fits in the device pool and the host store together.

    With write-through, a running stream's full blocks are also mirrored on the host, so the sum is an upper bound
    on the streams that keep their KV somewhere. It is the right side to err on: a stream accepted beyond it waits
    in the engine without KV (WAITING costs nothing until admitted) where the policy can still rank it against the
    others; one refused by Serve waits where nothing can.
    """
    per_stream = -(-expected_stream_tokens // block_size)
    return (num_device_blocks + num_host_blocks) // per_stream


def derived_queue_bound(replicas: int, max_ongoing_requests: int) -> int:
    """A quarter of the streams all replicas hold, at least 1.

    Serve's queue (in each caller's router) holds requests no replica has room for. They leave it only as streams
    finish: replicas x max_ongoing of them per stream lifetime, so a queue of a quarter of that makes its last
    request wait about a quarter of a stream's life before any replica even sees it. Past that, a 429 with
    Retry-After (the client, or a balancer in front, retries later or elsewhere) serves better than an unbounded
    wait that no scheduling policy sees.
    """
    return max(1, replicas * max_ongoing_requests // 4)


def admission(*, max_num_seqs: int, num_device_blocks: int, num_host_blocks: int, block_size: int,
              expected_stream_tokens: int, replicas: int, max_ongoing_requests: int | None,
              max_queued_requests: int | None) -> Admission:
    """Explicit values win; None derives. Never below max_num_seqs: the engine's batch must be fillable."""
    ongoing = max_ongoing_requests
    if ongoing is None:
        ongoing = max(max_num_seqs, working_set_streams(num_device_blocks, num_host_blocks, block_size,
                                                        expected_stream_tokens))
    queued = derived_queue_bound(replicas, ongoing) if max_queued_requests is None else max_queued_requests
    return Admission(ongoing, queued)


# Direct placement: HTTP requests other than streams (consumption reports, /metrics, /v1/models) need Serve slots on
# a replica whose streams fill its admission limit, or they would queue behind streams that last minutes.
CONTROL_SLOTS = 64


def direct_proxy_queue(stream_limit: int, replicas: int) -> int:
    """Direct placement: the bound on Serve's queue in the proxy. Requests wait there until the router has placed
    them (one accept round trip each), so a burst arriving at once queues there briefly even when the replicas
    have room: the bound is what all replicas take, not a small number (64 turned 95 of a 256-stream burst away
    with room for 320). The replicas' own limit is what answers 429 under real overload."""
    return -1 if stream_limit <= 0 else replicas * stream_limit + CONTROL_SLOTS


def direct_stream_limit(adm: Admission, replicas: int) -> int:
    """Streams of the expected size one replica takes in the direct placement: its working set plus its share of
    the queue bound.

    There is no caller-side queue of streams here: a replica holds its share of the queue in its own engine
    (WAITING, ranked by the policy) and answers 429 past it, OpenAI-shaped, with Retry-After."""
    queued = 0 if adm.max_queued_requests < 0 else -(-adm.max_queued_requests // replicas)
    return 0 if adm.max_queued_requests < 0 else adm.max_ongoing_requests + queued


def direct_kv_budget(adm: Admission, replicas: int, block_size: int, expected_stream_tokens: int) -> int:
    """KV blocks one replica's admitted streams may claim in the direct placement (0: no limit): the stream limit
    at the expected size. Each stream claims what it declares (`stream_claim`), not one expected stream's worth:
    a count would let a replica of long streams overfill its memory and turn short ones away with room to spare,
    and it turns away more of a paced policy's streams than an unpaced one's, as paced streams stay in the engine
    for as long as their readers read (real_traffic.md §7: 246 of 456 admitted against 285, raw 0.88x)."""
    return direct_stream_limit(adm, replicas) * -(-expected_stream_tokens // block_size)


def stream_claim(prompt_tokens: int, max_tokens: int, max_total_tokens: int, block_size: int, budget: int) -> int:
    """Blocks a stream claims against the replica's budget: its prompt and its whole output, within the context
    limit (TGI's router admits by the same sum, input + max_new_tokens). Never above the budget, so a stream the
    size of the whole budget is taken when the replica holds nothing else."""
    tokens = min(prompt_tokens + max_tokens, max_total_tokens)
    return min(budget, -(-tokens // block_size))


@dataclass
class KVClaims:
    """What the streams a replica has admitted claim (blocks), against its budget. Touched only on the replica's
    event loop."""

    budget: int  # 0: no limit
    held: int = 0

    def try_claim(self, blocks: int) -> bool:
        if self.budget and self.held and self.held + blocks > self.budget:
            return False
        self.held += blocks
        return True

    def release(self, blocks: int) -> None:
        self.held -= blocks
        assert self.held >= 0, "a replica released more KV claims than it held"
