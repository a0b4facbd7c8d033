"""Serve request routing: a replica's readiness first, then the adapters it holds, bounded by load.

**Readiness.** A replica whose watchdog has switched intake off, or that is draining for
a recycle, says ``{"ready": False}`` from its ``record_routing_stats()``; Serve polls
that every ``request_routing_stats_period_s`` and hands it to the request router of every
handle (the Ballast router's handles to the model deployments). Replicas that are not
ready are left out while at least one ready replica remains. If none is ready, it routes
as usual: a fleet of tired replicas still answers rather than refusing everything.

**Adapter affinity.** A replica of an engine with LoRA slots also reports its adapters
(``replica_routing_stats``: ``ballast.policies.holdings.AdapterReport`` under
``"adapters"``: the ones it ran most recently, as many as its slots, and its recent
adapter calls). For a call naming an adapter (the ``ModelCall`` that is the request's one
positional argument), ``choose_replicas`` ranks the ready replicas with
``ballast.policies.affinity.rank`` (a holder within the load bound, else the replica
where loading it evicts the least demanded adapter, within the bound; the rest least
loaded after it), with the demand summed over the reports. Serve then takes the first
rank whose replica is not full, so a full holder gives way to the next.

The loads are Serve's queue-length cache (``replica_queue_len_cache``): each replica's
ongoing requests as this router last heard them (from a probe, or from the replica's
answer to a request), raised by one at each request this router sends and lowered at
each completion, forgotten after ``RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S``. It is fresher
than anything in the routing stats (polled every period, and blind to this router's own
sends since), and it is what Serve's power-of-two choice itself compares.

**Falls back to power of two** (today's behaviour) for a call without an adapter, and
when any ready replica's view is missing: no adapter report (an engine without slots,
or a replica not polled yet), a malformed or stale one (``at_s`` older than
``MAX_REPORT_AGE_S`` on this router's clock: a replica no longer answering its stats poll,
whose last answer Serve keeps), or no cached load (the cache off, as it is under Ray
Client, or expired). Power of two probes the replicas, which refills the cache.

One limit is Serve's: its FIFO matching hands the replica chosen for one request to the
oldest request waiting on this router, so under a backlog a replica chosen for one
adapter may serve another.

Custom request routers are alpha in Ray Serve 2.60; the base class is imported from
the same path Serve's default uses, and ray is pinned in constraints.txt.
"""

from __future__ import annotations

import random
from typing import Any, List, Optional

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

from ballast.model.protocol import ModelCall
from ballast.policies.affinity import AffinityConfig, ReplicaView, rank
from ballast.policies.holdings import AdapterHoldings, AdapterReport, fleet_demand

ROUTER_PATH = "ballast.model.routing:ReadinessAwareRouter"
#: A report stamped longer ago than this (three of the replicas' 5 s stamps) is stale.
MAX_REPORT_AGE_S = 15.0


def is_ready(routing_stats: Optional[dict[str, Any]]) -> bool:
    """A replica is ready unless it said otherwise (no stats yet means ready)."""
    return (routing_stats or {}).get("ready", True) is not False


def replica_routing_stats(ready: bool, holdings: Optional[AdapterHoldings], now_s: float) -> dict[str, Any]:
    """What a replica returns from ``record_routing_stats``: its readiness and, with
    adapter slots, its adapters as of ``now_s`` (wall clock, as the routers read it)."""
    stats: dict[str, Any] = {"ready": ready}
    if holdings is not None and holdings.slots > 0:
        stats["adapters"] = holdings.report(now_s).as_stats()
    return stats


def adapter_of(pending_request: Any) -> Optional[str]:
    """The adapter the request's ``ModelCall`` names; None for any other request."""
    args = getattr(pending_request, "args", None) or ()
    call = args[0] if args else None
    return call.adapter if isinstance(call, ModelCall) and call.adapter else None


class ReadinessAwareRouter(PowerOfTwoChoicesRequestRouter):
    affinity = AffinityConfig()
    max_report_age_s = MAX_REPORT_AGE_S

    async def choose_replicas(self, candidate_replicas: List[Any], pending_request: Any = None) -> List[List[Any]]:
        ready = [r for r in candidate_replicas if is_ready(r.routing_stats)]
        adapter = adapter_of(pending_request)
        if adapter is not None and ready:
            ranked = self._rank_for_adapter(ready, adapter)
            if ranked is not None:
                return ranked
        if not ready or len(ready) == len(candidate_replicas):
            return await super().choose_replicas(candidate_replicas, pending_request)
        # Two random ready candidates; Serve then probes both and takes the shorter queue.
        return [random.sample(ready, min(2, len(ready)))]

    def _rank_for_adapter(self, ready: List[Any], adapter: str) -> Optional[List[List[Any]]]:
        """The ready replicas by affinity, as Serve's ranks; None when a view is missing."""
        now_s = self._get_curr_time_s()  # RequestRouter's clock (its get_curr_time_s argument)
        cache = self.replica_queue_len_cache
        views, reports, by_id = [], {}, {}
        for r in random.sample(ready, len(ready)):  # random ties
            report = AdapterReport.of((r.routing_stats or {}).get("adapters"))
            load = cache.get(r.replica_id)
            if report is None or load is None or not report.is_fresh(now_s, self.max_report_age_s):
                return None
            rid = r.replica_id.unique_id
            views.append(ReplicaView(rid, load, report.held, report.slots))
            reports[rid], by_id[rid] = report, r
        order = rank(views, adapter, self.affinity, fleet_demand(reports))
        ranked = [[by_id[order[0]]], [by_id[rid] for rid in order[1:]]]
        return [group for group in ranked if group]


def request_router_config(stats_period_s: float) -> Any:
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(
        request_router_class=ROUTER_PATH,
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=max(1.0, 3 * stats_period_s),
    )
