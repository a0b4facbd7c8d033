"""The router's side of the control loop: its report to the controller each interval,
and what it applies from the controller's answers.

Out, once per report interval, whether or not the controller answers: a
``RouterReport`` (tally.py's counts since the last one, the gate's line, demand by class
against the gate's answer rate, each tenant's token demand). Gauges are re-set each
interval, not only on change: a series Ray has not seen updated for a while may stop
being exported.

In: a snapshot (the kill switches, the run-time adapters (as the pipeline's catalog) and
the gate's ceiling go to the pipeline, the level to the edge at once) and a reply (quota
leases for this router).

The edge (HAProxy's map of refused classes, edge.py) follows the levels this router acts
on, a snapshot's or fail-static's, for the models HAProxy can tell: with one model, that
model's (the "<class>" entries); with several, each model in the edge's models map (the
names every tenant may use), keyed "<model>:<class>", and nothing for the others. Its
refusals of keys it vouches for (its key map: the API keys of the tenants that may use a
model it judges, less those a kill switch turns off) count as demand that model's level
turned away, and only for a model the models map names; its throttle of the admitted
classes learns from the gate's decisions per class and those refusals. A refusal of a
class a kill switch turns off is not counted (the router would refuse it as switched
off, not as demand), nor is any while a global one is on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ballast.control.snapshot import Snapshot
from ballast.model.routing_state import routed_so_far
from ballast.names import ROUTER_DEPLOYMENT
from ballast.policies import engines, killswitch
from ballast.policies.criticality import Criticality
from ballast.policies.edge import EdgeThrottle
from ballast.policies.fairness import TenantCounters
from ballast.policies.gate import DemandWindow
from ballast.policies.reports import ModelLoad, RouterReport
from ballast.router.adapters import runtime_catalog
from ballast.router.auth import KeyStore
from ballast.router.edge import Edge, key_entries, model_entries, model_shed_entries, shed_entries, split_key
from ballast.router.lanes import Lane
from ballast.router.pipeline import Pipeline

log = logging.getLogger("ballast.router")


def model_ceiling(cfg: Any, snap: Snapshot, model: str, share: float | None = None) -> int | None:
    """The ceiling of the gate to ``model`` from a snapshot (and this router's fair share of
    the model, when the controller gave one): ballast/policies/engines.py's ``model_ceiling``."""
    state = snap.models.get(model)
    rows = state.engine_rows if state is not None else None
    return engines.model_ceiling(
        snap.running_replicas.get(cfg.deployment_name(model), 0),
        snap.running_replicas.get(ROUTER_DEPLOYMENT, 0),
        cfg.deployment_of(model).max_ongoing_requests,
        share,
        rows if rows is not None and rows > 0 else None,
    )


class Reporter:
    """Builds this router's reports; applies snapshots and replies."""

    def __init__(
        self,
        cfg: Any,
        router_id: str,
        pipeline: Pipeline,
        edge: Edge | None,
        keys: KeyStore | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = cfg
        self._keys = keys  # the API keys the edge may vouch for (none: it counts no refusal)
        # The edge's key map and what it was built from: (tenants off, models the edge judges, catalog)
        self._vouched_map: dict[str, str] = {}
        self._vouched_of: tuple[frozenset[str], frozenset[str], Any] | None = None
        self._clock = clock
        self._router_id = router_id
        self._pipeline = pipeline
        # What it reports is what the pipeline counts and acts on: its snapshots, lanes, metrics.
        self._cache = pipeline.snapshots
        self._metrics = pipeline.metrics
        self.edge = edge  # HAProxy refuses the classes the level sheds, when it runs the edge's rules
        # Per model: the edge's share to refuse of the classes its level admits.
        self._edge_throttles = {name: EdgeThrottle() for name in pipeline.lanes}
        # Per model: the demand against its gate's answers, and the gate's (served,
        # saturations) at the last report.
        self._demand = {name: DemandWindow(cfg.degradation.demand_window_s) for name in pipeline.lanes}
        self._gate_seen = dict.fromkeys(pipeline.lanes, (0, 0))
        self._fair_share: float | None = None  # this router's share of the fair lane's model, from the controller
        self._adapters_seen: list[dict[str, Any]] = []  # the run-time adapters the pipeline's catalog holds
        self._models_of: Any = None  # the catalog the edge's models map was built from
        self._models_map: dict[str, str] = {}

    def report(self) -> RouterReport:
        """This router's report: called once per report interval, whether or not it answers."""
        self._set_gauges()
        self.sync_edge()
        fair = self._fair()
        return RouterReport(
            router_id=self._router_id,
            models={name: self._lane_report(lane) for name, lane in self._pipeline.lanes.items()},
            demand_tokens_per_s=self._pipeline.quotas.drain_demand(),
            fair_charged=self._fair_charged(),
            fair_backlogged=fair.backlog() if fair is not None else (),
        )

    def _lane_report(self, lane: Lane) -> ModelLoad:
        """What the router counted for one model since the last report."""
        report = replace(lane.tally.drain(), routed=routed_so_far(lane.name))
        offered = lane.tally.take_offered()
        gate, demand = lane.gate, self._demand[lane.name]
        if gate is None:
            return report
        gate.tick()  # rows a reserve lends back go to the line within a report interval
        # Waiters at the gate are demand the autoscaler counts; the level does not count
        # them as queue (the gate refuses each by its deadline, most critical first): it
        # sheds whole classes by demand against capacity instead.
        served, saturations = gate.served, gate.saturations
        seen = self._gate_seen[lane.name]
        demand.add(offered, served - seen[0], saturations > seen[1])
        self._gate_seen[lane.name] = (served, saturations)
        rates: dict[str, Any] = demand.rates()  # demand_rps, served_rps, gate_full: ModelLoad checks them
        return replace(report, gate_waiting=gate.waiting, **rates)

    def _fair_charged(self) -> dict[str, float]:
        """What the gate charged each tenant since the last report, when counters are shared.
        Without a fresh snapshot the controller is away: order by this router's view alone,
        and take an even split of the model again."""
        fair = self._fair()
        if fair is None:
            return {}
        if not self._cache.is_fresh():
            fair.adopt(None)
            if self._fair_share is not None and self._cache.snapshot is not None:
                self._fair_share = None
                self._set_ceiling(self._cache.snapshot)
        return fair.take_report()

    def _fair_lane(self) -> Lane:
        """The lane whose gate's fair-share counters are shared cluster-wide (``fairness.shared``):
        the default model's. The controller merges one counter per tenant and apportions one
        share per router, so one gate per router takes part; every other model's gate orders
        its line by its own counters."""
        return self._pipeline.default_lane

    def _fair(self) -> TenantCounters | None:
        gate = self._fair_lane().gate
        if gate is None or gate.fair is None or not self._cfg.fairness.shared:
            return None
        return gate.fair

    def _set_gauges(self) -> None:
        age = self._cache.age_s()
        m = self._metrics
        m.snapshot_age.set(age if age is not None else -1.0)
        m.kill.set(len(self._pipeline.kill_switches))
        for name, lane in self._pipeline.lanes.items():
            for b in lane.caller.backends:
                m.breaker.set(int(b.breaker.state), tags={"backend": b.role, "model": name})
            m.level.set(self._cache.effective(name).level, tags={"model": name})
            m.flex_held.set(len(self._pipeline.holds[name].queue), tags={"model": name})
            if lane.gate is not None:
                m.gate.set(lane.gate.limit.value, tags={"kind": "limit", "model": name})
                m.gate.set(lane.gate.in_flight, tags={"kind": "in_flight", "model": name})
                m.gate.set(lane.gate.waiting, tags={"kind": "waiting", "model": name})
                m.gate.set(lane.gate.batch_in_flight, tags={"kind": "batch_in_flight", "model": name})
        gate = self._fair_lane().gate
        counters = gate.fair if gate is not None else None
        if counters is not None:  # the tenant gauges carry no model tag: the fair lane's counters
            for tenant, value in counters.counters().items():
                m.fair_counter.set(value, tags={"tenant": tenant})
                m.fair_backlogged.set(int(counters.is_backlogged(tenant)), tags={"tenant": tenant})

    def _judged(self) -> frozenset[str]:
        """The models the edge refuses for: with one model, that one ("<class>" entries);
        with several, those its models map names (the open ones). A request for any
        other goes to the router."""
        sole = self._sole_lane()
        if sole is not None:
            return frozenset([sole.name])
        return frozenset(self._models_map.values())

    def _sole_lane(self) -> Lane | None:
        """The lane of a router serving one model (the edge's "<class>" entries are its); None
        with several."""
        lanes = self._pipeline.lanes
        return next(iter(lanes.values())) if len(lanes) == 1 else None

    def sync_edge(self) -> None:
        """The edge's maps follow the levels this router acts on; its refusals since the
        last report count as demand each model's level turned away (only for a model the
        edge judges: a key naming any other counts in no model's level)."""
        seen = {name: lane.tally.take_gate_decided() for name, lane in self._pipeline.lanes.items()}
        if self.edge is None:
            return
        now = self._clock()
        self._apply_models()
        tenants_off, classes_off, models_off = self._switched_off()
        self.edge.apply_keys(self._vouched(tenants_off))
        refused: dict[str, dict[str, int]] = {name: {} for name in self._pipeline.lanes}
        for key, n in self.edge.drain().items():
            model, crit = split_key(key)
            if crit in classes_off or model in models_off:
                continue
            self._metrics.edge.inc(n, tags={"criticality": crit})
            lane = self._edge_lane(model)
            if lane is not None:
                lane.tally.offer(crit, n)
                lane.tally.shed += n
                refused[lane.name][crit] = refused[lane.name].get(crit, 0) + n
        for name, lane in self._pipeline.lanes.items():
            self._learn(now, lane, seen[name], refused[name])
        self._apply_edge(now)

    def _edge_lane(self, model: str | None) -> Lane | None:
        """The lane an edge refusal counts in: a "<class>" refusal (None) the only model's,
        or none with several; a "<model>:<class>" refusal its model's, only with several
        and only for a model the models map names (HAProxy makes no other such key; one
        the map no longer names, or a model no longer served: none)."""
        lanes = self._pipeline.lanes
        if model is None:
            return self._sole_lane()
        return lanes.get(model) if len(lanes) > 1 and model in self._judged() else None

    def _learn(self, now: float, lane: Lane, seen: dict[str, list[int]], refused: dict[str, int]) -> None:
        """One model's edge throttle learns from its gate's decisions per class and the
        edge's refusals of that model since the last report."""
        throttle = self._edge_throttles[lane.name]
        admitted = {c.value for c in self._cache.effective(lane.name).constraints.admitted}
        for c in Criticality:
            if c.value not in admitted:  # the level refuses it whole: nothing to learn, and a
                throttle.forget(c.value)  # class admitted again starts afresh
                continue
            decided, through = seen.get(c.value, [0, 0])
            room = decided > 0 and through >= decided and self._gate_has_room(lane)
            throttle.record(now, c.value, decided + refused.get(c.value, 0), through, room)

    def _switched_off(self) -> tuple[set[str], set[str], set[str]]:
        """(tenants, classes, models) that a live kill switch refuses; every one of each
        under a global one."""
        now_wall = time.time()
        off: dict[str, set[str]] = {"tenant": set(), "criticality": set(), "model": set()}
        for e in self._pipeline.kill_switches:
            if e.expired(now_wall):
                continue
            if e.scope == "global":
                return set(self._cfg.tenants), {c.value for c in Criticality}, set(self._pipeline.lanes)
            if e.scope in off and e.value is not None:
                off[e.scope].add(e.value)
        return off["tenant"], off["criticality"], off["model"]

    def _vouched(self, tenants_off: set[str]) -> dict[str, str]:
        """The edge's key map: each key of a tenant that may use a model the edge judges
        (a model, or an adapter of it, in the pipeline's catalog) and that no kill switch
        turns off -> its cap rank. Built again only when those tenants, those models or the
        catalog change (``_apply_models`` runs first: the models map is current)."""
        off, judged, catalog = frozenset(tenants_off), self._judged(), self._pipeline.catalog
        of = self._vouched_of
        if of is None or of[0] != off or of[1] != judged or of[2] is not catalog:
            caps = {
                t: tc.max_criticality
                for t, tc in self._cfg.tenants.items()
                if any((n.parent or n.id) in judged for n in catalog.listed_for(t))
            }
            digests = self._keys.digests() if self._keys is not None else []
            self._vouched_map = key_entries(digests, caps, off)
            self._vouched_of = (off, judged, catalog)
        return self._vouched_map

    @staticmethod
    def _gate_has_room(lane: Lane) -> bool:
        g = lane.gate
        return g is None or (g.waiting == 0 and g.in_flight < g.limit.value)

    def _drops(self, now: float, name: str) -> dict[str, int]:
        throttle = self._edge_throttles[name]
        return {c.value: throttle.drop_per_mille(now, c.value) for c in Criticality}

    def _apply_edge(self, now: float) -> None:
        """The edge's map: for each model it judges, the classes its level refuses and the
        share its throttle drops of the others; "<class>" with one model, "<model>:<class>"
        with several (no "<class>" entries then: a request for a model the models map
        does not name is the router's to refuse, by that model's own level)."""
        if self.edge is None:
            return
        sole = self._sole_lane()
        if sole is not None:
            entries = self._model_entries(now, sole.name)
        else:
            entries = {}
            for name in sorted(self._judged()):
                entries.update(model_shed_entries(name, self._model_entries(now, name)))
        self.edge.apply(entries)

    def _model_entries(self, now: float, name: str) -> dict[str, str]:
        """One model's entries at its level, with its arrival ceiling while the controller's
        snapshot is fresh (a stale one's ceiling may be another fleet's: none then)."""
        own = self._cache.effective(name)
        snap = self._cache.snapshot
        state = snap.models.get(name) if snap is not None and own.source == "snapshot" else None
        ceiling = state.edge_ceiling_rps if state is not None else None
        return shed_entries(own.level, own.constraints, self._drops(now, name), ceiling)

    def _apply_models(self) -> None:
        """The edge's models map, from the pipeline's catalog (built again only when the
        catalog is another one)."""
        catalog = self._pipeline.catalog
        if self._models_of is not catalog:
            self._models_map = model_entries(catalog.open_names(), self._pipeline.lanes)
            self._models_of = catalog
        if self.edge is not None:
            self.edge.apply_models(self._models_map)

    def on_snapshot(self, snap: Snapshot) -> None:
        self._set_ceiling(snap)
        entries = []
        for raw in snap.kill_switches:
            try:
                entries.append(killswitch.KillSwitchEntry.from_dict(raw))
            except (TypeError, ValueError):
                log.warning("ignoring a malformed kill switch entry: %r", raw)
        self._pipeline.kill_switches = entries
        self._metrics.kill.set(len(entries))
        self._apply_adapters(snap)
        if self.edge is not None:  # at once, not at the next report: the level and switches may have changed
            self._apply_models()
            self.edge.apply_keys(self._vouched(self._switched_off()[0]))
            self._apply_edge(self._clock())

    def _apply_adapters(self, snap: Snapshot) -> None:
        """The pipeline's catalog: the config's with the snapshot's run-time adapters, built
        again only when they changed (each snapshot carries them all)."""
        if snap.adapters == self._adapters_seen:
            return
        self._pipeline.catalog = runtime_catalog(self._pipeline.base_catalog, snap.adapters)
        self._adapters_seen = list(snap.adapters)

    def on_reply(self, raw: dict[str, Any]) -> None:
        """Leases for this router; the cluster's fair-share counters, this report merged in."""
        self._pipeline.quotas.on_leases(raw.get("leases") or {})
        fair = self._fair()
        counters = raw.get("fair_counters")
        if fair is not None and isinstance(counters, dict):
            fair.adopt(counters)
        share = raw.get("fair_share")
        self._fair_share = float(share) if fair is not None and isinstance(share, (int, float)) else None
        snap = self._cache.snapshot
        if snap is not None:
            self._set_ceiling(snap)

    def _set_ceiling(self, snap: Snapshot) -> None:
        """Each gate's ceiling: an even split of its model's slots among routers; for the
        fair lane's (``_fair_lane``), this router's fair share of them while tenants wait
        (the controller apportions them by the shared counters)."""
        fair_lane = self._fair_lane()
        for name, lane in self._pipeline.lanes.items():
            if lane.gate is not None:
                share = self._fair_share if lane is fair_lane else None
                lane.gate.limit.set_ceiling(model_ceiling(self._cfg, snap, name, share))
