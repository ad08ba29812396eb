"""What the client is told when a replica's stream fails: a short OpenAI-shaped error, never Ray's internals.

Ray's actor errors carry the dead actor's id, pid, node IP, name and namespace in their str(); a client gets a
generic message with the stream id to quote, and the full exception goes to the server log (ingress.py). A replica
that died (killed, OOM, node lost) is retryable: 503 `replica_unavailable` with Retry-After, since Serve routes the
retry to a live replica or to the one it restarts. A server that is stopping (`tokenflow serve` got SIGTERM or
Ctrl-C) ends its streams with `ServerStopping`: 503 `server_shutting_down`. Anything else is a bug: 500
`internal_error`.
"""

from __future__ import annotations

from ray.exceptions import LocalRayletDiedError, NodeDiedError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from tokenflow_ray.serve.http.protocol import APIError

# RayActorError covers ActorDiedError (killed, crashed, its node died) and ActorUnavailableError (unreachable for
# now). The Serve errors: the router's chosen replica is gone, or the deployment has none that deployed.
REPLICA_GONE: tuple[type[BaseException], ...] = (RayActorError, WorkerCrashedError, NodeDiedError,
                                                 LocalRayletDiedError, ReplicaUnavailableError,
                                                 DeploymentUnavailableError)
RETRY_AFTER_S = 1  # a retry goes to a live replica at once; with none, Serve restarts one (seconds)
REPLICA_MESSAGE = "the replica serving this stream failed; retry the request"
INTERNAL_MESSAGE = "the server failed while serving this stream"
STOPPING_MESSAGE = "the server is shutting down; retry the request on another server"


class ServerStopping(Exception):
    """Raised in a replica's streams (and for new ones) once the server is stopping (serve/replica/stopping.py)."""

    def __init__(self, reason: str = "shutting down") -> None:
        super().__init__(reason)  # the only arg: the exception pickles across actors
        self.reason = reason


def stopping_error(stream_id: str | None = None) -> APIError:
    where = f" (request id {stream_id})" if stream_id else ""
    return APIError(503, STOPPING_MESSAGE + where, code="server_shutting_down", retry_after_s=RETRY_AFTER_S)


def _chain(exc: BaseException, depth: int = 8):
    """exc, then what it wraps: RayTaskError's `.cause`, `__cause__`, `__context__` (bounded, no cycles)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo and len(seen) < depth:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(c for c in (getattr(e, "cause", None), e.__cause__, e.__context__)
                    if isinstance(c, BaseException))


def replica_gone(exc: BaseException) -> bool:
    """True if exc, or an exception it wraps, says the replica (its actor, worker or node) is gone."""
    return any(isinstance(e, REPLICA_GONE) for e in _chain(exc))


def stream_failure(exc: BaseException, stream_id: str) -> APIError:
    """The client's view of a failed stream: 503 replica_unavailable or server_shutting_down (retryable), or 500
    internal_error."""
    if any(isinstance(e, ServerStopping) for e in _chain(exc)):
        return stopping_error(stream_id)
    if replica_gone(exc):
        return APIError(503, f"{REPLICA_MESSAGE} (request id {stream_id})", code="replica_unavailable",
                        retry_after_s=RETRY_AFTER_S)
    return APIError(500, f"{INTERNAL_MESSAGE} (request id {stream_id})", code="internal_error")
