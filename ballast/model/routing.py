"""Serve request routing that honours a replica's readiness ("stop taking new work").

A replica whose watchdog has switched intake off, or that is draining for a recycle,
says ``{"ready": False}`` from its ``record_routing_stats()``; Serve polls that every
``request_routing_stats_period_s`` and hands it to the request router of every
handle (the Ballast router's handles to the model deployments). This router is
Serve's power-of-two-choices router with one change: replicas that are not ready
are left out while at least one ready replica remains. If none is ready, it routes
as usual — a fleet of tired replicas still answers rather than refusing everything.

Custom request routers are alpha in Ray Serve 2.60; the base class is imported from
the same path Serve's default uses, and ray is pinned in constraints.txt.
"""

from __future__ import annotations

import random
from typing import Any, List, Optional

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

ROUTER_PATH = "ballast.model.routing:ReadinessAwareRouter"


def is_ready(routing_stats: Optional[dict[str, Any]]) -> bool:
    """A replica is ready unless it said otherwise (no stats yet means ready)."""
    return (routing_stats or {}).get("ready", True) is not False


class ReadinessAwareRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas: List[Any], pending_request: Any = None) -> List[List[Any]]:
        ready = [r for r in candidate_replicas if is_ready(r.routing_stats)]
        if not ready or len(ready) == len(candidate_replicas):
            return await super().choose_replicas(candidate_replicas, pending_request)
        # Two random ready candidates; Serve then probes both and takes the shorter queue.
        return [random.sample(ready, min(2, len(ready)))]


def request_router_config(stats_period_s: float) -> Any:
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(
        request_router_class=ROUTER_PATH,
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=max(1.0, 3 * stats_period_s),
    )
