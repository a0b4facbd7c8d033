"""Each arm's control loop: what it admits, how big a batch it runs, how many replicas it wants.

``BallastController`` is ``serve_app.control.controller.ControllerCore.tick`` and
``serve_app.control.recycling.RecycleCoordinator.tick`` replayed without Ray, calling
the same pure policies with the simulated clock:

* ``policies.degradation.decide`` on the tick's load signals (queue length,
  queue-wait p95, error rate; no GPU util or VRAM, see ``loadtest.sim``) sets
  the level, whose constraints the routers and replicas apply from the next
  tick on: ``policies.admission.admit`` per criticality, ``max_batch_size``, and
  the ``max_tokens`` clamp (as less work per request, ``ServiceModel.work_ratio``);
* ``policies.autoscale.decide`` on running + queued requests, fed its own last
  decision as the current target, exactly as the controller does;
* the watchdog: ``policies.leak.assess`` walks each leaking replica's action
  ladder. Its trend input is built **analytically** from the replica's known
  leak (a noise-free line: slope = the leak rate, R² = 1, judged once the
  samples after warm-up span ``min_span_ratio`` of the window) instead of
  feeding ``LeakDetector`` a sample per replica per second, which would not fit
  the time budget. A replica is only assessed when the verdict can be other
  than "ok, nothing to do" (within ``warn_tto_s`` of OOM, above the warning
  usage ratio, or already on the ladder), which skips no decision;
* ``policies.recycle.plan`` with every reporting replica, the autoscaler's
  target and the level; each recycle it starts drains the replica (Serve
  replaces it) and holds a ``policies.lease`` lease, heartbeated every tick and
  released when the plan reports it completed or stuck. The simulator has no
  controller crashes, so leases never lapse here. To fit the time budget the
  planner runs every ``recycle_interval_s`` (10 s) rather than every tick,
  which delays a recycle's start or completion by less than that (a recycle
  takes a cold start, 60–120 s); and it is skipped where it cannot start or
  settle anything (no recycle in flight, no watchdog request, nothing past its
  age threshold inside the window, nothing at the forced age), which changes
  no decision.

``RayServeController`` and ``HpaController`` wrap ``baselines``: no shedding,
a fixed batch, no watchdog, no recycling.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np

from policies import admission, autoscale, degradation, leak, recycle
from policies.autoscale import AutoscaleSample, AutoscaleState
from policies.degradation import DegradationState, LoadSignals
from policies.lease import LeaseTable
from policies.recycle import RecycleState, ReplicaView

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
    wait_p95_s: Optional[float]
    outcomes: int  # requests finished, failed or timed out this tick
    errors: int  # failed or timed out this tick
    served_per_s: float
    ready: int
    serving: int


class BallastController:
    def __init__(self, cfg: SimConfig, fleet: Fleet, recycling: bool) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.deg_cfg = degradation_config(cfg)
        self.as_cfg = autoscale_config(cfg)
        self.rc_cfg = recycle_config(cfg)
        self.wd = WatchdogModel()
        self.recycling = recycling
        self.deg_state = DegradationState()
        self.as_state = AutoscaleState()
        self.level = 0
        self.constraints = self.deg_cfg.constraints[0]
        # Watchdog: ladder state and recycle request per slot, only for replicas on the ladder.
        self.ladders: dict[int, leak.LadderState] = {}
        self.requests: dict[int, tuple[str, bool]] = {}
        # Recycling.
        self.rc_state = RecycleState()
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
    def decide(self, v: TickView, current_target: int) -> int:
        sig = LoadSignals(
            queue_length=v.queued,
            queue_wait_p95_ms=None if v.wait_p95_s is None else v.wait_p95_s * 1000.0,
            gpu_util_pct=None,
            vram_pct=None,
            error_rate=(v.errors / v.outcomes) if v.outcomes else None,
            request_count=v.outcomes,
        )
        dec, self.deg_state = degradation.decide(sig, self.deg_state, self.deg_cfg, v.now_s)
        self.level = dec.level
        self.constraints = dec.constraints

        last = self.as_state.last_desired
        current = last if last is not None else max(v.ready, self.as_cfg.min_replicas)
        ongoing = v.running + v.queued
        as_dec, self.as_state = autoscale.decide(
            AutoscaleSample(t_s=v.now_s, ongoing_requests=float(ongoing)), current, self.as_state, self.as_cfg
        )
        target = as_dec.desired_replicas
        if self.recycling:
            self._watchdog(v.now_s)
            self._recycle(v.now_s, target)
        return target

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
        window = wd.leak.window_s
        span = np.minimum(window, now_s - f.up_at[slots] - wd.warmup_s)
        width = window / wd.leak.max_points
        points = np.minimum(wd.leak.max_points, np.floor(np.maximum(span, 0.0) / width) + 1)
        judged = (span >= wd.leak.min_span_ratio * window - 1e-9) & (points >= wd.leak.min_points)
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
                )
            usage = [leak.Usage("rss_bytes", float(mem[k]), limit)]
            state = self.ladders.get(s, leak.LadderState())
            verdict, state = leak.assess(trends, usage, True, state, wd.ladder, now_s)
            self.ladders[s] = state
            f.intake[s] = verdict.ready
            if verdict.recycle:
                self.requests[s] = (verdict.reason or "watchdog", verdict.severity == "critical")

    # ---- recycling (serve_app.control.recycling.RecycleCoordinator.tick, minus Ray and metrics)
    def _hour(self, now_s: float) -> float:
        return (self.cfg.start_hour + now_s / 3600.0) % 24.0

    def _plan_can_act(self, now_s: float, present: np.ndarray) -> bool:
        if self.rc_state.in_flight or self.requests:
            return True
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

    def _recycle(self, now_s: float, target: int) -> None:
        f = self.fleet
        for lease in self.leases.leases():
            if now_s - lease.last_heartbeat_s >= self._lease_heartbeat_s:
                self.leases.heartbeat(lease.id, HOLDER, now_s)
        if now_s + 1e-9 < self._next_plan_s:
            return
        present = np.flatnonzero(f.state == READY)  # starting replicas do not report yet
        if not self._plan_can_act(now_s, present):
            return
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
            key = (rid, intake and rid not in in_flight, req)
            cached = self._views.get(s)
            if cached is None or cached[0] != key:
                view = ReplicaView(
                    replica_id=rid,
                    deployment=DEPLOYMENT,
                    started_at_s=born,
                    healthy=key[1],
                    request=None if req is None else req[0],
                    critical=False if req is None else req[1],
                )
                cached = (key, view)
                self._views[s] = cached
            views.append(cached[1])
        plan, self.rc_state = recycle.plan(
            views, {DEPLOYMENT: target}, self.rc_state, self.level, self.rc_cfg, now_s, self._hour(now_s)
        )
        for done in plan.completed + plan.stuck:
            lease = self.leases.get(f"recycle/{done.deployment}/{done.replica_id}")
            if lease is not None:
                self.leases.release(lease.id, HOLDER)
        self.recycles_stuck += len(plan.stuck)
        for order in plan.start:
            s = by_id[order.replica_id]
            self._lease_seq += 1
            self.leases.acquire(
                f"recycle/{order.deployment}/{order.replica_id}", HOLDER, now_s,
                ttl_s=1800.0, heartbeat_interval_s=self._lease_heartbeat_s, lease_id=f"l{self._lease_seq}",
                data=(("replica_id", order.replica_id), ("reason", order.reason)),
            )
            f.drain(s)
            self.recycles[order.reason] += 1


class RayServeController:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.level = 0
        self.policy = RayServeDefault(
            cfg.target_ongoing_requests, cfg.min_replicas, cfg.max_replicas,
            cfg.ray_upscale_delay_s, cfg.ray_downscale_delay_s, cfg.ray_look_back_s,
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
            cfg.hpa_target(), cfg.min_replicas, cfg.max_replicas, cfg.hpa_sync_s,
            cfg.hpa_stabilization_s, cfg.hpa_tolerance, cfg.hpa_metric_window_s,
        )

    def decide(self, v: TickView, current_target: int) -> int:
        # Utilization of a replica = its throughput over its saturated throughput;
        # summed over ready replicas that is the fleet's throughput over one replica's maximum.
        util_sum_pct = 100.0 * v.served_per_s / self._max_rate
        return self.policy.decide(v.now_s, util_sum_pct, v.ready, current_target)
