"""The data contract between scheduler and model runner: one StepPlan in, one StepResult back.

Only plain frozen dataclasses and NamedTuples, so a plan can cross a process or actor boundary unchanged.
The contract in words: docs/design.md §5.2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from tokenflow_ray.engine.sampling import SamplingParams

# A decode's input token that is not known when the step is planned: the token this stream's previous step
# samples (overlapped scheduling plans step N+1 while step N runs). The runner substitutes it.
PENDING_TOKEN = -1


class ScheduledChunk(NamedTuple):
    """Feed token_ids at positions [start_pos, start_pos + len) of one stream, writing their KV into its blocks.

    The runner keeps every scheduled stream's device block table (persistent step state, as in vLLM's persistent
    batch); a chunk carries only the change: the blocks appended since the runner last saw the stream, starting at
    table index `first_block`. first_block == 0 starts the table afresh (a new, resumed or recomputed stream).
    The runner drops a table when its stream is in the plan's `finished` or `preempted`.

    A NamedTuple, not a frozen dataclass: one is made per running stream per step, and a frozen dataclass's
    __init__ (a guarded setattr per field) cost 4x as much. Immutable and picklable all the same.
    """

    stream_id: str
    token_ids: tuple[int, ...]  # PENDING_TOKEN for a decode whose input is still being sampled
    start_pos: int
    new_blocks: tuple[int, ...]
    first_block: int
    sample: bool  # the chunk reaches the stream's last token, so a next token is sampled


class BlockCopy(NamedTuple):
    """Copy one KV block (every layer, K and V) between the device pool and the host spill store.

    A NamedTuple like ScheduledChunk: tens are made a step under a policy that uses the host store, and a frozen
    dataclass's __init__ cost 5x as much. Immutable and picklable all the same."""

    stream_id: str
    device_block: int
    host_block: int


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    decodes: tuple[ScheduledChunk, ...] = ()  # one token each
    prefills: tuple[ScheduledChunk, ...] = ()  # prompt (or recompute) chunks
    preempted: tuple[str, ...] = ()  # streams whose device blocks were freed this step (KV to be recomputed)
    finished: tuple[str, ...] = ()  # streams that ended since the last plan: the runner drops their state
    new_streams: tuple[tuple[str, SamplingParams], ...] = ()  # first time scheduled: sent once, kept by the runner
    # Copies run beside the model step and are complete when the step's result comes back. Blocks they read are
    # never written this step (full blocks are immutable; a preempted stream's tail is freed only afterwards).
    write_through: tuple[BlockCopy, ...] = ()  # device -> host, full blocks of running streams
    swap_out: tuple[BlockCopy, ...] = ()  # device -> host, the unsynced tail of streams preempted this step
    swap_in: tuple[BlockCopy, ...] = ()  # host -> device, streams resumed by load (LOADING this step)

    @property
    def has_copies(self) -> bool:
        return bool(self.write_through or self.swap_out or self.swap_in)
    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(len(c.token_ids) for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.has_copies


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled: dict[str, int] = field(default_factory=dict)  # stream id -> next token, for chunks with sample=True
    compute_s: float = 0.0  # the model step alone
    copy_s: float = 0.0  # the copy job alone (runs beside the model step when overlapped)
    copy_bytes: int = 0
    # Preempted stream -> seconds from the step's start until its swap-out tail was on the host.
    swap_out_s: dict[str, float] = field(default_factory=dict)
    step_s: float = 0.0  # the whole execute call
