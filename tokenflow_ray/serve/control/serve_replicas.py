"""Which replicas Serve is stopping: the one signal a scale-down gives before the replica's graceful shutdown.

Serve picks the replica to stop itself and calls no user code when its drain begins (ray 2.60: the replica's
`perform_graceful_shutdown` waits for its ongoing requests, then calls `__del__`). The controller's instance
details, the data behind Serve's REST API (`GET /api/serve/applications/`, `serve status`), list each replica's
state, STOPPING among them; the central actor polls them to drain such a replica by migration (central.py).
They are read from the controller actor directly: the REST API needs the dashboard, which a small cluster may
run without. The package pins ray, so these names are the ones it ships.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray

STOPPING = "STOPPING"


def replicas_in_state(details: Mapping[str, Any], state: str = STOPPING) -> set[str]:
    """Replica ids in `state` across every application and deployment of the instance details."""
    out: set[str] = set()
    for app in (details.get("applications") or {}).values():
        for dep in (app.get("deployments") or {}).values():
            for rep in dep.get("replicas") or ():
                if str(rep.get("state")) == state or getattr(rep.get("state"), "value", None) == state:
                    out.add(rep["replica_id"])
    return out


async def stopping_replicas() -> set[str]:
    """Ids of the replicas Serve is stopping now (none if Serve is not running)."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return set()
    return replicas_in_state(await controller.get_serve_instance_details.remote())
