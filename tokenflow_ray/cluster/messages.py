"""Plain dataclasses that cross the ingress -> replica -> central actor boundaries (pickled by Ray): every message
between the serving processes, in one module (SGLang's io_struct.py idea). Who sends which: docs/design.md §8.1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenflow_ray.engine.sampling import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    stream_id: str  # chosen by the ingress: it is the OpenAI completion id and the consumption-report key
    sampling: SamplingParams
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, text): the replica applies the chat template
    rate: float = 0.0  # declared consumption rate, tokens/s: the request's, or the server's default_rate (ingress)


@dataclass(frozen=True)
class Delta:
    """Tokens since the previous delta of one stream (several engine steps when grouped)."""

    text: str
    num_new_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    finished: bool = False
    finish_reason: str | None = None
    # Set on the last delta from a replica the stream moved away from, for a caller that follows it (the ingress):
    # the new replica's StreamPort, where the rest of the stream is pulled (stream_port.follow).
    moved_to: Any = None
    num_cached_tokens: int = 0  # prompt tokens prefix caching served (the usage's prompt_tokens_details)


@dataclass(frozen=True)
class Report:
    stream_id: str
    consumed_tokens: int | None = None
    rate: float | None = None
    paused: bool | None = None


@dataclass(frozen=True)
class MoveOrder:
    """The central actor asks a replica to move one of its streams to another replica (migration)."""

    stream_id: str
    target_replica_id: str
    target_port: object  # the target's StreamPort actor handle
    reason: str = "requested"


@dataclass(frozen=True)
class RelieveOrder:
    """The central actor asks an overloaded replica to move paused streams worth `rate` tokens/s of declared
    demand (at most `max_streams`) to the target; the replica picks which (cluster/migration_policy.py)."""

    target_replica_id: str
    target_port: object
    rate: float
    max_streams: int
    reason: str = "overloaded"
    include_waiting: bool = False  # streams waiting to start may go too (MigrationSettings.move_waiting)


@dataclass(frozen=True)
class StopOrder:
    """The central actor tells a replica the app is stopping: refuse new streams, end live ones (serve/replica/stopping.py)."""

    reason: str = "shutting down"
