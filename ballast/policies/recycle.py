"""Staggered replica recycling: which replicas to restart now, and which must wait.

A long-running replica rots (fragmented allocators, slow leaks, thread and fd growth),
so each is restarted periodically, a deployment's replicas one at a time, preferably in
a low-traffic window. This is that schedule as a pure function of what the controller
sees; ``ballast`` turns its orders into drains, each under a lease (``ballast.policies.lease``)
so that a crashed controller leaves no recycle half done.

**Triggers** (``due``), highest priority first: ``critical`` (a watchdog verdict that
cannot wait), ``forced_max_age`` (``forced_max_age_s`` old), ``manual``: these three are
forced; then ``watchdog`` (a non-critical request) and ``max_age`` (past the replica's
own threshold *and* inside the window; outside it, in ``Plan.waiting`` as "window").
The threshold is ``max_age_s`` × (1 ± ``jitter_ratio``), stable per id through
``zlib.crc32`` (``hash()`` is salted per process), so replicas started together do not
come due together and a restarted controller computes the same thresholds.

**Guards** (``plan``), per deployment, in this order for each due replica:

* ``max_unavailable`` recycles at a time. A recycle holds its slot until its replica is
  gone *and* the deployment is back to ``healthy_before``, its healthy count when the
  recycle started, the recycled replica counted healthy (capped by the autoscaler's
  current target): the next starts only after the previous replacement is healthy.
* ``level``: at degradation level ``block_at_level`` or above only forced orders pass.
* ``min_available``: the replicas serving, less those recycling and this one, stay ≥
  ``min_available``. A replica that still serves (intake stopped by its watchdog
  included) waits for its replacement, one serving nothing (draining, hung) does not,
  and a ``critical`` one waits only where a replacement can come (``ceilings``).

A recycle open ``recycle_timeout_s`` after it started goes to ``Plan.stuck`` and frees
its slot. The state holds only recycles in flight, at most ``max_unavailable`` per
deployment. Availability with one of N replicas down ``T_restart`` every ``T_period``
is ``1 − T_restart/(N·T_period)``; ``measured_availability`` is the same from observed
replica-seconds out.

Written by hand: Serve does not recycle healthy replicas, and a Kubernetes rolling
update knows neither the degradation level nor the watchdog verdicts.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ballast.policies.reports import ReplicaReport, WatchdogReport
from ballast.policies.validation import check_fields, check_finite, check_int, check_name, check_positive, is_number

#: Order reasons, highest priority first.
REASONS = ("critical", "forced_max_age", "manual", "watchdog", "max_age")
_PRIORITY = {reason: i for i, reason in enumerate(REASONS)}
#: Why a due replica was held back this tick.
WAIT_REASONS = ("max_unavailable", "level", "min_available", "window")


def _check_hour(name: str, value: object) -> None:
    if not is_number(value) or not 0 <= value < 24:
        raise ValueError(f"{name}: must be an hour of day in [0, 24), got {value!r}")


@dataclass(frozen=True)
class RecycleConfig:
    """Recycling settings. Defaults: 6 h, window 02:00–05:00, forced at 24 h."""

    #: None disables the age trigger.
    max_age_s: float | None = 6 * 3600.0
    #: Each replica's own age threshold lies in max_age × [1−j, 1+j], stable per replica id.
    jitter_ratio: float = 0.1
    #: Preferred low-traffic window, local hour of day, [start, end); None = any time.
    window_start_hour: float | None = 2.0
    #: May wrap around midnight (22 → 4).
    window_end_hour: float | None = 5.0
    #: Recycle at this age whatever the window or level; None disables.
    forced_max_age_s: float | None = 24 * 3600.0
    #: Recycles of one deployment at a time.
    max_unavailable: int = 1
    #: Healthy replicas that must remain.
    min_available: int = 1
    #: No recycles at this degradation level or above unless forced or critical.
    block_at_level: int = 3
    #: A recycle not complete by then is "stuck": reported, its slot freed.
    recycle_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_fields(self, check_positive, "max_age_s", optional=True)
        if not is_number(self.jitter_ratio) or not 0 <= self.jitter_ratio < 1:
            raise ValueError(f"jitter_ratio: must be in [0, 1), got {self.jitter_ratio!r}")
        if (self.window_start_hour is None) != (self.window_end_hour is None):
            raise ValueError("window_end_hour: window_start_hour and window_end_hour are set together (or both None)")
        if self.window_start_hour is not None:
            check_fields(self, _check_hour, "window_start_hour", "window_end_hour")
            # start == end could mean "never" or "always"; neither is worth guessing.
            if self.window_start_hour == self.window_end_hour:
                raise ValueError("window_end_hour: must differ from window_start_hour (set both to None for any time)")
        check_fields(self, check_positive, "forced_max_age_s", optional=True)
        if self.max_age_s is not None and self.forced_max_age_s is not None and self.forced_max_age_s < self.max_age_s:
            raise ValueError(f"forced_max_age_s: must be >= max_age_s ({self.max_age_s}), got {self.forced_max_age_s}")
        check_fields(self, check_int, "max_unavailable", minimum=1)
        check_fields(self, check_int, "min_available", "block_at_level", minimum=0)
        check_fields(self, check_positive, "recycle_timeout_s")


@dataclass(frozen=True)
class ReplicaView:
    """What the controller knows of one replica this tick."""

    replica_id: str
    deployment: str
    started_at_s: float  # wall clock
    healthy: bool  # reporting, ready and not draining
    request: str | None = None  # a watchdog's recycle request reason, if any
    critical: bool = False  # that request is critical (time-to-OOM short, VRAM critical)
    manual: bool = False  # an operator asked for it
    #: Takes traffic (``takes_traffic``): healthy, or only its intake stopped. None: as healthy.
    serving: bool | None = None

    def __post_init__(self) -> None:
        check_fields(self, check_name, "replica_id", "deployment")
        check_fields(self, check_finite, "started_at_s")
        if self.serving is None:
            object.__setattr__(self, "serving", self.healthy)


@dataclass(frozen=True)
class Order:
    """Begin recycling this replica."""

    replica_id: str
    deployment: str
    reason: str  # one of REASONS
    forced: bool  # bypasses the level block (critical, forced_max_age, manual)


@dataclass(frozen=True)
class InFlight:
    """A recycle that has been ordered and has not completed."""

    replica_id: str
    deployment: str
    reason: str
    started_at_s: float
    healthy_before: int  # healthy count of its deployment to get back to (see the module docstring)

    def __post_init__(self) -> None:
        check_fields(self, check_name, "replica_id", "deployment")
        if self.reason not in REASONS:
            raise ValueError(f"reason: must be one of {REASONS}, got {self.reason!r}")
        check_fields(self, check_finite, "started_at_s")
        check_fields(self, check_int, "healthy_before", minimum=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "deployment": self.deployment,
            "reason": self.reason,
            "started_at_s": self.started_at_s,
            "healthy_before": self.healthy_before,
        }


@dataclass(frozen=True)
class RecycleState:
    in_flight: tuple[InFlight, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"in_flight": [f.to_dict() for f in self.in_flight]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RecycleState:
        """Read back ``to_dict()`` output; ValueError on malformed input."""
        if not isinstance(d, Mapping) or not isinstance(d.get("in_flight"), list):
            raise ValueError("in_flight: must be a mapping with a list under 'in_flight'")
        out = []
        for raw in d["in_flight"]:
            if not isinstance(raw, Mapping) or set(raw) != {
                "replica_id",
                "deployment",
                "reason",
                "started_at_s",
                "healthy_before",
            }:
                raise ValueError(f"in_flight: malformed entry {raw!r}")
            out.append(InFlight(**raw))
        return cls(tuple(out))


@dataclass(frozen=True)
class Plan:
    start: tuple[Order, ...]  # begin these now
    completed: tuple[InFlight, ...]  # finished since the last plan
    stuck: tuple[InFlight, ...]  # timed out since the last plan
    waiting: tuple[tuple[str, str], ...]  # (replica_id, why not now): one of WAIT_REASONS


# --------------------------------------------------------------------------- triggers


def age_threshold_s(replica_id: str, cfg: RecycleConfig) -> float | None:
    """This replica's own max age: max_age × (1 + j × (2u − 1)), u from crc32(id) in [0, 1)."""
    if cfg.max_age_s is None:
        return None
    u = zlib.crc32(replica_id.encode("utf-8")) / 2**32
    return cfg.max_age_s * (1.0 + cfg.jitter_ratio * (2.0 * u - 1.0))


def in_window(hour_of_day: float, cfg: RecycleConfig) -> bool:
    """Whether ``hour_of_day`` (local, [0, 24)) lies in [start, end), wrapping past midnight."""
    _check_hour("hour_of_day", hour_of_day)
    start, end = cfg.window_start_hour, cfg.window_end_hour
    if start is None or end is None:
        return True
    if start < end:
        return start <= hour_of_day < end
    return hour_of_day >= start or hour_of_day < end


def _age_s(r: ReplicaView, now_s: float) -> float:
    # A wall clock that stepped back makes a replica young, never negative-aged.
    return max(0.0, now_s - r.started_at_s)


def _past_threshold(r: ReplicaView, cfg: RecycleConfig, now_s: float) -> bool:
    threshold_s = age_threshold_s(r.replica_id, cfg)
    return threshold_s is not None and _age_s(r, now_s) >= threshold_s


def due(r: ReplicaView, cfg: RecycleConfig, now_s: float, hour_of_day: float) -> Order | None:
    """The highest-priority reason to recycle ``r`` now, before the guards; None if none.

    ``r.critical`` counts as a critical request even without ``r.request``: a
    critical verdict is never dropped for a missing label.
    """
    age_s = _age_s(r, now_s)
    if r.critical:
        return Order(r.replica_id, r.deployment, "critical", True)
    if cfg.forced_max_age_s is not None and age_s >= cfg.forced_max_age_s:
        return Order(r.replica_id, r.deployment, "forced_max_age", True)
    if r.manual:
        return Order(r.replica_id, r.deployment, "manual", True)
    if r.request:
        return Order(r.replica_id, r.deployment, "watchdog", False)
    if _past_threshold(r, cfg, now_s) and in_window(hour_of_day, cfg):
        return Order(r.replica_id, r.deployment, "max_age", False)
    return None


# --------------------------------------------------------------------------- plan


def plan(
    replicas: Sequence[ReplicaView],
    targets: Mapping[str, int],
    state: RecycleState,
    level: int | Mapping[str, int],
    cfg: RecycleConfig,
    now_s: float,
    hour_of_day: float,
    ceilings: Mapping[str, int] | None = None,
) -> tuple[Plan, RecycleState]:
    """One control tick: settle the recycles in flight, then start what the guards allow.

    ``replicas``: every replica the controller sees now (unique ids);
    ``targets``: each deployment's current target replica count (autoscaler);
    ``ceilings``: the most replicas each deployment may have (a surge needs room;
    a deployment not named may surge);
    ``level``: the current degradation level, one for all deployments or one per
    deployment (each model's level for its own and its fallback's; a deployment not
    named takes the highest). Deterministic: deployments in name order, due replicas by
    priority, then oldest first, then id.
    """
    _check_levels(level)
    check_finite("now_s", now_s)
    _check_hour("hour_of_day", hour_of_day)
    by_deployment = _by_deployment(replicas)
    kept, completed, stuck = _settle(state.in_flight, by_deployment, targets, cfg, now_s)
    in_flight_ids = {f.replica_id for f in kept}
    start: list[Order] = []
    waiting: list[tuple[str, str]] = []
    new_in_flight: list[InFlight] = []
    for dep in sorted(by_deployment):
        rs = by_deployment[dep]
        # A surge needs room under the deployment's ceiling.
        can_surge = ceilings is None or ceilings.get(dep, len(rs) + 1) > len(rs)
        slots = cfg.max_unavailable - sum(1 for f in kept if f.deployment == dep)
        due_now, outside_window = _due(rs, in_flight_ids, cfg, now_s, hour_of_day)
        dep_level = _level_of(level, dep)
        _start_due(due_now, rs, in_flight_ids, slots, can_surge, dep_level, cfg, now_s, start, waiting, new_in_flight)
        waiting += [(r.replica_id, "window") for r in outside_window]
    new_state = RecycleState(tuple(kept) + tuple(new_in_flight))
    return Plan(tuple(start), tuple(completed), tuple(stuck), tuple(waiting)), new_state


def _check_levels(level: object) -> None:
    if isinstance(level, Mapping):
        for dep, lv in level.items():
            check_int(f"level[{dep!r}]", lv, minimum=0)
    else:
        check_int("level", level, minimum=0)


def _level_of(level: int | Mapping[str, int], deployment: str) -> int:
    """``deployment``'s level: the one level, its own, or (not named) the highest of them."""
    if not isinstance(level, Mapping):
        return level
    return level.get(deployment, max(level.values(), default=0))


def _by_deployment(replicas: Sequence[ReplicaView]) -> dict[str, list[ReplicaView]]:
    """The replicas by deployment; an id seen twice is an error."""
    by_deployment: dict[str, list[ReplicaView]] = {}
    present: set[str] = set()
    for r in replicas:
        if r.replica_id in present:
            raise ValueError(f"replicas: replica_id {r.replica_id!r} appears twice")
        present.add(r.replica_id)
        by_deployment.setdefault(r.deployment, []).append(r)
    return by_deployment


def _settle(
    in_flight: Sequence[InFlight],
    by_deployment: Mapping[str, list[ReplicaView]],
    targets: Mapping[str, int],
    cfg: RecycleConfig,
    now_s: float,
) -> tuple[list[InFlight], list[InFlight], list[InFlight]]:
    """(kept, completed, stuck): the recycles in flight settled. A recycle completes once
    its replica is gone and its deployment is back to as many healthy replicas as it had
    (or its target, if lower); completion wins over a timeout on the same tick."""
    present = {r.replica_id for rs in by_deployment.values() for r in rs}
    healthy = {dep: sum(1 for r in rs if r.healthy) for dep, rs in by_deployment.items()}
    kept: list[InFlight] = []
    completed: list[InFlight] = []
    stuck: list[InFlight] = []
    seen: set[str] = set()
    for f in in_flight:
        if f.replica_id in seen:  # never two entries for one replica
            continue
        seen.add(f.replica_id)
        if f.replica_id not in present:
            target = targets.get(f.deployment, f.healthy_before)
            if healthy.get(f.deployment, 0) >= min(f.healthy_before, target):
                completed.append(f)
                continue
        if now_s - f.started_at_s >= cfg.recycle_timeout_s:
            stuck.append(f)
            continue
        kept.append(f)
    return kept, completed, stuck


def _due(
    rs: Sequence[ReplicaView],
    in_flight_ids: set[str],
    cfg: RecycleConfig,
    now_s: float,
    hour_of_day: float,
) -> tuple[list[tuple[Order, ReplicaView]], list[ReplicaView]]:
    """(due now by priority, then oldest, then id; past a threshold but outside the window, oldest first)."""
    candidates: list[tuple[int, float, str, Order, ReplicaView]] = []
    outside_window: list[ReplicaView] = []
    for r in rs:
        if r.replica_id in in_flight_ids:
            continue
        order = due(r, cfg, now_s, hour_of_day)
        if order is not None:
            candidates.append((_PRIORITY[order.reason], r.started_at_s, r.replica_id, order, r))
        elif _past_threshold(r, cfg, now_s):
            outside_window.append(r)
    candidates.sort(key=lambda c: c[:3])
    return [(order, r) for *_, order, r in candidates], sorted(
        outside_window, key=lambda r: (r.started_at_s, r.replica_id)
    )


def _start_due(
    due_now: Sequence[tuple[Order, ReplicaView]],
    rs: Sequence[ReplicaView],
    in_flight_ids: set[str],
    slots: int,
    can_surge: bool,
    level: int,
    cfg: RecycleConfig,
    now_s: float,
    start: list[Order],
    waiting: list[tuple[str, str]],
    new_in_flight: list[InFlight],
) -> None:
    """Start each due replica the guards allow (slots, the level, min_available), in order;
    the others wait, with the guard that held them."""
    # Replicas that will still serve: those already recycling don't count.
    serving = sum(1 for r in rs if r.serving and r.replica_id not in in_flight_ids)
    for order, r in due_now:
        if slots <= 0:
            waiting.append((r.replica_id, "max_unavailable"))
        elif level >= cfg.block_at_level and not order.forced:
            waiting.append((r.replica_id, "level"))
        elif r.serving and serving - 1 < cfg.min_available and (order.reason != "critical" or can_surge):
            waiting.append((r.replica_id, "min_available"))
        else:
            start.append(order)
            # The count to get back to includes this replica's replacement, healthy.
            healthy_before = serving if r.serving else serving + 1
            new_in_flight.append(InFlight(r.replica_id, r.deployment, order.reason, now_s, healthy_before))
            slots -= 1
            if r.serving:
                serving -= 1


# --------------------------------------------------------------------------- availability


def expected_availability(n_replicas: int, restart_s: float, period_s: float) -> float | None:
    """(N−1)/N + (1 − T_restart/T_period)/N, clamped to [0, 1].

    None when there is no replica or no period. N = 4, 60 s every 6 h:
    1 − 60/(4 × 21600) ≈ 0.99931.
    """
    if not is_number(n_replicas) or not is_number(period_s) or n_replicas < 1 or period_s <= 0:
        return None
    if not is_number(restart_s) or not math.isfinite(restart_s) or restart_s < 0:
        raise ValueError(f"restart_s: must be a finite number >= 0, got {restart_s!r}")
    if math.isinf(period_s):
        return 1.0
    a_restart = 1.0 - restart_s / period_s
    a = (n_replicas - 1) / n_replicas + a_restart / n_replicas
    return min(1.0, max(0.0, a))


def measured_availability(out_s: float, replica_seconds: float) -> float | None:
    """1 − (replica-seconds out of service) / (replica-seconds in total), clamped to [0, 1]."""
    if not is_number(replica_seconds) or replica_seconds <= 0:
        return None
    if not is_number(out_s) or not math.isfinite(out_s) or out_s < 0:
        raise ValueError(f"out_s: must be a finite number >= 0, got {out_s!r}")
    return min(1.0, max(0.0, 1.0 - out_s / replica_seconds))


# --------------------------------------------------------------------------- the controller's side
# What ``ballast.control.recycling.RecycleCoordinator`` and the fleet simulator decide
# around ``plan``: which replica is healthy, which deployment surges, which hung
# replica is killed. Reports are the replicas' and watchdogs' own (``ballast.policies.reports``);
# a replica whose watchdog has not reported has ``None`` for it.

#: A hung replica is killed once; it is not killed again within this many seconds
#: (Serve needs that long to notice the dead actor and stop reporting it).
KILL_COOLDOWN_S = 60.0
#: Bound on the replicas remembered as killed.
MAX_KILLED = 256


def takes_traffic(report: ReplicaReport, watchdog: WatchdogReport | None, in_flight: bool) -> bool:
    """Capacity now: not draining, not hung, not being recycled.

    A replica whose watchdog stopped its intake still counts: the request router
    sends it work when no ready replica is left (ballast/model/routing.py), so
    recycling it before a replacement serves would leave nobody answering.
    """
    hung = watchdog is not None and watchdog.hung
    return not report.draining and not hung and not in_flight


def replica_healthy(report: ReplicaReport, watchdog: WatchdogReport | None, in_flight: bool) -> bool:
    """Serving now: ready by its own and its watchdog's word, not draining, not hung, not being recycled."""
    watchdog_ready = watchdog is None or (watchdog.ready and not watchdog.hung)
    return report.ready and not report.draining and watchdog_ready and not in_flight


def _started_at_s(report: ReplicaReport, watchdog: WatchdogReport | None, now_s: float) -> float:
    """When the replica started: its own word, else its watchdog's, else now (a replica just seen)."""
    for source in (report, watchdog):
        if source is not None and source.started_at_s is not None:
            return float(source.started_at_s)
    return now_s


def replica_view(
    report: ReplicaReport, watchdog: WatchdogReport | None, in_flight: bool, manual: bool, now_s: float
) -> ReplicaView:
    """The planner's view of one replica from its report and its watchdog's (None: not reported)."""
    request: str | None = None
    critical = False
    if watchdog is not None and watchdog.recycle_requested:
        request, critical = watchdog.reason or "watchdog", watchdog.critical
    return ReplicaView(
        replica_id=report.replica_id,
        deployment=report.deployment,
        started_at_s=_started_at_s(report, watchdog, now_s),
        healthy=replica_healthy(report, watchdog, in_flight),
        serving=takes_traffic(report, watchdog, in_flight),
        request=request,
        critical=critical,
        manual=manual,
    )


def surging(
    known: Mapping[str, str],
    watchdogs: Mapping[str, WatchdogReport],
    state: RecycleState,
    waiting: Sequence[tuple[str, str]],
    enabled: bool = True,
) -> frozenset[str]:
    """Deployments that want one replica more now (the surge; see ballast.control.recycling).

    ``known`` maps each reporting replica to its deployment. A deployment surges while
    a watchdog stopped one of its replicas' intake or asked for its recycle (the
    ladder's last rungs), or calls it hung (it is killed; the surge starts its
    replacement now rather than when Serve notices the dead actor), while one of its
    recycles waits on min_available, or while one is in flight.
    """
    if not enabled:
        return frozenset()
    stopping = {
        known[rid]
        for rid, wd in watchdogs.items()
        if rid in known and (not wd.ready or wd.recycle_requested or wd.hung)
    }
    held = {known[rid] for rid, why in waiting if why == "min_available" and rid in known}
    return frozenset(stopping | {f.deployment for f in state.in_flight} | held)


@dataclass(frozen=True)
class KillOrder:
    """Kill this hung replica's actor outright; Serve starts a replacement."""

    replica_id: str
    deployment: str
    actor_name: str
    namespace: str


@dataclass(frozen=True)
class KillState:
    killed: tuple[tuple[str, float], ...] = ()  # (replica_id, killed at), oldest first


def hung_kills(
    watchdogs: Mapping[str, WatchdogReport],
    state: KillState,
    now_s: float,
    cooldown_s: float = KILL_COOLDOWN_S,
    max_killed: int = MAX_KILLED,
) -> tuple[tuple[KillOrder, ...], KillState]:
    """Kill orders for replicas their watchdog calls hung, at once and outside the planner's limits.

    A hung replica serves nobody. A replica killed within ``cooldown_s`` is not killed
    again; one without an actor name (nothing to kill) is left alone.
    """
    check_finite("now_s", now_s)
    check_positive("cooldown_s", cooldown_s)
    check_int("max_killed", max_killed, minimum=1)
    killed = [(rid, t) for rid, t in state.killed if t >= now_s - cooldown_s]
    recent = {rid for rid, _ in killed}
    orders = []
    for rid, wd in watchdogs.items():
        if not wd.hung or rid in recent or not wd.actor_name:
            continue
        killed.append((rid, now_s))
        recent.add(rid)
        orders.append(KillOrder(rid, wd.deployment, wd.actor_name, wd.actor_namespace))
    return tuple(orders), KillState(tuple(killed[-max_killed:]))


@dataclass(frozen=True)
class RecycleStep:
    plan: Plan
    kills: tuple[KillOrder, ...]
    surging: frozenset[str]


def replica_views(
    replicas: Sequence[ReplicaReport],
    watchdogs: Mapping[str, WatchdogReport],
    state: RecycleState,
    manual: frozenset[str],
    now_s: float,
) -> list[ReplicaView]:
    """The planner's view of every reporting replica."""
    in_flight = {f.replica_id for f in state.in_flight}
    out = []
    for r in replicas:
        rid = r.replica_id
        out.append(replica_view(r, watchdogs.get(rid), rid in in_flight, rid in manual, now_s))
    return out


def recycle_step(
    views: Sequence[ReplicaView],
    watchdogs: Mapping[str, WatchdogReport],
    targets: Mapping[str, int],
    level: int | Mapping[str, int],
    state: RecycleState,
    kill_state: KillState,
    cfg: RecycleConfig,
    now_s: float,
    hour_of_day: float,
    surge: bool = True,
    ceilings: Mapping[str, int] | None = None,
) -> tuple[RecycleStep, RecycleState, KillState]:
    """One recycling tick: hung kills first (outside every limit), then the plan, then the surge.

    ``views`` (``replica_views``) must be built from ``state`` as it was before this call.
    ``ceilings``: each deployment's most replicas (``plan``); without the surge none has room.
    """
    kills, kill_state = hung_kills(watchdogs, kill_state, now_s)
    if not surge:
        ceilings = {v.deployment: 0 for v in views}
    p, state = plan(views, targets, state, level, cfg, now_s, hour_of_day, ceilings)
    known = {v.replica_id: v.deployment for v in views}
    return RecycleStep(p, kills, surging(known, watchdogs, state, p.waiting, surge)), state, kill_state
