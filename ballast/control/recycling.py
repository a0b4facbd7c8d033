"""The controller's side of recycling: watchdog reports in, recycle orders and kills out.

``RecycleCoordinator`` lives inside ``ControllerCore``. Each tick it

1. expires leases (``ballast.policies.lease``): a recycle lease left by a dead controller
   expires after three missed heartbeats, and this controller carries on;
2. runs ``ballast.policies.recycle.recycle_step``, where every decision lives: hung
   replicas (watchdog ``hung``) become kill orders at once, outside the planner's
   limits, with a cooldown (``hung_kills``); each replica's report and its
   watchdog's become a ``ReplicaView`` (``replica_view``: what counts as healthy);
   ``plan`` picks the recycles; ``surging`` says which deployment wants one more.
   This class applies the result: every recycle it starts takes a
   lease (TTL + heartbeat) that is persisted by the controller actor in Ray's KV
   store, so a restarted controller sees recycles in flight and respects
   ``max_unavailable`` until their leases lapse;
4. heartbeats its own leases and publishes the orders (replica → reason, lease,
   expiry) in the snapshot. A replica with a live order fails its health check,
   so Serve drains it and starts a replacement.

**Surge.** A deployment of one replica with ``min_available: 1`` could never recycle a
healthy replica (the guard would leave none serving), so an age-based recycle would
wait for ever. While a recycle of a deployment waits on ``min_available`` or is in
flight, or a watchdog has stopped a replica's intake or asked for its recycle (the
ladder's last rungs: the replacement then starts a rung early), ``surging`` names
the deployment and the controller asks Serve for one replica more
(within ``max_replicas``): the extra replica lets the recycle start, keeps the count
serving while the old one drains, and is given back when the recycle completes (a
rolling restart with a surge of one, as Kubernetes does it). ``recycle.surge: false``
turns this off.

It also keeps the availability account: the expected figure from a rolling
restart's formula for the configured schedule, and the measured one (time replicas were
out for recycles over replica-seconds observed). Everything here is bounded.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ballast.config import RecycleSettings
from ballast.policies import recycle
from ballast.policies.lease import LeaseLost, LeaseTable
from ballast.policies.recycle import InFlight, RecycleState
from ballast.policies.reports import ReplicaReport, WatchdogReport
from ballast.policies.window import CountWindow

log = logging.getLogger("ballast.recycle")

MAX_EVENTS = 200
LEASE_PREFIX = "recycle/"
RESTART_SAMPLES = 64  # recycle durations averaged into the restart time


def _hour_of_day(wall_s: float) -> float:
    t = time.localtime(wall_s)
    return t.tm_hour + t.tm_min / 60.0


class RecycleCoordinator:
    def __init__(self, settings: RecycleSettings, holder: str, wall: Callable[[], float]):
        self._wall = wall
        self.holder = holder  # the controller's epoch: a restarted controller is a new holder
        self.leases = LeaseTable()
        self.state = RecycleState()
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.new_events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)  # drained by the actor for metrics
        self.manual: OrderedDict[str, str] = OrderedDict()  # replica_id -> who asked
        self._kills = recycle.KillState()  # recently killed hung replicas (the cooldown)
        self.kill_orders: deque[dict[str, Any]] = deque(maxlen=recycle.MAX_KILLED)
        self.leases_dirty = False
        self.waiting: tuple[tuple[str, str], ...] = ()
        self.surging: frozenset[str] = frozenset()  # deployments that want one replica more now
        self.orders: dict[str, dict[str, Any]] = {}
        self._out_s = 0.0
        self._replica_s = 0.0
        # The last RESTART_SAMPLES recycle durations: their mean is the restart time the
        # expected availability uses (the configured estimate until one has completed).
        self._durations: CountWindow[float] = CountWindow(RESTART_SAMPLES)
        self._last_wall: float | None = None
        self.configure(settings)

    def configure(self, settings: RecycleSettings) -> None:
        self.settings = settings
        self.cfg = settings.recycle_config()

    # -- events ------------------------------------------------------------------------
    def _event(self, outcome: str, replica_id: str, deployment: str, reason: str, **extra: Any) -> None:
        e = {
            "at_s": round(self._wall(), 3),
            "outcome": outcome,
            "replica_id": replica_id,
            "deployment": deployment,
            "reason": reason,
            **extra,
        }
        self.events.append(e)
        self.new_events.append(e)
        log.warning("ballast.recycle %s %s/%s (%s)", outcome, deployment, replica_id, reason)

    # -- leases --------------------------------------------------------------------------
    @staticmethod
    def _resource(deployment: str, replica_id: str) -> str:
        return f"{LEASE_PREFIX}{deployment}/{replica_id}"

    def leases_dict(self) -> dict[str, Any]:
        return self.leases.to_dict()

    def adopt(self, data: dict[str, Any]) -> int:
        """Take over the lease table a previous controller persisted; its live recycles count as in flight."""
        table = LeaseTable.from_dict(data)
        now = self._wall()
        adopted = []
        for lease in table.leases():
            if lease.expired(now) or not lease.resource.startswith(LEASE_PREFIX):
                continue
            d = dict(lease.data)
            adopted.append(
                InFlight(
                    replica_id=d.get("replica_id", "?"),
                    deployment=d.get("deployment", "?"),
                    reason=d.get("reason", "?"),
                    started_at_s=lease.acquired_at_s,
                    healthy_before=int(d.get("healthy_before", "1")),
                )
            )
        self.leases = table
        self.state = RecycleState(in_flight=tuple(adopted))
        return len(adopted)

    def _drop(self, replica_id: str) -> None:
        self.state = replace(self.state, in_flight=tuple(f for f in self.state.in_flight if f.replica_id != replica_id))

    def _release(self, f: InFlight) -> None:
        lease = self.leases.get(self._resource(f.deployment, f.replica_id))
        if lease is not None and lease.holder == self.holder:
            self.leases.release(lease.id, self.holder)
            self.leases_dirty = True
        # A previous controller's lease is left to expire: only its holder may release it.

    # -- manual requests -------------------------------------------------------------------
    def request(
        self, known: dict[str, str], replica_id: str | None, deployment: str | None, everyone: bool, by: str
    ) -> list[str]:
        """Mark replicas for a manual recycle; ``known`` maps replica_id -> deployment."""
        if replica_id is not None:
            if replica_id not in known:
                raise ValueError(f"replica_id: no replica {replica_id!r} is reporting (see GET /admin/replicas)")
            chosen = [replica_id]
        else:
            chosen = [r for r, d in known.items() if everyone and (deployment is None or d == deployment)]
        for r in chosen:
            self.manual[r] = by
        # Bounded by the replicas that exist: forget marks for replicas that are gone.
        for r in [r for r in self.manual if r not in known]:
            del self.manual[r]
        return chosen

    # -- the tick --------------------------------------------------------------------------
    def tick(
        self,
        replicas: list[ReplicaReport],
        watchdogs: dict[str, WatchdogReport],
        targets: dict[str, int],
        level: int | Mapping[str, int],
        ceilings: dict[str, int] | None = None,
    ) -> None:
        """One recycling tick: leases that lapsed, the policy's step (hang kills, the plan,
        the surge), then what it settled, what it starts, and the orders it leaves."""
        now = self._wall()
        if self._last_wall is not None:
            self._replica_s += len(replicas) * max(0.0, now - self._last_wall)
        self._last_wall = now
        self._expire_leases(now)
        known = {r.replica_id: r.deployment for r in replicas}
        for r in [r for r in self.manual if r not in known]:
            del self.manual[r]
        views = recycle.replica_views(replicas, watchdogs, self.state, frozenset(self.manual), now)
        step, self.state, self._kills = recycle.recycle_step(
            views,
            watchdogs,
            targets,
            level,
            self.state,
            self._kills,
            self.cfg,
            now,
            _hour_of_day(now),
            self.settings.surge,
            ceilings,
        )
        for k in step.kills:
            self.kill_orders.append(
                {
                    "replica_id": k.replica_id,
                    "deployment": k.deployment,
                    "actor_name": k.actor_name,
                    "namespace": k.namespace,
                }
            )
            wd = watchdogs[k.replica_id]  # a kill order comes from its watchdog's report
            self._event(
                "killed_hung",
                k.replica_id,
                k.deployment,
                wd.hung_reason or "hung",
                heartbeat_age_s=wd.heartbeat_age_s,
                stalled_s=wd.stalled_s,
            )
        self.waiting, self.surging = step.plan.waiting, step.surging
        self._settled(step.plan, now)
        for o in step.plan.start:  # after the completions whose room they take
            self._start(o, now)
        self.orders = self._orders(now)

    def _expire_leases(self, now: float) -> None:
        """A recycle whose lease lapsed is dropped (another controller may own it now)."""
        for lease in self.leases.expire(now):
            d = dict(lease.data)
            rid = d.get("replica_id", "?")
            if any(f.replica_id == rid for f in self.state.in_flight):
                self._drop(rid)
                self._event("lease_expired", rid, d.get("deployment", "?"), d.get("reason", "?"), holder=lease.holder)
            self.leases_dirty = True

    def _settled(self, plan: Any, now: float) -> None:
        """Recycles the plan found completed or stuck: their leases released, their events recorded."""
        for f in plan.completed:
            took = max(0.0, now - f.started_at_s)
            self._out_s += took
            self._durations.add(took, now)
            self._release(f)
            self._event("completed", f.replica_id, f.deployment, f.reason, duration_s=round(took, 3))
        for f in plan.stuck:
            self._release(f)
            self._event("stuck", f.replica_id, f.deployment, f.reason, duration_s=round(now - f.started_at_s, 3))

    def _start(self, o: Any, now: float) -> None:
        """A recycle the plan starts, under a lease; dropped when another holds a live one."""
        f = next(f for f in self.state.in_flight if f.replica_id == o.replica_id)
        lease = self.leases.acquire(
            self._resource(o.deployment, o.replica_id),
            self.holder,
            now,
            self.settings.lease_ttl_s,
            self.settings.lease_heartbeat_s,
            uuid.uuid4().hex[:12],
            data=(
                ("replica_id", o.replica_id),
                ("deployment", o.deployment),
                ("reason", o.reason),
                ("healthy_before", str(f.healthy_before)),
            ),
        )
        if lease is None:  # someone else's live lease on it: leave it to them
            self._drop(o.replica_id)
            return
        self.leases_dirty = True
        self.manual.pop(o.replica_id, None)
        self._event("started", o.replica_id, o.deployment, o.reason)

    def _orders(self, now: float) -> dict[str, dict[str, Any]]:
        """Each recycle in flight with its live lease (heartbeaten when due): what replicas read."""
        orders = {}
        for f in self.state.in_flight:
            lease = self.leases.get(self._resource(f.deployment, f.replica_id))
            if lease is None:
                continue
            if lease.holder == self.holder and now - lease.last_heartbeat_s >= self.settings.lease_heartbeat_s:
                try:
                    lease = self.leases.heartbeat(lease.id, self.holder, now)
                    self.leases_dirty = True
                except LeaseLost:
                    continue
            orders[f.replica_id] = {
                "reason": f.reason,
                "deployment": f.deployment,
                "lease_id": lease.id,
                "expires_at_s": lease.expires_at_s(),
            }
        return orders

    # -- what the snapshot and /v1/status show ---------------------------------------------------
    def availability(self, per_deployment: Mapping[str, int]) -> dict[str, Any]:
        """The availability account: ``expected``, each deployment's for the schedule (a rolling
        restart's formula over its replicas in ``per_deployment``; None without a max age), and
        the fleet's ``measured`` one (replica time out for recycles over replica time), with
        the restart time both use and the measured one's parts."""
        restart_s = (
            (sum(self._durations) / len(self._durations)) if self._durations else self.settings.restart_estimate_s
        )
        period = self.settings.max_age_s or self.settings.forced_max_age_s
        expected: dict[str, float | None] = {}
        for deployment, n in per_deployment.items():
            a = recycle.expected_availability(n, restart_s, period) if period else None
            expected[deployment] = None if a is None else round(a, 6)
        measured = recycle.measured_availability(self._out_s, self._replica_s)
        return {
            "expected": expected,
            "measured": None if measured is None else round(measured, 6),
            "restart_s": round(restart_s, 3),
            "out_s": round(self._out_s, 3),
            "replica_s": round(self._replica_s, 3),
        }

    def summary(self, per_deployment: Mapping[str, int]) -> dict[str, Any]:
        """In flight, waiting, surging, and the availability account (``availability``) of the
        deployments in ``per_deployment`` (deployment -> its replicas)."""
        now = self._wall()
        out = {
            "in_flight": [
                {
                    "replica_id": f.replica_id,
                    "deployment": f.deployment,
                    "reason": f.reason,
                    "age_s": round(now - f.started_at_s, 3),
                }
                for f in self.state.in_flight
            ],
            "waiting": [list(w) for w in self.waiting[:20]],
            "surging": sorted(self.surging),
            "availability": self.availability(per_deployment),
        }
        return out

    def oldest_in_flight_s(self, deployment: str) -> float:
        now = self._wall()
        ages = [now - f.started_at_s for f in self.state.in_flight if f.deployment == deployment]
        return max(ages) if ages else 0.0
