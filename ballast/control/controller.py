"""The controller actor: reports in, a versioned snapshot out. Never on the request path.

Routers and model replicas push a report every ``report_interval_s`` and receive
the newest ``Snapshot`` in the same call. Every ``tick_s`` the controller hands the
fresh reports to ``ballast.policies.control`` once per model (folding that model's view
of them into its load signals, then its degradation, autoscale and recycle surge) and to
``ballast.policies.recycle.recycle_step`` (through ``RecycleCoordinator``, each deployment
at its model's level), and publishes a new snapshot with every model's level. Every
decision lives in those policies, which the fleet simulator runs too; this module only
keeps the reports (expiry, bounds, each model's error window) and applies what the
policies decide.

It is a detached, named actor with ``max_restarts=-1``: when it dies Ray starts it
again, on another node if its own is gone. Load state is not kept: it arrives again
in the next round of reports (a second or so). What operators and recycles set is
kept in Ray's KV store (the GCS) and taken back by the restarted controller: the
recycle leases (recycling.py), and the kill switches, LoRA adapters added at run time,
chaos settings and audit trail (``AdminState``, admin_state.py: written before the admin
call answers, so an acknowledged kill switch or adapter survives). Its snapshots carry a
new ``epoch`` so caches accept the restarted controller's versions, which start over at 1.

All per-sender maps are bounded: reports expire after ``report_expiry_s`` and the
maps are capped at ``MAX_SENDERS`` entries (oldest evicted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import ray

from ballast.config import BallastConfig, load_config
from ballast.control.admin_state import AdminState
from ballast.control.recycling import RecycleCoordinator
from ballast.control.snapshot import ModelState, Snapshot
from ballast.names import ROUTER_DEPLOYMENT
from ballast.policies import control
from ballast.policies.degradation import LoadSignals
from ballast.policies.edge import EdgeCeiling
from ballast.policies.fairness import merge_reports, router_shares
from ballast.policies.quota import TenantQuota, apportion, effective_rates
from ballast.policies.reports import ReplicaReport, RouterReport, WatchdogReport, checked
from ballast.policies.window import CountWindow

log = logging.getLogger("ballast.controller")

MAX_SENDERS = 4096
MAX_OUTCOME_BUCKETS = 1024
#: What /admin/replicas shows of a replica's watchdog report.
WATCHDOG_STATUS_KEYS = (
    "rss_bytes",
    "vram_bytes",
    "vram_total_bytes",
    "threads",
    "fds",
    "gpu_util_pct",
    "cpu_pct",
    "heartbeat_age_s",
    "stalled_s",
    "warming_up",
    "hung",
    "hung_reason",
    "severity",
    "reason",
    "action_reason",
    "ready",
    "recycle_requested",
    "critical",
    "trends",
    "actions_total",
    "engine_processes",  # (pid, name) of each process of its engine it watches: every rank's
)

R = TypeVar("R")


def _tenant_quotas(cfg: BallastConfig) -> dict[str, TenantQuota]:
    """Each tenant's token quota (none for a tenant without a rate: its concurrency cap alone)."""
    quotas: dict[str, TenantQuota] = {}
    for name, t in cfg.tenants.items():
        rate, burst = t.rate_tokens_per_s, t.burst
        if rate is None or burst is None:
            continue
        quotas[name] = TenantQuota(
            rate_tokens_per_s=rate,
            burst_tokens=burst,
            max_concurrent=t.max_concurrent or cfg.resilience.bulkhead.per_tenant,
            weight=t.weight,
            sheddable=t.sheddable,
        )
    return quotas


class _Reports(Generic[R]):
    """Latest report per sender, expiring and bounded (the accounting, not the policy)."""

    def __init__(self, expiry_s: float, clock: Callable[[], float]):
        self._expiry_s = expiry_s
        self._clock = clock
        self._by_sender: OrderedDict[str, tuple[float, R]] = OrderedDict()

    def put(self, sender: str, report: R) -> None:
        self._by_sender.pop(sender, None)
        self._by_sender[sender] = (self._clock(), report)
        while len(self._by_sender) > MAX_SENDERS:
            self._by_sender.popitem(last=False)

    def fresh(self) -> list[R]:
        cutoff = self._clock() - self._expiry_s
        # Entries are in arrival order: drop expired ones from the front.
        while self._by_sender:
            sender, (t, _) = next(iter(self._by_sender.items()))
            if t >= cutoff:
                break
            self._by_sender.popitem(last=False)
        return [r for _, r in self._by_sender.values()]


def _watchdog_status(wd: WatchdogReport | None) -> dict[str, Any] | None:
    """What /admin/replicas shows of a watchdog's report (None: no report from it)."""
    if wd is None:
        return None
    shown = wd.as_dict()
    return {k: shown[k] for k in WATCHDOG_STATUS_KEYS}


@dataclass
class _ModelControl:
    """One model's control state: its policy (level and autoscaler) and its error window.

    A model is the unit of protection: each has its own, fed by its own signals. A
    redeploy keeps a model's state while the model stays (same name, same deployment).
    """

    deployment: str
    fallback_deployment: str | None  # None: the model has no fallback
    fallback_replicas: int  # the fallback's fixed replica count (0 without one)
    policy: control.ControlPolicy
    # (requests, errors) per router report, stamped when it came: the error window.
    outcomes: CountWindow[tuple[int, int]]
    edge: EdgeCeiling  # what HAProxy lets through of it per second

    def deployments(self) -> tuple[str, ...]:
        return (self.deployment,) + ((self.fallback_deployment,) if self.fallback_deployment else ())


@dataclass(frozen=True)
class _ModelTick:
    """What one tick decided for one model."""

    deployment: str
    signals: LoadSignals
    step: control.ControlDecision
    ongoing: float  # the autoscaler's input
    running: int  # its deployment's replicas reporting now
    edge_ceiling_rps: float | None  # EdgeCeiling's, this tick


class ControllerCore:
    """The controller's logic without Ray: testable with a fake clock.

    One level, autoscaler, error window and set of recycle targets per model
    (``_ModelControl``); tenants' quotas and fair shares across models.
    """

    def __init__(
        self,
        cfg: BallastConfig,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self._clock = clock
        self._wall = wall_clock
        self.epoch = uuid.uuid4().hex[:12]
        self.configure(cfg)
        self._version = 0
        self.rejected_reports = 0
        # What operators set (admin_state.py) survives configure() (a redeploy); the actor
        # persists it so it survives a restart too. A change is published at once.
        self.admin = AdminState(cfg, clock, wall_clock, on_change=self._republish)
        self.recycler = RecycleCoordinator(cfg.recycle, self.epoch, self._wall)
        self._snapshot = self._publish({})

    def configure(self, cfg: BallastConfig) -> None:
        self.cfg = cfg
        if hasattr(self, "admin"):
            self.admin.configure(cfg)
        self._deg_cfg = cfg.degradation_config()
        # Models that stay keep their state; a removed model's goes with it.
        old: dict[str, _ModelControl] = getattr(self, "_models", {})
        self._models = {m.name: self._model_control(m.name, old.get(m.name)) for m in cfg.models}
        self._routers: _Reports[RouterReport] = _Reports(cfg.controller.report_expiry_s, self._clock)
        self._replicas: _Reports[ReplicaReport] = _Reports(cfg.controller.report_expiry_s, self._clock)
        # Watchdogs report every watchdog.interval_s, which may be longer than a replica's interval.
        watchdog_expiry_s = max(cfg.controller.report_expiry_s, 3 * cfg.watchdog.interval_s)
        self._watchdogs: _Reports[WatchdogReport] = _Reports(watchdog_expiry_s, self._clock)
        if hasattr(self, "recycler"):
            self.recycler.configure(cfg.recycle)
        # Cluster-wide fair-share counters (ballast.policies.fairness): every router's charges
        # merged as they arrive; one entry per configured tenant, kept across a redeploy.
        counters: dict[str, float] = getattr(self, "_fair_counters", {})
        self._fair_counters = {t: counters.get(t, 0.0) for t in cfg.tenants}
        self._quotas = _tenant_quotas(cfg)

    def _model_control(self, name: str, old: _ModelControl | None) -> _ModelControl:
        """Model ``name``'s control under ``self.cfg``: ``old``'s state kept when its deployment is the same."""
        dep = self.cfg.deployment_name(name)
        fallback = self.cfg.fallback_of(name)
        as_cfg = self.cfg.autoscale_config(name)
        kept = old if old is not None and old.deployment == dep else None
        state = kept.policy.state if kept is not None else None
        if state is not None and state.autoscale.last_desired is not None:  # within the new bounds
            autoscale = replace(state.autoscale, last_desired=as_cfg.clamp(state.autoscale.last_desired))
            state = replace(state, autoscale=autoscale)
        return _ModelControl(
            deployment=dep,
            fallback_deployment=self.cfg.fallback_deployment_name(name) if fallback is not None else None,
            fallback_replicas=fallback.deployment.replicas if fallback is not None else 0,
            policy=control.ControlPolicy(self._deg_cfg, as_cfg, state),
            outcomes=kept.outcomes if kept is not None else CountWindow(MAX_OUTCOME_BUCKETS, fields=2),
            edge=EdgeCeiling(
                self._deg_cfg.edge_ceiling_ratio,
                self._deg_cfg.edge_capacity_memory_s,
                kept.edge if kept is not None else None,
            ),
        )

    def deployments(self) -> list[str]:
        """Every model's deployment and its fallback's, in the config's order."""
        return [d for mc in self._models.values() for d in mc.deployments()]

    def model_deployments(self) -> list[str]:
        """Every model's own deployment (no fallback), in the config's order."""
        return [mc.deployment for mc in self._models.values()]

    # -- reports ---------------------------------------------------------------------
    # Each report is checked again on arrival (ballast.policies.reports.checked): anything that
    # is not a well-formed report of its kind is dropped and counted here, so it can
    # never wedge a tick; the sender still gets the snapshot.
    def report_router(self, report: RouterReport) -> dict[str, Any]:
        got = checked(report, RouterReport)
        if got is None:
            self.rejected_reports += 1
            return self._snapshot.to_dict()
        self._routers.put(got.router_id, got)
        for name, mc in self._models.items():  # each model's outcomes into its own error window
            load = got.load(name)
            if load.requests:
                mc.outcomes.add((load.requests, load.errors), self._clock())
        reply = {**self._snapshot.to_dict(), "leases": self.leases_for(got.router_id)}
        if self.cfg.fairness.enabled and self.cfg.fairness.shared:
            known = {t: v for t, v in got.fair_charged.items() if t in self._fair_counters}
            self._fair_counters = merge_reports(self._fair_counters, [known])
            reply["fair_counters"] = dict(self._fair_counters)
            reply["fair_share"] = self.fair_share(got.router_id)
        return reply

    def fair_share(self, router_id: str) -> float | None:
        """This router's share of the model's slots by the tenants waiting at each router
        (ballast.policies.fairness.router_shares); None while nobody waits anywhere."""
        f = self.cfg.fairness
        backlogs = {r.router_id: r.fair_backlogged for r in self._routers.fresh()}
        weights = {t: tc.weight for t, tc in self.cfg.tenants.items()}
        shares = router_shares(backlogs, self._fair_counters, weights, f.lag_tokens, f.router_floor_ratio)
        return shares.get(router_id)

    def leases_for(self, router_id: str) -> dict[str, dict[str, float]]:
        """This router's share of every tenant's global rate, by the routers' recent demand.

        One quota across all routers: each tenant's effective rate (its own, shrunk for
        sheddable tenants under degradation, plus idle capacity borrowed by weight at
        level 0) is split among the routers reporting now, in proportion to the demand
        each saw. A lease lapses after ``quota.lease_ttl_s``; a router without a live
        lease falls back to 1/N of the tenant's rate (``ballast.policies.quota.lease_rate``).
        """
        if not self._quotas:
            return {}
        demand: dict[str, dict[str, float]] = {}  # tenant -> router -> tokens/s
        for r in self._routers.fresh():
            for tenant, rate in r.demand_tokens_per_s.items():
                if tenant in self._quotas:
                    demand.setdefault(tenant, {})[r.router_id] = max(0.0, float(rate))
        routers = {r.router_id for r in self._routers.fresh()} | {router_id}
        q = self.cfg.quota
        # Borrowing is capped: a tenant's demand counts only up to (1 + max_borrow_ratio) × its rate.
        totals = {
            t: min(sum(demand.get(t, {}).values()), quota.rate_tokens_per_s * (1.0 + q.max_borrow_ratio))
            for t, quota in self._quotas.items()
        }
        # A tenant's quota holds across models: it shrinks (and lends) by the highest level
        # of any model, so a tenant flooding one model cannot keep its full rate there.
        level = max((m.level for m in self._snapshot.models.values()), default=0)
        rates = effective_rates(self._quotas, totals, level, tuple(q.level_factors), frozenset(q.lend_at_levels))
        expires = self._wall() + q.lease_ttl_s
        leases: dict[str, dict[str, float]] = {}
        for tenant, quota in self._quotas.items():
            shares = apportion(
                rates[tenant], {r: demand.get(tenant, {}).get(r, 0.0) for r in routers}, q.min_share_ratio
            )
            # The rate follows demand; the burst is split evenly and stays put, because a
            # bucket whose burst shrinks throws tokens away (and leases change every report).
            leases[tenant] = {
                "rate_tokens_per_s": shares.get(router_id, 0.0),
                "burst_tokens": quota.burst_tokens / len(routers),
                "expires_at_s": expires,
            }
        return leases

    def report_replica(self, report: ReplicaReport) -> dict[str, Any]:
        got = checked(report, ReplicaReport)
        if got is None:
            self.rejected_reports += 1
            return self._snapshot.to_dict()
        self._replicas.put(got.replica_id, got)
        return self._snapshot.to_dict()

    def report_watchdog(self, report: WatchdogReport) -> dict[str, Any]:
        got = checked(report, WatchdogReport)
        if got is None:
            self.rejected_reports += 1
            return {"accepted": False}
        self._watchdogs.put(got.replica_id, got)
        return {"accepted": True}

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot.to_dict()

    def desired(self, deployment: str) -> int:
        return int(self._snapshot.desired_replicas.get(deployment, 0))

    # -- recycling (ballast.control.recycling) ---------------------------------------------------
    def request_recycle(self, replica_id: str | None, deployment: str | None, everyone: bool, by: str) -> list[str]:
        known = {r.replica_id: r.deployment for r in self._replicas.fresh()}
        chosen = self.recycler.request(known, replica_id, deployment, everyone, by)
        self.admin.audit_admin("recycle_requested", by, replicas=chosen)
        return chosen

    def replica_status(self) -> dict[str, Any]:
        """Every reporting replica joined with its watchdog's view, plus the recycler's state."""
        wds = {w.replica_id: w for w in self._watchdogs.fresh()}
        now = self._wall()
        rows = []
        for r in self._replicas.fresh():
            rid = r.replica_id
            wd = wds.get(rid)
            rows.append(
                {
                    "replica_id": rid,
                    "deployment": r.deployment,
                    "device": r.device,  # "cpu" or "cuda:N": where its model runs
                    "chaos_vram_leak": r.chaos_vram_leak,  # None, "leaking", or "no_gpu" (a CPU replica)
                    "chaos": r.chaos,  # the chaos settings the replica applies, None when none
                    "age_s": round(now - float(r.started_at_s or now), 1),
                    "queued": r.queued,
                    "running": r.running,
                    # The KV token budget and the share of it the rows in flight reserve
                    # (vLLM: its own KV cache's use, and no budget of Ballast's).
                    "kv_util_pct": r.kv_util_pct,
                    "kv_tokens_reserved": r.kv_tokens_reserved,
                    "kv_tokens_budget": r.kv_tokens_budget,
                    "engine_waiting": r.engine_waiting,  # inside a self-scheduling engine (vLLM); in queued too
                    "prefix_cache_hit_pct": r.prefix_cache_hit_pct,
                    "prefix_cache_queries": r.prefix_cache_queries,  # vLLM's counters since it started
                    "prefix_cache_hits": r.prefix_cache_hits,
                    "prefix_blocks": r.prefix_blocks,  # KV blocks it reports holding to the routers
                    "ready": r.ready and (wd is None or wd.ready),
                    "draining": r.draining,
                    "manual_recycle": rid in self.recycler.manual,
                    "watchdog": _watchdog_status(wd),
                }
            )
        # The availability account: each model deployment's expected availability at its
        # replicas running, the fleet's measured one.
        running = self._snapshot.running_replicas
        per_dep = {mc.deployment: running.get(mc.deployment, 0) for mc in self._models.values()}
        return {
            "replicas": rows,
            **self.recycler.summary(per_dep),
            "events": list(self.recycler.events)[-50:],
            "leases": [lease.to_dict() for lease in self.recycler.leases.leases()],
        }

    # -- the tick --------------------------------------------------------------------
    def signals(self, name: str) -> LoadSignals:
        """Model ``name``'s level inputs from the fresh reports: the routers' loads of it, its
        own and its fallback's replicas, its error window (ballast.policies.control.fold_reports)."""
        mc = self._models[name]
        mc.outcomes.expire(self._clock() - self.cfg.controller.error_window_s)
        requests, errors = mc.outcomes.totals()
        return control.fold_reports(
            control.model_views(self._routers.fresh(), name),
            control.of_deployments(self._replicas.fresh(), *mc.deployments()),
            mc.deployment,
            requests=requests,
            errors=errors,
        )

    def tick(self) -> Snapshot:
        """Each model's level and replicas from its own signals, then the recycler over
        every deployment, then one snapshot."""
        self.admin.expire_kill_switches()
        now = self._clock()
        watchdogs = {w.replica_id: w for w in self._watchdogs.fresh()}
        ticks = {name: self._tick_model(name, mc, watchdogs, now) for name, mc in self._models.items()}
        self._tick_recycler(ticks, watchdogs)
        self._snapshot = self._publish(ticks)
        return self._snapshot

    def _tick_model(self, name: str, mc: _ModelControl, watchdogs: dict[str, WatchdogReport], now: float) -> _ModelTick:
        """One model's step (ballast.policies.control.ControlPolicy) on its own inputs."""
        sig = self.signals(name)
        routers = control.model_views(self._routers.fresh(), name)
        replicas = self._replicas.fresh()
        running = len(control.of_deployment(replicas, mc.deployment))
        ongoing = control.ongoing_requests(routers, replicas, mc.deployment, sig.queue_length)
        serving = control.serving_replicas(replicas, watchdogs, mc.deployment)
        served = sum(float(r.served_rps) for r in routers)
        step = mc.policy.step(
            control.ControlInputs(
                signals=sig,
                ongoing_requests=float(ongoing),
                running_replicas=running,
                # The recycler's surge from the last tick (ballast.policies.recycle.surging).
                surging=mc.deployment in self.recycler.surging,
                serving_replicas=serving,
            ),
            now,
        )
        ceiling = mc.edge.observe(now, sig.capacity_rps, served, serving)
        return _ModelTick(mc.deployment, sig, step, ongoing, running, ceiling)

    def _tick_recycler(self, ticks: Mapping[str, _ModelTick], watchdogs: dict[str, WatchdogReport]) -> None:
        """The recycler over every model's deployment and fallback: each deployment's target
        and ceiling, and its model's level (a model in trouble holds its own recycles only)."""
        targets: dict[str, int] = {}
        ceilings: dict[str, int] = {}
        levels: dict[str, int] = {}
        for name, t in ticks.items():
            mc = self._models[name]
            targets[t.deployment] = t.step.desired_replicas
            ceilings[t.deployment] = mc.policy.as_cfg.max_replicas
            if mc.fallback_deployment is not None:
                targets[mc.fallback_deployment] = ceilings[mc.fallback_deployment] = mc.fallback_replicas
            for dep in mc.deployments():
                levels[dep] = t.step.level.level
        try:
            self.recycler.tick(self._replicas.fresh(), watchdogs, targets, levels, ceilings)
        except Exception:  # recycling must never stop the control loop
            log.exception("recycle tick failed")

    def _model_state(self, name: str, mc: _ModelControl, t: _ModelTick | None) -> ModelState:
        """One model's entry in the snapshot; level 0, "starting", before its first tick."""
        replicas = self._replicas.fresh()
        routing = control.routing_summary(control.model_views(self._routers.fresh(), name), replicas, mc.deployment)
        state = ModelState(
            deployment=mc.deployment,
            constraints=self._deg_cfg.constraints[0],
            engine_rows=control.engine_rows(replicas, mc.deployment),
            routing=routing,
        )
        if t is None:
            return state
        level = t.step.level
        return replace(
            state,
            level=level.level,
            target_level=level.target_level,
            reason=level.reason,
            constraints=self._deg_cfg.constraints[level.level],
            inputs=t.signals,
            edge_ceiling_rps=t.edge_ceiling_rps,
        )

    def _replica_counts(self, ticks: Mapping[str, _ModelTick]) -> dict[str, int]:
        """Replicas reporting now: every model's deployment and fallback, and the routers
        (empty before the first tick)."""
        if not ticks:
            return {}
        replicas = self._replicas.fresh()
        running = {t.deployment: t.running for t in ticks.values()}
        running[ROUTER_DEPLOYMENT] = len(self._routers.fresh())
        for mc in self._models.values():
            if mc.fallback_deployment is not None:
                running[mc.fallback_deployment] = len(control.of_deployment(replicas, mc.fallback_deployment))
        return running

    def _publish(self, ticks: Mapping[str, _ModelTick]) -> Snapshot:
        """A new snapshot: every model's state, alike."""
        self._version += 1
        models = {name: self._model_state(name, mc, ticks.get(name)) for name, mc in self._models.items()}
        desired = {t.deployment: t.step.desired_replicas for t in ticks.values()}
        return Snapshot(
            epoch=self.epoch,
            version=self._version,
            created_at_s=self._wall(),
            models=models,
            desired_replicas=desired,
            running_replicas=self._replica_counts(ticks),
            autoscale={
                t.deployment: {
                    "mode": t.step.scale.mode,
                    "reason": t.step.scale.reason,
                    "ongoing_requests": t.ongoing,
                    "stable_desired": t.step.scale.stable_desired,
                    "panic_desired": t.step.scale.panic_desired,
                    "recycle_surge": t.step.recycle_surge,
                }
                for t in ticks.values()
            },
            kill_switches=self.admin.kill_switch_entries(),
            adapters=self.admin.adapter_entries(),
            chaos=self.admin.chaos(),
            recycle_orders=dict(self.recycler.orders),
            recycle=self.recycler.summary(desired),
        )

    def _republish(self) -> None:
        """An admin change goes out at once, not at the next tick: same decision, new version."""
        self._version += 1
        self._snapshot = replace(
            self._snapshot,
            version=self._version,
            created_at_s=self._wall(),
            kill_switches=self.admin.kill_switch_entries(),
            adapters=self.admin.adapter_entries(),
            chaos=self.admin.chaos(),
        )


@ray.remote(num_cpus=0)
class Controller:
    """Ray actor around ``ControllerCore``: an async actor whose tick runs as a task."""

    def __init__(self, cfg: dict[str, Any]):
        self._core = ControllerCore(load_config(cfg))
        self._task: asyncio.Task[None] | None = None
        self._kv_key = f"ballast:{self._core.cfg.app_name}:recycle-leases".encode()
        self._admin_key = f"ballast:{self._core.cfg.app_name}:admin-state".encode()
        self._adopt_leases()
        self._adopt_admin()
        from ray.util import metrics  # created once, here (STYLE 8)

        model = ("model",)
        self._m_level = metrics.Gauge("ballast_degradation_level", "Current degradation level (0-4).", tag_keys=model)
        self._m_queue = metrics.Gauge("ballast_queue_length", "Admitted requests not yet computing.", tag_keys=model)
        self._m_imbalance = metrics.Gauge(
            "ballast_model_load_imbalance_ratio",
            "The model's most loaded replica's requests (running + queued) over the mean of its replicas.",
            tag_keys=model,
        )
        self._m_desired = metrics.Gauge(
            "ballast_desired_replicas", "Replicas the controller wants per deployment.", tag_keys=("deployment",)
        )
        self._m_ticks = metrics.Counter("ballast_controller_ticks_total", "Controller ticks.")
        dep = ("deployment",)
        self._m_recycles = metrics.Counter(
            "ballast_recycles_total",
            "Recycle events by outcome (started, completed, stuck, lease_expired, killed_hung).",
            tag_keys=dep + ("reason", "outcome"),
        )
        self._m_hung = metrics.Counter("ballast_hung_replicas_killed_total", "Hung replicas killed.", tag_keys=dep)
        self._m_in_flight = metrics.Gauge("ballast_recycle_in_flight", "Recycles in progress.", tag_keys=dep)
        self._m_oldest = metrics.Gauge(
            "ballast_recycle_oldest_seconds", "Age of the oldest recycle in progress (0 when none).", tag_keys=dep
        )
        self._m_avail = metrics.Gauge(
            "ballast_availability",
            "Replica availability under recycling: expected per model deployment (a rolling restart's "
            "formula), and measured over the fleet (no deployment).",
            tag_keys=("kind", "deployment"),
        )

    # -- recycle leases and admin state survive a controller restart in Ray's KV store --------
    def _adopt_leases(self) -> None:
        try:
            raw = _kv_get(self._kv_key)
            if raw:
                n = self._core.recycler.adopt(json.loads(raw))
                log.warning("adopted %d recycle lease(s) from a previous controller", n)
        except Exception:
            log.exception("could not read persisted recycle leases; starting without them")

    def _adopt_admin(self) -> None:
        try:
            raw = _kv_get(self._admin_key)
            if raw:
                n = self._core.admin.adopt(json.loads(raw))
                log.warning("adopted %d kill switch(es), the adapters and chaos settings from a previous controller", n)
        except Exception:
            log.exception("could not read the persisted kill switches and chaos; starting without them")
        self._core.admin.dirty = False

    async def _persist_admin(self) -> None:
        """Write the admin state now (an admin call answers after it); on failure the next tick retries."""
        if not self._core.admin.dirty:
            return
        self._core.admin.dirty = False
        try:
            await asyncio.to_thread(_kv_put, self._admin_key, json.dumps(self._core.admin.to_dict()).encode())
        except Exception:
            self._core.admin.dirty = True
            log.exception("could not persist the kill switches and chaos")

    async def _after_tick(self) -> None:
        rec = self._core.recycler
        if rec.leases_dirty:
            rec.leases_dirty = False
            try:
                await asyncio.to_thread(_kv_put, self._kv_key, json.dumps(rec.leases_dict()).encode())
            except Exception:
                rec.leases_dirty = True
                log.exception("could not persist recycle leases")
        await self._persist_admin()
        while rec.kill_orders:
            order = rec.kill_orders.popleft()
            try:
                await asyncio.to_thread(_kill_actor, order["actor_name"], order["namespace"])
                self._m_hung.inc(tags={"deployment": str(order["deployment"])})
            except Exception:
                log.exception("could not kill hung replica %s", order["replica_id"])
        while rec.new_events:
            e = rec.new_events.popleft()
            self._m_recycles.inc(
                tags={"deployment": str(e["deployment"]), "reason": str(e["reason"]), "outcome": e["outcome"]}
            )
        deps = self._core.deployments()
        for d in deps:
            self._m_in_flight.set(sum(1 for f in rec.state.in_flight if f.deployment == d), tags={"deployment": d})
            self._m_oldest.set(rec.oldest_in_flight_s(d), tags={"deployment": d})
        avail = rec.availability({d: self._core.desired(d) for d in self._core.model_deployments()})
        for dep, expected in avail["expected"].items():
            if expected is not None:
                self._m_avail.set(expected, tags={"kind": "expected", "deployment": dep})
        if avail["measured"] is not None:
            self._m_avail.set(avail["measured"], tags={"kind": "measured", "deployment": ""})

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                snap = self._core.tick()
                for model, m in snap.models.items():
                    self._m_level.set(m.level, tags={"model": model})
                    self._m_queue.set(m.inputs.queue_length if m.inputs is not None else 0, tags={"model": model})
                    imbalance = m.routing.load_max_over_mean
                    self._m_imbalance.set(imbalance if imbalance is not None else 1.0, tags={"model": model})
                for dep, n in snap.desired_replicas.items():
                    self._m_desired.set(n, tags={"deployment": dep})
                self._m_ticks.inc()
                await self._after_tick()
            except Exception:  # a bad report must not stop the loop
                log.exception("controller tick failed")
            await asyncio.sleep(self._core.cfg.controller.tick_s)

    async def start(self) -> str:
        self._ensure_loop()
        return self._core.epoch

    async def configure(self, cfg: dict[str, Any]) -> None:
        new = load_config(cfg)
        if new != self._core.cfg:
            self._core.configure(new)
        self._ensure_loop()

    async def report_router(self, report: RouterReport) -> dict[str, Any]:
        self._ensure_loop()
        return self._core.report_router(report)

    async def report_replica(self, report: ReplicaReport) -> dict[str, Any]:
        self._ensure_loop()
        return self._core.report_replica(report)

    async def report_watchdog(self, report: WatchdogReport) -> dict[str, Any]:
        self._ensure_loop()
        return self._core.report_watchdog(report)

    async def request_recycle(
        self, replica_id: str | None, deployment: str | None, everyone: bool, by: str
    ) -> list[str]:
        return self._core.request_recycle(replica_id, deployment, bool(everyone), by)

    async def replica_status(self) -> dict[str, Any]:
        return self._core.replica_status()

    async def get_snapshot(self) -> dict[str, Any]:
        self._ensure_loop()
        return self._core.snapshot()

    async def ping(self) -> str:
        return self._core.epoch

    async def set_kill_switch(
        self, scope: str, value: str | None, reason: str, expires_in_s: float, set_by: str
    ) -> dict[str, Any]:
        entry = self._core.admin.set_kill_switch(scope, value, reason, expires_in_s, set_by)
        await self._persist_admin()
        return entry

    async def delete_kill_switch(self, entry_id: str, by: str) -> bool:
        deleted = self._core.admin.delete_kill_switch(entry_id, by)
        await self._persist_admin()
        return deleted

    async def kill_switches(self) -> dict[str, Any]:
        return self._core.admin.kill_switches()

    async def reserve_adapter(self, model: str, name: str, path: str, tenants: list[str]) -> None:
        self._core.admin.reserve_adapter(model, name, path, tenants)  # not persisted: a restart drops it

    async def release_adapter(self, name: str, path: str) -> bool:
        return self._core.admin.release_adapter(name, path)

    async def set_adapter(self, model: str, name: str, path: str, tenants: list[str], by: str) -> dict[str, Any]:
        entry = self._core.admin.set_adapter(model, name, path, tenants, by)
        await self._persist_admin()
        return entry

    async def delete_adapter(self, name: str, by: str) -> bool:
        deleted = self._core.admin.delete_adapter(name, by)
        await self._persist_admin()
        return deleted

    async def adapters(self) -> list[dict[str, Any]]:
        return self._core.admin.adapters()

    async def set_chaos(self, target: str, settings: dict[str, Any], by: str) -> dict[str, Any]:
        chaos = self._core.admin.set_chaos(target, settings, by)
        await self._persist_admin()
        return chaos

    async def clear_chaos(self, by: str) -> None:
        self._core.admin.clear_chaos(by)
        await self._persist_admin()

    async def audit_dlq(self, action: str, by: str, dead_letter: dict[str, Any]) -> None:
        """An admin action on a dead letter (done by the router, on the batch store), in the audit trail."""
        if action not in DLQ_ACTIONS:
            raise ValueError(f"action: one of {', '.join(DLQ_ACTIONS)}")
        self._core.admin.audit_admin(action, by, dead_letter=dead_letter)
        await self._persist_admin()


#: The dead-letter actions the admin API audits (``audit_dlq``).
DLQ_ACTIONS = ("dlq_retry", "dlq_delete")


def _kv_get(key: bytes) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace="ballast")


def _kv_put(key: bytes, value: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace="ballast")


def _kill_actor(name: str, namespace: str) -> None:
    """Kill a hung replica outright; Serve notices the dead actor and starts a replacement."""
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)


def controller_options(cfg: BallastConfig) -> dict[str, Any]:
    return dict(
        name=cfg.controller.name,
        namespace=cfg.controller.namespace,
        lifetime="detached",
        max_restarts=-1,
        get_if_exists=True,
        num_cpus=cfg.controller.num_cpus,
    )


def ensure_controller(cfg: BallastConfig) -> ray.actor.ActorHandle[Any]:
    """Get the named controller, creating it if absent; push this config to it."""
    actor_class: Any = Controller  # ray.remote's actor class: Ray types it as the class it wraps
    handle: ray.actor.ActorHandle[Any] = actor_class.options(**controller_options(cfg)).remote(
        cfg.model_dump(mode="json")
    )
    handle.configure.remote(cfg.model_dump(mode="json"))
    return handle
