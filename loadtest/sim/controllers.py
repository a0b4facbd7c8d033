"""Each arm's control loop: what it admits, how big a batch it runs, how many replicas it wants.

``BallastController`` keeps no copy of the controller's tick: its
``policy_tick`` makes the same calls as ``ControllerCore.tick`` and
``RecycleCoordinator.tick``, in the same order, with the simulated clock
(tests/unit/test_control_trace.py feeds one recorded sequence of reports to both
and asserts identical decisions). What is the simulator's own is only how inputs
are gathered and outputs applied:

* the fleet's totals are one replica report (``fleet_report``): the policies sum
  over reports, so ``ballast.policies.control.fold_reports`` and ``ongoing_requests``
  give the inputs a thousand reports would (queue length, queue-wait p95, error
  rate; no GPU util or VRAM, see ``loadtest.sim``);
* ``ballast.policies.control.ControlPolicy.step`` runs ``ballast.policies.degradation.decide``
  (the level, whose constraints the routers and replicas apply from the next
  tick on: ``ballast.policies.admission.admit`` per criticality, ``max_batch_size``, and
  the ``max_tokens`` clamp as less work per request, ``ServiceModel.work_ratio``),
  ``ballast.policies.autoscale.decide`` fed its own last decision as the current target,
  and the recycle surge;
* the watchdog: ``ballast.policies.leak.assess`` walks each leaking replica's action
  ladder. Its trend input is built **analytically** from the replica's known
  leak (a noise-free line: slope = the leak rate, R² = 1, judged once the
  samples after warm-up span ``min_span_ratio`` of the long window, or
  ``short_min_span_s`` of the short one for a leak within ``short_horizon_s`` of
  its limit, as ``LeakDetector`` judges) instead of
  feeding ``LeakDetector`` a sample per replica per second, which would not fit
  the time budget. A replica is only assessed when the verdict can be other
  than "ok, nothing to do" (within ``warn_tto_s`` of OOM, above the warning
  usage ratio, or already on the ladder), which skips no decision;
* ``ballast.policies.recycle.recycle_step`` (hung kills, ``plan``, ``surging``) on one
  ``ballast.policies.recycle.replica_view`` per ready replica, built from the same report
  fields production reads (cached per replica while they do not change); the
  target it plans against includes the surge, as in production. Each recycle it
  starts drains the replica (Serve replaces it) and holds a ``ballast.policies.lease``
  lease, heartbeated every tick and released when the plan reports it completed
  or stuck. The simulator has no controller crashes, so leases never lapse here,
  and no hangs, so no kill is ever ordered. To fit the time budget the planner
  runs every ``recycle_interval_s`` (10 s) rather than every tick, which delays
  a recycle's start or completion by less than that (a recycle takes a cold
  start, 60–120 s); and it is skipped where it cannot start, settle or surge
  anything (no recycle in flight, no watchdog request or stopped intake, nothing
  past its age threshold inside the window, nothing at the forced age), which
  changes no decision.

``RayServeController`` and ``HpaController`` wrap ``baselines``: no shedding,
a fixed batch, no watchdog, no recycling.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ballast.policies import admission, control, leak, recycle
from ballast.policies.autoscale import AutoscaleConfig
from ballast.policies.degradation import DegradationConfig
from ballast.policies.lease import LeaseTable
from ballast.policies.recycle import RecycleConfig, RecycleState, ReplicaView
from ballast.policies.reports import ModelLoad, ReplicaReport, WatchdogReport

from .baselines import HpaUtilization, RayServeDefault
from .config import SimConfig, WatchdogModel, autoscale_config, degradation_config, recycle_config
from .fleet import READY, Fleet
from .model import CLASSES

DEPLOYMENT = "BallastModel"
HOLDER = "sim-controller"


@dataclass
class TickView:
    """What a control loop sees at the end of a tick."""

    now_s: float
    queued: int  # admitted, not yet computing
    running: float  # computing (Little's law: serving replicas × batch)
    wait_p95_s: float | None
    outcomes: int  # requests finished, failed or timed out this tick
    errors: int  # failed or timed out this tick
    served_per_s: float
    ready: int
    serving: int


class BallastController:
    def __init__(
        self,
        cfg: SimConfig,
        fleet: Fleet,
        recycling: bool,
        deg_cfg: DegradationConfig | None = None,
        as_cfg: AutoscaleConfig | None = None,
        rc_cfg: RecycleConfig | None = None,
    ) -> None:
        """The policies' configs default to ``cfg``'s fleet-scaled ones; a test may pass production's."""
        self.cfg = cfg
        self.fleet = fleet
        self.deg_cfg = deg_cfg or degradation_config(cfg)
        self.as_cfg = as_cfg or autoscale_config(cfg)
        self.rc_cfg = rc_cfg or recycle_config(cfg)
        self.wd = WatchdogModel()
        self.recycling = recycling
        self.policy = control.ControlPolicy(self.deg_cfg, self.as_cfg)
        self.level = 0
        self.constraints = self.deg_cfg.constraints[0]
        # Watchdog: ladder state and recycle request per slot, only for replicas on the ladder.
        self.ladders: dict[int, leak.LadderState] = {}
        self.requests: dict[int, tuple[str, bool]] = {}
        # Recycling.
        self.rc_state = RecycleState()
        self.kill_state = recycle.KillState()  # hangs are not modelled: never a kill, same code
        self.surging: frozenset[str] = frozenset()
        self.surge = cfg.recycle_surge
        self.leases = LeaseTable()
        self._views: dict[int, tuple[tuple, ReplicaView]] = {}
        self.recycles: Counter[str] = Counter()
        self.recycles_stuck = 0
        self._lease_seq = 0
        self._min_age_threshold_s = (
            None if self.rc_cfg.max_age_s is None else self.rc_cfg.max_age_s * (1.0 - self.rc_cfg.jitter_ratio)
        )
        # Leases are heartbeated once a tick; a coarser tick needs a longer interval.
        self._lease_heartbeat_s = max(2.0, cfg.tick_s)
        self._next_plan_s = 0.0

    # ---- what routers and replicas apply
    def admitted(self) -> list[bool]:
        return [admission.admit(c, self.level, self.constraints).admitted for c in CLASSES]

    def batch_and_work(self) -> tuple[int, float]:
        c = self.constraints
        return c.max_batch_size, self.cfg.service.work_ratio(c.max_tokens)

    def forget(self, slots: np.ndarray) -> None:
        for s in slots.tolist():
            self.ladders.pop(s, None)
            self.requests.pop(s, None)
            self._views.pop(s, None)

    # ---- the control tick
    def policy_tick(
        self,
        routers: Sequence[ModelLoad],  # the routers' loads of the model (control.model_views)
        replicas: list[ReplicaReport],
        requests: int,
        errors: int,
        running_replicas: int,
        now_s: float,
        views: list[ReplicaView] | None = None,
        watchdogs: dict[str, WatchdogReport] | None = None,
        wall_s: float | None = None,
        hour_of_day: float | None = None,
        serving_replicas: int | None = None,
    ) -> tuple[control.ControlDecision, recycle.RecycleStep | None]:
        """The controller's decisions on one tick's reports, through the production policies.

        ``ballast.policies.control`` folds the reports and runs the level, the autoscaler and the
        surge; ``ballast.policies.recycle.recycle_step`` (only when ``views`` is given) the hung
        kills, the plan and the surge for the next tick. The same calls, in the same
        order, as ``ballast.control.controller.ControllerCore.tick``; the trace test
        (tests/unit/test_control_trace.py) holds the two to identical decisions.
        """
        sig = control.fold_reports(routers, replicas, DEPLOYMENT, requests=requests, errors=errors)
        ongoing = control.ongoing_requests(routers, replicas, DEPLOYMENT, sig.queue_length)
        dec = self.policy.step(
            control.ControlInputs(
                sig,
                float(ongoing),
                running_replicas,
                surging=DEPLOYMENT in self.surging,
                serving_replicas=serving_replicas,
            ),
            now_s,
        )
        self.level = dec.level.level
        self.constraints = dec.level.constraints
        if views is None:
            return dec, None
        wall_s = now_s if wall_s is None else wall_s
        step, self.rc_state, self.kill_state = recycle.recycle_step(
            views,
            watchdogs or {},
            {DEPLOYMENT: dec.desired_replicas},
            self.level,
            self.rc_state,
            self.kill_state,
            self.rc_cfg,
            wall_s,
            self._hour(wall_s) if hour_of_day is None else hour_of_day,
            self.surge,
            {DEPLOYMENT: self.policy.as_cfg.max_replicas},
        )
        self.surging = step.surging
        return dec, step

    def decide(self, v: TickView, current_target: int) -> int:
        # The whole fleet as one replica report: the policies sum over reports, so one
        # report of the fleet's totals folds to the same inputs as a thousand reports.
        fleet_report = ReplicaReport(
            replica_id="fleet",
            deployment=DEPLOYMENT,
            queued=int(v.queued),
            running=float(v.running),
            queue_wait_p95_ms=None if v.wait_p95_s is None else float(v.wait_p95_s) * 1000.0,
        )
        if not self.recycling:
            dec, _ = self.policy_tick(
                [], [fleet_report], v.outcomes, v.errors, v.ready, v.now_s, serving_replicas=v.ready
            )
            return dec.desired_replicas
        # The watchdog runs before the plan, as it reports before the controller's tick.
        self._watchdog(v.now_s)
        views, by_id = self._recycle_views(v.now_s)
        dec, step = self.policy_tick(
            [],
            [fleet_report],
            v.outcomes,
            v.errors,
            v.ready,
            v.now_s,
            views=views,
            watchdogs=self._watchdog_reports(by_id) if views is not None else None,
            serving_replicas=v.ready,
        )
        if step is not None:
            self._apply(step, v.now_s, by_id)
        self._heartbeat(v.now_s)
        return dec.desired_replicas

    # ---- watchdog (one per replica in production; here only where it can act)
    def _watchdog(self, now_s: float) -> None:
        f, wd = self.fleet, self.wd
        slots = np.flatnonzero((f.state == READY) & (f.leak_rate > 0))
        if slots.size == 0:
            return
        limit = self.cfg.mem_limit_bytes
        mem = f.mem_bytes(slots, now_s)
        rate = f.leak_rate[slots]
        tto = np.maximum(0.0, (limit - mem) / rate)
        lk = wd.leak
        age = now_s - f.up_at[slots] - wd.warmup_s
        span = np.minimum(lk.window_s, age)
        points = np.minimum(lk.max_points, np.floor(np.maximum(span, 0.0) / (lk.window_s / lk.max_points)) + 1)
        judged_long = (span >= lk.min_span_ratio * lk.window_s - 1e-9) & (points >= lk.min_points)
        # The short (fast-burn) window, as ballast.policies.leak.LeakDetector judges it: once its
        # samples span short_min_span_s, for a leak within short_horizon_s of its limit.
        short_span = np.minimum(lk.short_window_s, age)
        short_points = np.minimum(
            lk.short_max_points, np.floor(np.maximum(short_span, 0.0) / (lk.short_window_s / lk.short_max_points)) + 1
        )
        judged_short = (
            (short_span >= lk.short_min_span_s - 1e-9) & (short_points >= lk.min_points) & (tto < lk.short_horizon_s)
        )
        short = judged_short & ~judged_long
        span = np.where(short, short_span, span)
        points = np.where(short, short_points, points)
        judged = judged_long | judged_short
        leaking = judged & (rate * 3600.0 >= wd.rss_leak_bytes_per_h)
        on_ladder = np.fromiter((s in self.ladders for s in slots.tolist()), dtype=bool, count=slots.size)
        near = (leaking & (tto < wd.ladder.warn_tto_s)) | (mem >= wd.ladder.warning_ratio * limit) | on_ladder
        for k in np.flatnonzero(near).tolist():
            s = int(slots[k])
            trends = {}
            if judged[k]:
                trends["rss_bytes"] = leak.Trend(
                    name="rss_bytes",
                    slope_per_h=float(rate[k] * 3600.0),
                    fitted_now=float(mem[k]),
                    r2=1.0,
                    points=int(points[k]),
                    span_s=float(span[k]),
                    judged=True,
                    leaking=bool(leaking[k]),
                    time_to_limit_s=float(tto[k]) if leaking[k] else None,
                    short=bool(short[k]),
                )
            usage = [leak.Usage("rss_bytes", float(mem[k]), limit)]
            state = self.ladders.get(s, leak.LadderState())
            verdict, state = leak.assess(trends, usage, True, state, wd.ladder, now_s)
            self.ladders[s] = state
            f.intake[s] = verdict.ready
            if verdict.recycle:
                self.requests[s] = (verdict.reason or "watchdog", verdict.severity == "critical")

    # ---- recycling (ballast.control.recycling.RecycleCoordinator.tick, minus Ray and metrics)
    def _hour(self, now_s: float) -> float:
        return (self.cfg.start_hour + now_s / 3600.0) % 24.0

    def _plan_can_act(self, now_s: float, present: np.ndarray) -> bool:
        if self.rc_state.in_flight or self.requests:
            return True
        if present.size and not bool(np.all(self.fleet.intake[present])):
            return True  # a watchdog stopped a replica's intake: the surge must be computed
        f, rc = self.fleet, self.rc_cfg
        if present.size == 0:
            return False
        oldest_s = now_s - float(np.min(f.born[present]))
        if rc.forced_max_age_s is not None and oldest_s >= rc.forced_max_age_s:
            return True
        return (
            self._min_age_threshold_s is not None
            and oldest_s >= self._min_age_threshold_s
            and recycle.in_window(self._hour(now_s), rc)
        )

    def _heartbeat(self, now_s: float) -> None:
        for lease in self.leases.leases():
            if now_s - lease.last_heartbeat_s >= self._lease_heartbeat_s:
                self.leases.heartbeat(lease.id, HOLDER, now_s)

    def _recycle_views(self, now_s: float) -> tuple[list[ReplicaView] | None, dict[str, int]]:
        """Every ready replica's view (``ballast.policies.recycle.replica_view``), or None when the
        plan may be skipped."""
        f = self.fleet
        if now_s + 1e-9 < self._next_plan_s:
            return None, {}
        present = np.flatnonzero(f.state == READY)  # starting replicas do not report yet
        if not self._plan_can_act(now_s, present):
            # Nothing in flight, asked, stopped or due: the plan would start nothing and
            # nothing surges (ballast.policies.recycle.surging over such a fleet is empty).
            self.surging = frozenset()
            return None, {}
        self._next_plan_s = now_s + self.cfg.recycle_interval_s
        in_flight = {x.replica_id for x in self.rc_state.in_flight}
        views = []
        by_id: dict[str, int] = {}
        for s, serial, intake, born in zip(
            present.tolist(), f.serial[present].tolist(), f.intake[present].tolist(), f.born[present].tolist()
        ):
            rid = f"r{serial}"
            by_id[rid] = s
            req = self.requests.get(s)
            key = (rid, intake, rid in in_flight, req)
            cached = self._views.get(s)
            if cached is None or cached[0] != key:
                # Built from the same report fields production reads, so the health rule is the policy's.
                cached = (
                    key,
                    recycle.replica_view(
                        ReplicaReport(replica_id=rid, deployment=DEPLOYMENT, started_at_s=born),
                        self._watchdog_report(rid, intake, req),
                        rid in in_flight,
                        False,
                        now_s,
                    ),
                )
                self._views[s] = cached
            views.append(cached[1])
        return views, by_id

    @staticmethod
    def _watchdog_report(rid: str, intake: bool, req: tuple[str, bool] | None) -> WatchdogReport:
        if req is None:
            return WatchdogReport(replica_id=rid, deployment=DEPLOYMENT, ready=bool(intake))
        reason, critical = req
        return WatchdogReport(
            replica_id=rid,
            deployment=DEPLOYMENT,
            ready=bool(intake),
            recycle_requested=True,
            reason=reason,
            critical=bool(critical),
        )

    def _watchdog_reports(self, by_id: dict[str, int]) -> dict[str, WatchdogReport]:
        """Watchdog reports of the replicas whose watchdog says something (stopped intake or a request)."""
        f = self.fleet
        out = {}
        for rid, s in by_id.items():
            if not f.intake[s] or s in self.requests:
                out[rid] = self._watchdog_report(rid, bool(f.intake[s]), self.requests.get(s))
        return out

    def _apply(self, step: recycle.RecycleStep, now_s: float, by_id: dict[str, int]) -> None:
        """Apply the plan: leases released and taken, replicas drained (Serve replaces them)."""
        plan = step.plan
        for done in plan.completed + plan.stuck:
            lease = self.leases.get(f"recycle/{done.deployment}/{done.replica_id}")
            if lease is not None:
                self.leases.release(lease.id, HOLDER)
        self.recycles_stuck += len(plan.stuck)
        for order in plan.start:
            s = by_id[order.replica_id]
            self._lease_seq += 1
            self.leases.acquire(
                f"recycle/{order.deployment}/{order.replica_id}",
                HOLDER,
                now_s,
                ttl_s=1800.0,
                heartbeat_interval_s=self._lease_heartbeat_s,
                lease_id=f"l{self._lease_seq}",
                data=(("replica_id", order.replica_id), ("reason", order.reason)),
            )
            f = self.fleet
            f.drain(s)
            self.recycles[order.reason] += 1


class RayServeController:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.level = 0
        self.policy = RayServeDefault(
            cfg.target_ongoing_requests,
            cfg.min_replicas,
            cfg.max_replicas,
            cfg.ray_upscale_delay_s,
            cfg.ray_downscale_delay_s,
            cfg.ray_look_back_s,
        )

    def admitted(self) -> list[bool]:
        return [True, True, True, True]

    def batch_and_work(self) -> tuple[int, float]:
        return self.cfg.max_batch_size, 1.0

    def forget(self, slots: np.ndarray) -> None:
        pass

    def decide(self, v: TickView, current_target: int) -> int:
        return self.policy.decide(v.now_s, v.running + v.queued, current_target)


class HpaController(RayServeController):
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.level = 0
        self._max_rate = cfg.service.max_rate_per_s(cfg.max_batch_size)
        self.policy = HpaUtilization(
            cfg.hpa_target(),
            cfg.min_replicas,
            cfg.max_replicas,
            cfg.hpa_sync_s,
            cfg.hpa_stabilization_s,
            cfg.hpa_tolerance,
            cfg.hpa_metric_window_s,
        )

    def decide(self, v: TickView, current_target: int) -> int:
        # Utilization of a replica = its throughput over its saturated throughput;
        # summed over ready replicas that is the fleet's throughput over one replica's maximum.
        util_sum_pct = 100.0 * v.served_per_s / self._max_rate
        return self.policy.decide(v.now_s, util_sum_pct, v.ready, current_target)
