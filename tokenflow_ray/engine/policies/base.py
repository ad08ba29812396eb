"""The policy interface. A policy ranks streams and says when it may act; the scheduler owns the mechanics.

Every policy thus gets the same block accounting and invariants; a new policy is a new class. The policies in
words: docs/design.md §5.4.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from tokenflow_ray.engine.cost_model import CostModel
from tokenflow_ray.engine.stream import Stream, StreamStatus


@dataclass(frozen=True)
class SchedulerView:
    """What a policy may look at when deciding; built by the scheduler once per step."""

    now: float
    cost: CostModel
    device_blocks: int
    host_blocks: int
    block_size: int
    max_num_seqs: int
    num_working: int  # streams admitted and not finished: running, loading or preempted
    sum_rate: float  # Σ declared rates of the working set (Eq. 6): the demand admitted onto decode capacity
    mean_full_blocks: float  # declared full-length footprint (prompt + max_tokens) of a live stream, in blocks
    mean_rate: float  # mean declared rate of live paced streams (0 if none)
    max_device_batch: int = 1  # streams the device holds at once (memory at mean mid-life length, max_num_seqs)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


class SchedulingPolicy(ABC):
    name: str
    proactive: bool = False  # may preempt streams that memory does not force out
    uses_host_store: bool = False  # preempts to the host spill store (else recompute only)
    reserve_on_resume: bool = False  # a resume, too, must leave `reserve_tokens` of the running streams free

    @abstractmethod
    def rank(self, streams: Sequence[Stream], view: SchedulerView) -> list[Stream]:
        """All live streams, highest priority first. Memory-forced victims come from the end."""

    def should_rebalance(self, streams: Sequence[Stream], view: SchedulerView) -> bool:
        """Whether to re-choose which streams hold the device this step (proactive policies only)."""
        return False

    @property
    def rebalance_interval_s(self) -> float:
        """Seconds between rebalances (0: any step may rebalance)."""
        return 0.0

    def may_preempt(self, stream: Stream, view: SchedulerView) -> bool:
        """Whether a running stream may be paused to make room for higher-ranked ones."""
        return False

    def admission_limit(self, view: SchedulerView) -> float:
        """Largest working set (running + loading + preempted) new streams may be admitted into."""
        return float("inf")

    def hold(self, running: Sequence[Stream], view: SchedulerView) -> set[str]:
        """Running streams to skip this step (they keep their blocks): compute-side balancing."""
        return set()

    def patience_s(self, view: SchedulerView) -> float:
        """How long the streams a rebalance brings in may wait for the blocks and slots that running streams free
        by finishing, before a running stream is paused for them (0: pause at once)."""
        return 0.0

    def resumes_behind(self, paused: Sequence[Stream], view: SchedulerView) -> bool:
        """Whether a paused stream is late coming back: then a rebalance pauses nobody for a new stream, only for
        the paused ones (False: newcomers may always displace running streams)."""
        return False

    def reserve_tokens(self, running: Sequence[Stream]) -> int:
        """Tokens kept free for running streams' growth when admitting a new stream (memory-aware admission)."""
        return 0

    def load_budget_blocks(self, view: SchedulerView) -> float:
        """Blocks that the paused streams a rebalance brings back may reload until the next one (inf: no cap)."""
        return float("inf")

    def growth_tokens(self, stream: Stream) -> int:
        """Tokens a stream in the rebalance's device set will add before the set is chosen again: the set must
        hold them too (0: the next token only)."""
        return 0

    def refine(self, chosen: list[Stream], ranked: Sequence[Stream], view: SchedulerView) -> list[Stream]:
        """Optional local search over the greedy device set."""
        return chosen

    def resume_by_load(self, stream: Stream, t_io: float, t_recompute: float, view: SchedulerView) -> bool:
        """Whether a paused stream with a host copy comes back by loading it (else by recompute), given the
        queue-aware reload time and the recompute time (paper §4.2.3: the sooner of the two)."""
        return t_io <= t_recompute

    def on_preempt(self, stream: Stream, view: SchedulerView) -> None:  # noqa: B027 - optional hook
        """Bookkeeping hook (preemption caps)."""


# A stream's (arrival_time, stream_id), made in C: every policy sorts every live stream by it every step.
arrival_key = operator.attrgetter("arrival_time", "stream_id")


def waited_s(s: Stream, now: float) -> float:
    """How long a stream has been kept off the device (0 while it runs)."""
    if s.status in (StreamStatus.RUNNING, StreamStatus.LOADING):
        return 0.0
    since = s.last_preempted_at if s.num_preemptions else s.arrival_time
    return max(0.0, now - since)
