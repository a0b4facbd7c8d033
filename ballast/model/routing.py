"""Serve request routing: a replica's readiness first, then what it holds, bounded by load.

**Readiness.** A replica whose watchdog has switched intake off, or that is draining for
a recycle, says ``{"ready": False}`` from its ``record_routing_stats()``; Serve polls
that every ``request_routing_stats_period_s`` and hands it to the request router of every
handle (the Ballast router's handles to the model deployments). Replicas that are not
ready are left out while at least one ready replica remains. If none is ready, it routes
as usual: a fleet of tired replicas still answers rather than refusing everything.

**Silence and avoidance.** Every replica's stats carry a heartbeat (``"beat"``, the
instant of the poll). A replica whose heartbeat has stood still longer than
``silent_after_s`` while another replica's moved is silent (``ballast.policies.hedge.
Heartbeats``): it is left out like a replica that is not ready. A call may name replicas to
pass over (``ModelCall.avoid``: a hedge's, or a re-send's after a silent attempt), left out
while another remains, and the replicas on their nodes too while one elsewhere remains.
The replica each request goes to is noted by its Serve request id
(``ballast.model.routing_state.placed``), for the caller to hedge elsewhere or ask whether
it went silent. Those tables live in ``routing_state``: Serve ships this module to the
handles by value, so a table here would be a copy the caller never sees.

**Prompt prefixes.** A vLLM replica with prefix caching reports the blocks its KV cache
holds (``ballast.policies.prefix_cache.PrefixReport`` under ``"prefix"``, from vLLM's own
KV-cache events, ``ballast.model.kv_events``). Serve broadcasts every replica's stats to
every handle, so every router replica scores from the same view. For a call (the
``ModelCall`` that is the request's one positional argument), the router keys its
prompt's blocks (adapter included), counts how many leading blocks each ready replica
holds, and ranks them with ``ballast.policies.affinity.rank_by_prefix``: within the load
bound, the one holding the most; a prompt no replica holds goes to its home (rendezvous
hashing on its first block no replica holds, the same choice on every router). The
call's ``route`` bounds it: "least_loaded" (critical_plus) chooses among the least
loaded only; "balance" (the model's level at or past ``balance_from_level``) skips it.

**Adapter affinity.** A replica of an engine with LoRA slots also reports its adapters
(``ballast.policies.holdings.AdapterReport`` under ``"adapters"``: the ones it ran most
recently, as many as its slots, and its recent adapter calls). A call naming an adapter
whose prompt no replica holds yet is ranked by ``ballast.policies.affinity.rank`` (a
holder within the load bound, else the replica where loading it evicts the least
demanded adapter, within the bound), with the demand summed over the reports.

A report past its bounds (``AdapterReport.problem``: too many names, a name longer than an
adapter's) is refused whole, and a router logs the first refusal of each replica; a stamp
ahead of the router's clock is clamped to it where the router first sees it
(``ballast.policies.holdings.SeenStamps``), so a report that stops changing goes stale
however far ahead it was stamped.

Serve then takes the first rank whose replica is not full, so a full choice gives way to
the next; the replica chosen for a request serves that request (matched by its id, not
handed to the oldest waiting request as Serve's FIFO matching would).

The loads are Serve's queue-length cache (``replica_queue_len_cache``): each replica's
ongoing requests as this router last heard them (from a probe, or from the replica's
answer to a request), raised by one at each request this router sends and lowered at
each completion, forgotten after ``RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S``. It is fresher
than anything in the routing stats (polled every period, and blind to this router's own
sends since), and it is what Serve's power-of-two choice itself compares.

**Falls back to power of two** (today's behaviour) for a call with nothing to go by (no
prefix report, a prompt shorter than a block, no adapter), at "balance", and when any
ready replica's view is missing: no report (an engine without them, or a replica not
polled yet), a malformed or stale one (``at_s`` older than ``MAX_REPORT_AGE_S`` on this
router's clock: a replica no longer answering its stats poll, whose last answer Serve
keeps), or no cached load (the cache off, as it is under Ray Client, or expired). Power
of two probes the replicas, which refills the cache. A stale view thus routes by load; it
never refuses. Each decision is counted in ``ballast_route_decisions_total{model, reason}``.

Custom request routers are alpha in Ray Serve 2.60; the base classes are imported from
the same paths Serve's default uses, and ray is pinned in constraints.txt.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.request_router import RequestRouter

from ballast.model.protocol import ModelCall
from ballast.model.routing_state import count_routed, note_beats, note_placed, silent_replicas
from ballast.policies.affinity import (
    AffinityConfig,
    PrefixView,
    ReplicaView,
    rank,
    rank_by_prefix,
)
from ballast.policies.holdings import AdapterHoldings, AdapterReport, SeenStamps, fleet_demand
from ballast.policies.prefix_cache import PrefixReport, block_keys, home_score, matched_blocks

log = logging.getLogger(__name__)

ROUTER_PATH = "ballast.model.routing:ReadinessAwareRouter"
#: A report stamped longer ago than this (three of the replicas' 5 s stamps) is stale.
MAX_REPORT_AGE_S = 15.0
#: The most replicas' decoded prefix reports a router keeps (past it, it starts over); the
#: same bound for the adapter reports' stamps and the replicas whose refused report was logged.
MAX_DECODED = 1024


#: The default of ``resilience.hedge.silent_after_s`` (a router's config sets its own).
SILENT_AFTER_S = 4.0


def is_ready(routing_stats: dict[str, Any] | None) -> bool:
    """A replica is ready unless it said otherwise (no stats yet means ready)."""
    return (routing_stats or {}).get("ready", True) is not False


def replica_routing_stats(
    ready: bool, holdings: AdapterHoldings | None, now_s: float, prefixes: PrefixReport | None = None
) -> dict[str, Any]:
    """What a replica returns from ``record_routing_stats``: its readiness and heartbeat (the
    instant of this poll: a stamp that stops moving says the replica went silent), with adapter
    slots its adapters as of ``now_s`` (wall clock, as the routers read it), and with a
    prefix report the blocks its engine's prefix cache holds."""
    stats: dict[str, Any] = {"ready": ready, "beat": now_s}
    if holdings is not None and holdings.slots > 0:
        stats["adapters"] = holdings.report(now_s).as_stats()
    if prefixes is not None:
        stats["prefix"] = prefixes.as_stats()
    return stats


def call_of(pending_request: Any) -> ModelCall | None:
    """The request's ``ModelCall`` (its one positional argument); None for any other request."""
    args = getattr(pending_request, "args", None) or ()
    call = args[0] if args else None
    return call if isinstance(call, ModelCall) else None


def adapter_of(pending_request: Any) -> str | None:
    """The adapter the request's ``ModelCall`` names; None for any other request."""
    call = call_of(pending_request)
    return call.adapter if call is not None and call.adapter else None


class ReadinessAwareRouter(PowerOfTwoChoicesRequestRouter):
    affinity = AffinityConfig()
    prefix_affinity = True
    model = ""
    max_report_age_s = MAX_REPORT_AGE_S
    silent_after_s = SILENT_AFTER_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # Ray's __init__ is unannotated
        self._decoded: dict[str, PrefixReport] = {}  # replica id -> its last report, decoded once
        self._adapter_stamps = SeenStamps(MAX_DECODED)  # replica id -> its adapter report's stamp, clamped
        self._refusals_logged: set[str] = set()  # replica ids whose refused adapter report was logged
        self._decisions: RouteCounter | None = None  # made by initialize_state

    def initialize_state(self, **kwargs: Any) -> None:
        """The model's routing settings (``request_router_config``'s kwargs); Serve calls it
        once, after ``__init__``."""
        self.model = str(kwargs.get("model", ""))
        self.prefix_affinity = bool(kwargs.get("prefix_affinity", True))
        self.silent_after_s = float(kwargs.get("silent_after_s", SILENT_AFTER_S))
        bound = {k: kwargs[k] for k in ("load_bound_ratio", "min_slack") if k in kwargs}
        self.affinity = AffinityConfig(**bound)
        self._decisions = RouteCounter(self.model)

    def _fulfill_next_pending_request(self, replica: Any, request_metadata: Any = None) -> None:
        # The replica chosen for a request serves that request (Serve's base matching, by
        # request id), not the oldest waiting one (FIFOMixin's): a choice made for what a
        # request's prompt needs is worth nothing to another request.
        # The replica it goes to is noted first, by the attempt's id (``placed``): the
        # caller reads it to send a hedge elsewhere, or to ask whether that one went silent.
        if request_metadata is not None and self._get_pending_request_matching_internal_request_id(request_metadata):
            note_placed(request_metadata.internal_request_id, replica.replica_id.unique_id)
        RequestRouter._fulfill_next_pending_request(self, replica, request_metadata)

    def update_replicas(self, replicas: list[Any]) -> None:
        # Serve hands over the replicas whenever one's routing stats change: each poll's
        # heartbeat ("beat") is seen here, on this process's clock.
        super().update_replicas(replicas)
        note_beats(self.model, replicas, self._get_curr_time_s())

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        call = call_of(pending_request)
        ready = self._ready(candidate_replicas, call.avoid if call is not None else ())
        if call is not None and ready and call.route != "balance":
            ranked = await self._by_what_they_hold(ready, call)
            if ranked is not None:
                return ranked
        self._count("balance")
        if not ready or len(ready) == len(candidate_replicas):
            return await super().choose_replicas(candidate_replicas, pending_request)
        # Two random ready candidates; Serve then probes both and takes the shorter queue.
        return [random.sample(ready, min(2, len(ready)))]

    def _ready(self, candidates: list[Any], avoid: tuple[str, ...]) -> list[Any]:
        """The candidates that are ready and not silent; for a call that avoids replicas, those
        on other nodes than theirs first (what silenced one replica, a partition or a stalled
        host, often silenced its node), then any other replica, then all."""
        silent = silent_replicas(self.model, self.silent_after_s, self._get_curr_time_s())
        ready = [r for r in candidates if is_ready(r.routing_stats) and r.replica_id.unique_id not in silent]
        if not avoid:
            return ready
        nodes = {r.node_id for r in candidates if r.replica_id.unique_id in avoid and r.node_id}
        others = [r for r in ready if r.replica_id.unique_id not in avoid]
        return [r for r in others if r.node_id not in nodes] or others or ready

    async def _by_what_they_hold(self, ready: list[Any], call: ModelCall) -> list[list[Any]] | None:
        """The prompt's blocks first; a prompt no replica holds yet goes where its adapter
        is (a call naming one), else to its home; None when a view is missing."""
        by_prefix = await self._rank_by_prefix(ready, call) if self.prefix_affinity else None
        if by_prefix is not None and (by_prefix[0] == "prefix" or call.adapter is None):
            self._count(by_prefix[0])
            return by_prefix[1]
        by_adapter = await self._rank_for_adapter(ready, call.adapter) if call.adapter else None
        if by_adapter is not None:
            self._count("adapter")
            return by_adapter
        if by_prefix is not None:
            self._count(by_prefix[0])
            return by_prefix[1]
        return None

    def _count(self, reason: str) -> None:
        if self._decisions is not None:
            self._decisions.inc(reason)

    async def _loads(self, ready: list[Any]) -> dict[str, int] | None:
        """Each ready replica's requests in flight, by id, from Serve's queue-length cache;
        the replicas the cache has no fresh entry for are probed first (affinity sends a
        replica nothing for a while, and its entry expires). None when one does not answer."""
        cache = self.replica_queue_len_cache
        missing = [r for r in ready if cache.get(r.replica_id) is None]
        if missing:
            await self._probe_queue_lens(missing, 0)  # fills the cache with the answers
        loads: dict[str, int] = {}
        for r in ready:
            load = cache.get(r.replica_id)
            if load is None:
                return None
            loads[r.replica_id.unique_id] = load
        return loads

    async def _views(self, ready: list[Any]) -> list[tuple[Any, int, PrefixReport]] | None:
        """(replica, load, prefix report) for every ready replica, random order (random
        ties); None when one has no fresh report or no load."""
        now_s = self._get_curr_time_s()  # RequestRouter's clock (its get_curr_time_s argument)
        got = {r.replica_id.unique_id: self._prefix_report_of(r) for r in ready}
        reports = {
            rid: rep for rid, rep in got.items() if rep is not None and rep.is_fresh(now_s, self.max_report_age_s)
        }
        if len(reports) < len(got):
            return None
        loads = await self._loads(ready)
        if loads is None:
            return None
        return [
            (r, loads[r.replica_id.unique_id], reports[r.replica_id.unique_id])
            for r in random.sample(ready, len(ready))
        ]

    def _prefix_report_of(self, replica: Any) -> PrefixReport | None:
        """The replica's prefix report, decoded once per report (by its stamp)."""
        stats = (replica.routing_stats or {}).get("prefix")
        rid = replica.replica_id.unique_id
        known = self._decoded.get(rid)
        if known is not None and isinstance(stats, dict) and stats.get("at_s") == known.at_s:
            return known
        report = PrefixReport.of(stats)
        if report is None:
            self._decoded.pop(rid, None)
            return None
        if len(self._decoded) >= MAX_DECODED:  # replicas that left: forget them all, refill
            self._decoded.clear()
        self._decoded[rid] = report
        return report

    async def _rank_by_prefix(self, ready: list[Any], call: ModelCall) -> tuple[str, list[list[Any]]] | None:
        """(reason, Serve's ranks) by the prompt blocks each ready replica holds
        (``affinity.rank_by_prefix``); None when a view is missing, the replicas' block
        sizes differ, or the prompt is shorter than one block."""
        views = await self._views(ready)
        if views is None or len({report.block_size for _, _, report in views}) != 1:
            return None
        keys = block_keys(call.prompt_ids, views[0][2].block_size, call.adapter, call.cache_salt)
        if not keys:
            return None
        matched = {r.replica_id.unique_id: matched_blocks(keys, report.keys) for r, _, report in views}
        home_key = keys[min(max(matched.values()), len(keys) - 1)]  # the first block no replica holds
        prefix_views = [
            PrefixView(rid, load, matched[rid], home_score(home_key, rid))
            for rid, load in ((r.replica_id.unique_id, load) for r, load, _ in views)
        ]
        choice, order = rank_by_prefix(prefix_views, self.affinity, least_loaded=call.route == "least_loaded")
        by_id = {r.replica_id.unique_id: r for r, _, _ in views}
        ranked = [[by_id[order[0]]], [by_id[rid] for rid in order[1:]]]
        return choice.reason, [group for group in ranked if group]

    async def _rank_for_adapter(self, ready: list[Any], adapter: str) -> list[list[Any]] | None:
        """The ready replicas by adapter affinity, as Serve's ranks; None when a view is missing."""
        now_s = self._get_curr_time_s()
        views, reports, by_id = [], {}, {}
        for r in random.sample(ready, len(ready)):  # random ties
            report = self._adapter_report_of(r, now_s)
            if report is None or not report.is_fresh(now_s, self.max_report_age_s):
                return None
            rid = r.replica_id.unique_id
            reports[rid], by_id[rid] = report, r
        loads = await self._loads(ready)
        if loads is None:
            return None
        for rid, report in reports.items():
            views.append(ReplicaView(rid, loads[rid], report.held, report.slots))
        order = rank(views, adapter, self.affinity, fleet_demand(reports))
        ranked = [[by_id[order[0]]], [by_id[rid] for rid in order[1:]]]
        return [group for group in ranked if group]

    def _adapter_report_of(self, replica: Any, now_s: float) -> AdapterReport | None:
        """The replica's adapter report with its stamp as this router takes it (clamped to
        ``now_s`` when first seen); None when it sent none or it is refused (the first refusal
        of each replica logged, with why)."""
        stats = (replica.routing_stats or {}).get("adapters")
        rid = replica.replica_id.unique_id
        report = AdapterReport.of(stats)
        if report is None:
            if stats is not None and rid not in self._refusals_logged:
                if len(self._refusals_logged) >= MAX_DECODED:  # replicas that left: start over
                    self._refusals_logged.clear()
                self._refusals_logged.add(rid)
                log.warning(
                    "replica %s's adapter report refused (%s): adapter affinity is off while it is",
                    rid,
                    AdapterReport.problem(stats),
                )
            return None
        return replace(report, at_s=self._adapter_stamps.taken(rid, report.at_s, now_s))


class RouteCounter:
    """``ballast_route_decisions_total{model, reason}``: how each request was placed (and
    the same counts for ``routed_so_far``)."""

    def __init__(self, model: str) -> None:
        from ray.util import metrics

        self._model = model
        self.counts: dict[str, int] = {}  # this router's decisions by reason (its own view)
        self._counter = metrics.Counter(
            "ballast_route_decisions_total",
            "Requests routed to a model replica, by why that one: prefix (it holds the start of the "
            "prompt), home (a prompt no replica holds, to its home), adapter (where its adapter is or "
            "loads best), balance (by load alone).",
            tag_keys=("model", "reason"),
        )

    def inc(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        count_routed(self._model, reason)
        try:
            self._counter.inc(1, tags={"model": self._model, "reason": reason})
        except Exception as e:  # a metric must never fail a routing decision
            log.debug("route decision metric not recorded: %r", e)


def request_router_config(
    stats_period_s: float, routing: Any = None, model: str = "", silent_after_s: float = SILENT_AFTER_S
) -> Any:
    """Serve's router config for a model deployment: this router, the replicas' stats polled
    every ``stats_period_s``, the model's ``RoutingSettings`` (None: the defaults), and how
    long a replica's heartbeat may stand still before it is silent."""
    from ballast.model.untyped import ray_serve

    kwargs: dict[str, Any] = {"model": model, "silent_after_s": silent_after_s}
    if routing is not None:
        kwargs.update(
            prefix_affinity=routing.prefix_affinity,
            load_bound_ratio=routing.load_bound_ratio,
            min_slack=routing.min_slack,
        )
    return ray_serve("config").RequestRouterConfig(
        request_router_class=ROUTER_PATH,
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=max(1.0, 3 * stats_period_s),
    )
