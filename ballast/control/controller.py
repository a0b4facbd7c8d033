"""The controller actor: reports in, a versioned snapshot out. Never on the request path.

Routers and model replicas push a report every ``report_interval_s`` and receive
the newest ``Snapshot`` in the same call. Every ``tick_s`` the controller hands the
fresh reports to ``ballast.policies.control`` (folding them into load signals, then
degradation, autoscale and the recycle surge) and to ``ballast.policies.recycle.recycle_step``
(through ``RecycleCoordinator``), and publishes a new snapshot. Every decision lives
in those policies, which the fleet simulator runs too; this module only keeps the
reports (expiry, bounds, the error window) and applies what the policies decide.

It is a detached, named actor with ``max_restarts=-1``: when it dies Ray starts it
again, on another node if its own is gone. Load state is not kept: it arrives again
in the next round of reports (a second or so). What operators and recycles set is
kept in Ray's KV store (the GCS) and taken back by the restarted controller: the
recycle leases, and the kill switches, LoRA adapters added at run time, chaos
settings and audit trail (written before the admin call answers, so an acknowledged
kill switch or adapter survives). Its
snapshots carry a new ``epoch`` so caches accept the restarted controller's
versions, which start over at 1.

All per-sender maps are bounded: reports expire after ``report_expiry_s`` and the
maps are capped at ``MAX_SENDERS`` entries (oldest evicted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import asdict, replace
from typing import Any, Callable, Generic, Optional, TypeVar

import ray

from ballast.policies import control
from ballast.policies.adapters import MAX_RUNTIME_ADAPTERS, RuntimeAdapter, with_runtime
from ballast.policies.catalog import Catalog, CatalogError
from ballast.policies.fairness import merge_reports, router_shares
from ballast.policies import killswitch
from ballast.policies.criticality import Criticality
from ballast.policies.killswitch import KillSwitchEntry
from ballast.policies.quota import TenantQuota, apportion, effective_rates
from ballast.policies.degradation import LoadSignals
from ballast.policies.window import CountWindow
from ballast.policies.reports import ReplicaReport, RouterReport, WatchdogReport, checked

from ballast.config import BallastConfig, load_config
from ballast.control.recycling import RecycleCoordinator
from ballast.control.names import CHAOS_TARGETS, FALLBACK_DEPLOYMENT, MODEL_DEPLOYMENT, ROUTER_DEPLOYMENT
from ballast.control.snapshot import Snapshot

log = logging.getLogger("ballast.controller")

MAX_SENDERS = 4096
MAX_OUTCOME_BUCKETS = 1024
MAX_KILL_SWITCHES = 256
MAX_AUDIT = 1000
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
)

R = TypeVar("R")


class _Reports(Generic[R]):
    """Latest report per sender, expiring and bounded (the accounting, not the policy)."""

    def __init__(self, expiry_s: float, clock: Callable[[], float]):
        self._expiry_s = expiry_s
        self._clock = clock
        self._by_sender: "OrderedDict[str, tuple[float, R]]" = OrderedDict()

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


def _watchdog_status(wd: Optional[WatchdogReport]) -> Optional[dict[str, Any]]:
    """What /admin/replicas shows of a watchdog's report (None: no report from it)."""
    if wd is None:
        return None
    shown = wd.as_dict()
    return {k: shown[k] for k in WATCHDOG_STATUS_KEYS}


class ControllerCore:
    """The controller's logic without Ray: testable with a fake clock."""

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
        # Kill switches and chaos survive configure() (a redeploy); the actor persists
        # them (admin_state) so they survive a restart too.
        self.admin_dirty = False
        self._kill_switches: "OrderedDict[str, KillSwitchEntry]" = OrderedDict()
        self._adapters: "OrderedDict[str, RuntimeAdapter]" = OrderedDict()  # LoRA adapters added at run time
        self._audit: deque[dict[str, Any]] = deque(maxlen=MAX_AUDIT)
        self._chaos: dict[str, dict[str, Any]] = {}
        self.recycler = RecycleCoordinator(cfg.recycle, self.epoch, self._wall)
        self._snapshot = self._publish(decision=None, signals=None, desired={}, running={}, autoscale_info={})

    def configure(self, cfg: BallastConfig) -> None:
        self.cfg = cfg
        self._deg_cfg = cfg.degradation_config()
        self._as_cfg = cfg.autoscale_config()
        self._policy = control.ControlPolicy(self._deg_cfg, self._as_cfg)
        self._routers: _Reports[RouterReport] = _Reports(cfg.controller.report_expiry_s, self._clock)
        self._replicas: _Reports[ReplicaReport] = _Reports(cfg.controller.report_expiry_s, self._clock)
        # Watchdogs report every watchdog.interval_s, which may be longer than a replica's interval.
        watchdog_expiry_s = max(cfg.controller.report_expiry_s, 3 * cfg.watchdog.interval_s)
        self._watchdogs: _Reports[WatchdogReport] = _Reports(watchdog_expiry_s, self._clock)
        if hasattr(self, "recycler"):
            self.recycler.configure(cfg.recycle)
        # (requests, errors) per router report, stamped when it came: the error window.
        self._outcomes: CountWindow[tuple[int, int]] = CountWindow(MAX_OUTCOME_BUCKETS, fields=2)
        # Cluster-wide fair-share counters (ballast.policies.fairness): every router's charges
        # merged as they arrive; one entry per configured tenant, kept across a redeploy.
        old = getattr(self, "_fair_counters", {})
        self._fair_counters: dict[str, float] = {t: old.get(t, 0.0) for t in cfg.tenants}
        self._quotas = {
            name: TenantQuota(
                rate_tokens_per_s=t.rate_tokens_per_s,
                burst_tokens=t.burst,
                max_concurrent=t.max_concurrent or cfg.resilience.bulkhead.per_tenant,
                weight=t.weight,
                sheddable=t.sheddable,
            )
            for name, t in cfg.tenants.items()
            if t.rate_tokens_per_s is not None
        }

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
        if got.requests:
            self._outcomes.add((got.requests, got.errors), self._clock())
        reply = {**self._snapshot.to_dict(), "leases": self.leases_for(got.router_id)}
        if self.cfg.fairness.enabled and self.cfg.fairness.shared:
            known = {t: v for t, v in got.fair_charged.items() if t in self._fair_counters}
            self._fair_counters = merge_reports(self._fair_counters, [known])
            reply["fair_counters"] = dict(self._fair_counters)
            reply["fair_share"] = self.fair_share(got.router_id)
        return reply

    def fair_share(self, router_id: str) -> Optional[float]:
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
        rates = effective_rates(
            self._quotas, totals, self._snapshot.level, tuple(q.level_factors), frozenset(q.lend_at_levels)
        )
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
    def request_recycle(
        self, replica_id: Optional[str], deployment: Optional[str], everyone: bool, by: str
    ) -> list[str]:
        known = {r.replica_id: r.deployment for r in self._replicas.fresh()}
        chosen = self.recycler.request(known, replica_id, deployment, everyone, by)
        self._record("recycle_requested", by, replicas=chosen)
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
                    "ready": r.ready and (wd is None or wd.ready),
                    "draining": r.draining,
                    "manual_recycle": rid in self.recycler.manual,
                    "watchdog": _watchdog_status(wd),
                }
            )
        n = self._snapshot.running_replicas.get(MODEL_DEPLOYMENT, 0)
        return {
            "replicas": rows,
            **self.recycler.summary(n),
            "events": list(self.recycler.events)[-50:],
            "leases": [lease.to_dict() for lease in self.recycler.leases.leases()],
        }

    # -- the tick --------------------------------------------------------------------
    def signals(self) -> LoadSignals:
        """The level's inputs from the fresh reports (ballast.policies.control.fold_reports)."""
        self._outcomes.expire(self._clock() - self.cfg.controller.error_window_s)
        requests, errors = self._outcomes.totals()
        return control.fold_reports(
            self._routers.fresh(),
            self._replicas.fresh(),
            MODEL_DEPLOYMENT,
            requests=requests,
            errors=errors,
        )

    def tick(self) -> Snapshot:
        self._expire_kill_switches()
        now = self._clock()
        sig = self.signals()
        routers, replicas_all = self._routers.fresh(), self._replicas.fresh()
        running_n = len(control.of_deployment(replicas_all, MODEL_DEPLOYMENT))
        watchdogs = {w.replica_id: w for w in self._watchdogs.fresh()}
        ongoing = control.ongoing_requests(routers, replicas_all, MODEL_DEPLOYMENT, sig.queue_length)
        step = self._policy.step(
            control.ControlInputs(
                signals=sig,
                ongoing_requests=float(ongoing),
                running_replicas=running_n,
                # The recycler's surge from the last tick (ballast.policies.recycle.surging).
                surging=MODEL_DEPLOYMENT in self.recycler.surging,
                serving_replicas=control.serving_replicas(replicas_all, watchdogs, MODEL_DEPLOYMENT),
            ),
            now,
        )
        decision, as_decision, desired_model = step.level, step.scale, step.desired_replicas
        targets = {MODEL_DEPLOYMENT: desired_model}
        ceilings = {MODEL_DEPLOYMENT: self._as_cfg.max_replicas}
        if self.cfg.fallback is not None:
            targets[FALLBACK_DEPLOYMENT] = ceilings[FALLBACK_DEPLOYMENT] = self.cfg.fallback.deployment.replicas
        try:
            self.recycler.tick(self._replicas.fresh(), watchdogs, targets, decision.level, ceilings)
        except Exception:  # recycling must never stop the control loop
            log.exception("recycle tick failed")
        self._snapshot = self._publish(
            decision=decision,
            signals=sig,
            desired={MODEL_DEPLOYMENT: desired_model},
            running={
                MODEL_DEPLOYMENT: running_n,
                ROUTER_DEPLOYMENT: len(self._routers.fresh()),
                **(
                    {FALLBACK_DEPLOYMENT: len(control.of_deployment(self._replicas.fresh(), FALLBACK_DEPLOYMENT))}
                    if self.cfg.fallback is not None
                    else {}
                ),
            },
            autoscale_info={
                MODEL_DEPLOYMENT: {
                    "mode": as_decision.mode,
                    "reason": as_decision.reason,
                    "ongoing_requests": ongoing,
                    "stable_desired": as_decision.stable_desired,
                    "panic_desired": as_decision.panic_desired,
                    "recycle_surge": step.recycle_surge,
                }
            },
        )
        return self._snapshot

    def _publish(self, decision, signals, desired, running, autoscale_info) -> Snapshot:
        self._version += 1
        level = decision.level if decision else 0
        return Snapshot(
            epoch=self.epoch,
            version=self._version,
            created_at_s=self._wall(),
            level=level,
            target_level=decision.target_level if decision else 0,
            reason=decision.reason if decision else "starting",
            constraints=self._deg_cfg.constraints[level].to_dict(),
            inputs=asdict(signals) if signals else {},
            desired_replicas=desired,
            running_replicas=running,
            autoscale=autoscale_info,
            kill_switches=[e.to_dict() for e in self._kill_switches.values()],
            adapters=[a.to_dict() for a in self._adapters.values()],
            chaos=dict(self._chaos),
            recycle_orders=dict(self.recycler.orders),
            recycle=self.recycler.summary(desired.get(MODEL_DEPLOYMENT, 0)),
        )

    # -- kill switch and chaos (admin, off the request path) -----------------------------
    def admin_state(self) -> dict[str, Any]:
        """What operators set, to persist: kill switches, run-time adapters, chaos settings,
        the audit trail."""
        return {
            "kill_switches": [e.to_dict() for e in self._kill_switches.values()],
            "adapters": [a.to_dict() for a in self._adapters.values()],
            "chaos": dict(self._chaos),
            "audit": list(self._audit),
        }

    def adopt_admin_state(self, state: Any) -> int:
        """Take back what a previous controller persisted; entries that are malformed or
        expired are dropped (logged), never fatal; a state written before adapters were
        kept has none. Returns the kill switches adopted."""
        if not isinstance(state, dict):
            raise ValueError(f"admin state: want an object, got {type(state).__name__}")
        now = self._wall()
        for raw in list(state.get("kill_switches") or [])[:MAX_KILL_SWITCHES]:
            try:
                entry = KillSwitchEntry.from_dict(raw)
            except (TypeError, ValueError) as exc:
                log.warning("dropped a persisted kill switch %r: %s", raw, exc)
                continue
            if not entry.expired(now):
                self._kill_switches[entry.id] = entry
        self._adopt_adapters(state.get("adapters"))
        for target, settings in dict(state.get("chaos") or {}).items():
            if target in CHAOS_TARGETS and isinstance(settings, dict):
                self._chaos[target] = dict(settings)
        self._audit.extend(e for e in list(state.get("audit") or [])[-MAX_AUDIT:] if isinstance(e, dict))
        self._record(
            "admin_state_adopted",
            "controller",
            kill_switches=len(self._kill_switches),
            adapters=len(self._adapters),
            chaos=sorted(self._chaos),
        )
        self._republish()
        return len(self._kill_switches)

    def _adopt_adapters(self, raw_entries: Any) -> None:
        """Take back the persisted run-time adapters (the first ``MAX_RUNTIME_ADAPTERS``);
        a malformed one is dropped (logged). One that no longer fits this config (its model
        gone) is kept: routers and replicas skip it, and an operator may delete it."""
        if not isinstance(raw_entries, list):
            return
        for raw in raw_entries[:MAX_RUNTIME_ADAPTERS]:
            try:
                entry = RuntimeAdapter.from_dict(raw)
            except (TypeError, ValueError) as exc:
                log.warning("dropped a persisted adapter %r: %s", raw, exc)
                continue
            self._adapters[entry.name] = entry

    def _republish(self) -> None:
        """Admin changes go out at once, not at the next tick: same decision, new version."""
        self.admin_dirty = True
        self._version += 1
        self._snapshot = replace(
            self._snapshot,
            version=self._version,
            created_at_s=self._wall(),
            kill_switches=[e.to_dict() for e in self._kill_switches.values()],
            adapters=[a.to_dict() for a in self._adapters.values()],
            chaos=dict(self._chaos),
        )

    def _record(self, action: str, by: str, **fields: Any) -> dict[str, Any]:
        event = {"at_s": round(self._wall(), 3), "action": action, "by": by, **fields}
        self._audit.append(event)
        log.warning("ballast.audit %s", json.dumps(event, sort_keys=True))
        return event

    def _expire_kill_switches(self) -> None:
        now = self._wall()
        for entry_id in [i for i, e in self._kill_switches.items() if e.expired(now)]:
            entry = self._kill_switches.pop(entry_id)
            self._record("kill_switch_expired", "controller", entry=entry.to_dict())
            self.admin_dirty = True

    def set_kill_switch(
        self, scope: str, value: Optional[str], reason: str, expires_in_s: float, set_by: str
    ) -> dict[str, Any]:
        """Add an entry; ValueError (naming the field) when it is malformed or the table is full."""
        killswitch.check_value(scope, value, self._kill_switch_names())
        self._expire_kill_switches()
        if len(self._kill_switches) >= MAX_KILL_SWITCHES:
            raise ValueError(f"scope: at most {MAX_KILL_SWITCHES} kill switches may be active")
        entry = KillSwitchEntry.create(
            uuid.uuid4().hex[:12], scope, value, reason, set_by, self._wall(), float(expires_in_s)
        )
        self._kill_switches[entry.id] = entry
        self._record("kill_switch_set", set_by, entry=entry.to_dict())
        self._republish()
        return entry.to_dict()

    def _kill_switch_names(self) -> dict[str, list[str]]:
        """What a valued kill switch may name: the configured tenants, models and classes."""
        models = [self.cfg.model.name] + ([self.cfg.fallback.model.name] if self.cfg.fallback is not None else [])
        return {"tenant": list(self.cfg.tenants), "model": models, "criticality": [c.value for c in Criticality]}

    def delete_kill_switch(self, entry_id: str, by: str) -> bool:
        entry = self._kill_switches.pop(entry_id, None)
        if entry is not None:
            self._record("kill_switch_deleted", by, entry=entry.to_dict())
            self._republish()
        return entry is not None

    def kill_switches(self) -> dict[str, Any]:
        self._expire_kill_switches()
        return {
            "entries": [e.to_dict() for e in self._kill_switches.values()],
            "audit": list(self._audit),
        }

    # -- LoRA adapters added at run time (the router's admin call loaded it on one replica first)
    def set_adapter(self, model: str, name: str, path: str, tenants: Optional[list[str]], by: str) -> dict[str, Any]:
        """Add a run-time adapter to the catalog every router and replica follows; ValueError
        (naming the field) when the catalog refuses it (``Catalog.with_adapter``: an unknown
        or non-vLLM model, a name taken or invalid, tenants outside the model's grant) or the
        table is full."""
        if name in self._adapters:
            raise ValueError(f"name: {name!r} is taken by an adapter added at run time; delete it first")
        if len(self._adapters) >= MAX_RUNTIME_ADAPTERS:
            raise ValueError(f"name: at most {MAX_RUNTIME_ADAPTERS} adapters may be added at run time")
        try:
            self.runtime_catalog().with_adapter(model, name, path, tenants)
        except CatalogError as e:
            raise ValueError(str(e)) from None
        entry = RuntimeAdapter.create(model, name, path, tenants, round(self._wall(), 3), by)
        self._adapters[name] = entry
        self._record("adapter_added", by, adapter=entry.to_dict())
        self._republish()
        return entry.to_dict()

    def delete_adapter(self, name: str, by: str) -> bool:
        """Remove a run-time adapter; False when none has that name (a config's adapter is
        none: it goes with the config)."""
        entry = self._adapters.pop(name, None)
        if entry is not None:
            self._record("adapter_deleted", by, adapter=entry.to_dict())
            self._republish()
        return entry is not None

    def adapters(self) -> list[dict[str, Any]]:
        return [a.to_dict() for a in self._adapters.values()]

    def runtime_catalog(self) -> Catalog:
        """The config's catalog with the run-time adapters that fit it."""
        return with_runtime(self.cfg.catalog(), list(self._adapters.values()))[0]

    def set_chaos(self, target: str, settings: dict[str, Any], by: str) -> dict[str, Any]:
        if target not in CHAOS_TARGETS:
            raise ValueError(f"target: must be one of {', '.join(CHAOS_TARGETS)}")
        self._chaos[target] = dict(settings)
        self._record("chaos_set", by, target=target, settings=settings)
        self._republish()
        return dict(self._chaos)

    def clear_chaos(self, by: str) -> None:
        self._chaos.clear()
        self._record("chaos_cleared", by)
        self._republish()


@ray.remote(num_cpus=0)
class Controller:
    """Ray actor around ``ControllerCore``: an async actor whose tick runs as a task."""

    def __init__(self, cfg: dict[str, Any]):
        self._core = ControllerCore(load_config(cfg))
        self._task: Optional[asyncio.Task] = None
        self._kv_key = f"ballast:{self._core.cfg.app_name}:recycle-leases".encode()
        self._admin_key = f"ballast:{self._core.cfg.app_name}:admin-state".encode()
        self._adopt_leases()
        self._adopt_admin()
        from ray.util import metrics  # created once, here (STYLE 8)

        self._m_level = metrics.Gauge("ballast_degradation_level", "Current degradation level (0-4).")
        self._m_queue = metrics.Gauge("ballast_queue_length", "Admitted requests not yet computing.")
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
            "Replica availability under recycling: expected (a rolling restart's formula) and measured.",
            tag_keys=("kind",),
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
                n = self._core.adopt_admin_state(json.loads(raw))
                log.warning("adopted %d kill switch(es), the adapters and chaos settings from a previous controller", n)
        except Exception:
            log.exception("could not read the persisted kill switches and chaos; starting without them")
        self._core.admin_dirty = False

    async def _persist_admin(self) -> None:
        """Write the admin state now (an admin call answers after it); on failure the next tick retries."""
        if not self._core.admin_dirty:
            return
        self._core.admin_dirty = False
        try:
            await asyncio.to_thread(_kv_put, self._admin_key, json.dumps(self._core.admin_state()).encode())
        except Exception:
            self._core.admin_dirty = True
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
        deps = [MODEL_DEPLOYMENT] + ([FALLBACK_DEPLOYMENT] if self._core.cfg.fallback is not None else [])
        for d in deps:
            self._m_in_flight.set(sum(1 for f in rec.state.in_flight if f.deployment == d), tags={"deployment": d})
            self._m_oldest.set(rec.oldest_in_flight_s(d), tags={"deployment": d})
        avail = rec.availability(self._core.desired(MODEL_DEPLOYMENT))
        for kind in ("expected", "measured"):
            if avail[kind] is not None:
                self._m_avail.set(avail[kind], tags={"kind": kind})

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                snap = self._core.tick()
                self._m_level.set(snap.level)
                self._m_queue.set(snap.inputs.get("queue_length", 0))
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

    async def request_recycle(self, replica_id, deployment, everyone, by) -> list[str]:
        return self._core.request_recycle(replica_id, deployment, bool(everyone), by)

    async def replica_status(self) -> dict[str, Any]:
        return self._core.replica_status()

    async def get_snapshot(self) -> dict[str, Any]:
        self._ensure_loop()
        return self._core.snapshot()

    async def ping(self) -> str:
        return self._core.epoch

    async def set_kill_switch(self, scope, value, reason, expires_in_s, set_by) -> dict[str, Any]:
        entry = self._core.set_kill_switch(scope, value, reason, expires_in_s, set_by)
        await self._persist_admin()
        return entry

    async def delete_kill_switch(self, entry_id: str, by: str) -> bool:
        deleted = self._core.delete_kill_switch(entry_id, by)
        await self._persist_admin()
        return deleted

    async def kill_switches(self) -> dict[str, Any]:
        return self._core.kill_switches()

    async def set_adapter(self, model, name, path, tenants, by) -> dict[str, Any]:
        entry = self._core.set_adapter(model, name, path, tenants, by)
        await self._persist_admin()
        return entry

    async def delete_adapter(self, name: str, by: str) -> bool:
        deleted = self._core.delete_adapter(name, by)
        await self._persist_admin()
        return deleted

    async def adapters(self) -> list[dict[str, Any]]:
        return self._core.adapters()

    async def set_chaos(self, target: str, settings: dict[str, Any], by: str) -> dict[str, Any]:
        chaos = self._core.set_chaos(target, settings, by)
        await self._persist_admin()
        return chaos

    async def clear_chaos(self, by: str) -> None:
        self._core.clear_chaos(by)
        await self._persist_admin()


def _kv_get(key: bytes) -> Optional[bytes]:
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


def ensure_controller(cfg: BallastConfig) -> "ray.actor.ActorHandle":
    """Get the named controller, creating it if absent; push this config to it."""
    handle = Controller.options(**controller_options(cfg)).remote(cfg.model_dump(mode="json"))
    handle.configure.remote(cfg.model_dump(mode="json"))
    return handle
