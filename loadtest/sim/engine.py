"""``simulate(config, arm, seed) -> Result``: one arm over the whole run, tick by tick.

A tick ``[t, t + T)``:

1. the fleet moves on: starting replicas that are up become ready; replicas
   whose OOM or hard-failure time has come die, and the requests they were
   running (the batch of the previous tick) are lost; replicas drained by a
   recycle are gone;
2. the tick's arrivals (Poisson, the same for every arm of a seed) meet
   admission at the level decided at the end of the previous tick (Ballast;
   the baselines admit everything);
3. requests queued longer than ``timeout_s`` are given up; the fleet starts
   what its serving replicas can at the level's batch size (``fleet.RequestQueue``);
4. at ``t + T`` the arm's control loop decides (``controllers``) and Serve
   reconciles the fleet to the target.

Cost is replica-time allocated (starting, ready or draining), measured per tick.
Memory is bounded: the fleet's slot arrays, a queue of at most
``timeout_s / tick_s + 1`` cohorts, policy windows; per-tick records only
with ``record_ticks``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .config import ARMS, BALLAST, BALLAST_NO_RECYCLE, HPA, RAY_SERVE, SimConfig
from .controllers import BallastController, HpaController, RayServeController, TickView
from .fleet import DRAINING, READY, Fleet, RequestQueue, split
from .model import CLASSES


@dataclass(frozen=True)
class ClassStats:
    criticality: str
    arrivals: int
    shed: int
    served: int
    #: Served within the SLO (fractional: a chunk's share, see ``fleet.RequestQueue.serve``).
    served_in_slo: float
    timed_out: int
    #: Lost with a replica that died while running them.
    failed: int
    #: Still queued when the run ended.
    queued: int

    @property
    def slo_attainment(self) -> float:
        """Share of arrivals served within the SLO: sheds, timeouts and failures count against it."""
        return self.served_in_slo / self.arrivals if self.arrivals else 1.0


@dataclass(frozen=True)
class TickRecord:
    t_s: float
    level: int
    target: int
    live: int
    serving: int
    arrivals: tuple[int, ...]
    shed: tuple[int, ...]
    queued: int


@dataclass(frozen=True)
class Result:
    arm: str
    seed: int
    hours: float
    replicas_peak: int
    classes: tuple[ClassStats, ...]
    replica_hours: float
    peak_replicas: int
    recycles: int
    recycles_by_reason: tuple[tuple[str, int], ...]
    recycles_stuck: int
    oom_crashes: int
    hard_failures: int
    #: Seconds spent at each degradation level 0–4 (baselines: all at 0).
    level_seconds: tuple[float, ...]
    ticks: tuple[TickRecord, ...] = ()
    #: Wall time of the run; not part of equality (it is the only non-deterministic field).
    wall_s: float = field(default=0.0, compare=False)

    def total(self, name: str) -> float:
        return sum(getattr(c, name) for c in self.classes)

    @property
    def arrivals(self) -> int:
        return int(self.total("arrivals"))

    @property
    def slo_attainment(self) -> float:
        return self.total("served_in_slo") / self.arrivals if self.arrivals else 1.0

    @property
    def goodput_per_s(self) -> float:
        return self.total("served_in_slo") / (self.hours * 3600.0)

    def by_class(self, criticality: str) -> ClassStats:
        for c in self.classes:
            if c.criticality == criticality:
                return c
        raise KeyError(criticality)


def arrivals(cfg: SimConfig, seed: int) -> np.ndarray:
    """Arrivals per tick and class, shape (n_ticks, 4): identical for every arm of a seed."""
    n, T = cfg.n_ticks, cfg.tick_s
    mid_h = cfg.start_hour + (np.arange(n) + 0.5) * T / 3600.0
    ratio = np.array([cfg.load.ratio(h % 24.0) for h in mid_h.tolist()])
    lam = np.outer(ratio * cfg.peak_rate_per_s * T, np.asarray(cfg.mix))
    return np.random.default_rng([seed, 0]).poisson(lam)


def _controller(cfg: SimConfig, arm: str, fleet: Fleet):
    if arm == BALLAST:
        return BallastController(cfg, fleet, recycling=True)
    if arm == BALLAST_NO_RECYCLE:
        return BallastController(cfg, fleet, recycling=False)
    if arm == RAY_SERVE:
        return RayServeController(cfg)
    if arm == HPA:
        return HpaController(cfg)
    raise ValueError(f"arm: must be one of {', '.join(ARMS)}, got {arm!r}")


def simulate(cfg: SimConfig, arm: str, seed: int, arrivals_per_tick: np.ndarray | None = None) -> Result:
    """Run one arm. ``arrivals_per_tick`` may be passed to share one ``arrivals(cfg, seed)`` between arms."""
    wall0 = time.perf_counter()
    T = cfg.tick_s
    arr = arrivals(cfg, seed) if arrivals_per_tick is None else arrivals_per_tick
    if arr.shape != (cfg.n_ticks, 4):
        raise ValueError(f"arrivals_per_tick: must have shape {(cfg.n_ticks, 4)}, got {arr.shape}")
    arr_list = arr.tolist()
    svc = cfg.service

    # The fleet's own randomness is seeded apart from the arrivals, the same for every arm.
    fleet = Fleet(2 * cfg.max_replicas + 64, np.random.default_rng([seed, 1]), cfg)
    ctrl = _controller(cfg, arm, fleet)
    n0 = min(cfg.max_replicas, max(cfg.min_replicas, math.ceil(
        cfg.load.ratio(cfg.start_hour) * cfg.peak_rate_per_s / cfg.target_rate_per_replica)))
    ages = fleet.rng.uniform(0.0, cfg.initial_age_max_h * 3600.0, n0)
    fleet.start(n0, 0.0, age_s=ages)
    target = n0
    queue = RequestQueue()
    wants_p95 = isinstance(ctrl, BallastController)

    arrivals_c = [0] * 4
    shed_c = [0] * 4
    served_c = [0] * 4
    in_slo_c = [0.0] * 4
    timed_out_c = [0] * 4
    failed_c = [0] * 4
    last_served = [0] * 4
    last_in_slo = [0.0] * 4
    level_s = [0.0] * 5
    oom = hard = 0
    replica_s = 0.0
    peak = n0
    cap_carry = 0.0
    lost_carry = 0.0
    batch_prev = 0.0
    ticks: list[TickRecord] = []

    for j in range(cfg.n_ticks):
        t = j * T
        # 1. the fleet moves on
        fleet.promote(t)
        dead, was_oom, was_serving = fleet.reap(t)
        errors = 0
        if dead.size:
            ctrl.forget(dead)
            n_oom = int(np.count_nonzero(was_oom))
            oom += n_oom
            hard += dead.size - n_oom
            lost_f = batch_prev * int(np.count_nonzero(was_serving)) + lost_carry
            lost = min(int(lost_f), sum(last_served))
            lost_carry = lost_f - int(lost_f)
            if lost:
                gone = split(lost, last_served)
                for i in range(4):
                    if gone[i]:
                        share = last_in_slo[i] / last_served[i]
                        served_c[i] -= gone[i]
                        in_slo_c[i] -= gone[i] * share
                        failed_c[i] += gone[i]
                        last_in_slo[i] -= gone[i] * share
                        last_served[i] -= gone[i]
                errors += lost
        ctrl.forget(fleet.drained())
        live = int(np.count_nonzero(fleet.live_mask()))
        draining = fleet.count(DRAINING)
        replica_s += (live + draining) * T
        peak = max(peak, live)

        # 2. arrivals meet admission
        a = arr_list[j]
        ok = ctrl.admitted()
        admitted = [a[i] if ok[i] else 0 for i in range(4)]
        for i in range(4):
            arrivals_c[i] += a[i]
            shed_c[i] += a[i] - admitted[i]

        # 3. timeouts, then service
        gone = queue.expire(t - cfg.timeout_s)
        for i in range(4):
            timed_out_c[i] += gone[i]
        errors += sum(gone)
        queue.push(admitted, t, T)
        serving = int(np.count_nonzero(fleet.serving_mask()))
        max_batch, work = ctrl.batch_and_work()
        mu = serving * svc.max_rate_per_s(max_batch, work)
        cap_f = mu * T + cap_carry
        cap = int(cap_f)
        demand = queue.total
        started = min(demand, cap)
        cap_carry = cap_f - cap if demand >= cap else 0.0
        rate_per_replica = started / (serving * T) if serving else 0.0
        batch = svc.batch_for_rate(rate_per_replica, max_batch, work)
        service_s = svc.service_s(max(batch, 1.0), work)
        got = queue.serve(t, cap, mu, cfg.slo_s - service_s)
        for i in range(4):
            served_c[i] += got.counts[i]
            in_slo_c[i] += got.in_slo[i]
        last_served = got.counts
        last_in_slo = got.in_slo
        batch_prev = batch
        level_s[ctrl.level] += T

        if cfg.record_ticks:
            ticks.append(TickRecord(t, ctrl.level, target, live, serving, tuple(a),
                                    tuple(a[i] - admitted[i] for i in range(4)), queue.total))

        # 4. the control loop at t + T, then Serve reconciles
        wait_p95 = None
        if wants_p95:
            wait_p95 = got.wait_quantile_s(0.95)
            if wait_p95 is None and queue.total:
                wait_p95 = queue.head_wait_s(t + T)
        view = TickView(
            now_s=t + T,
            queued=queue.total,
            running=serving * batch,
            wait_p95_s=wait_p95,
            outcomes=sum(got.counts) + errors,
            errors=errors,
            served_per_s=started / T,
            ready=fleet.count(READY),
            serving=serving,
        )
        target = ctrl.decide(view, target)
        _, stopped = fleet.scale_to(target, t + T)
        if stopped.size:
            ctrl.forget(stopped)

    queued = queue.per_class()
    classes = tuple(
        ClassStats(
            criticality=CLASSES[i].value,
            arrivals=arrivals_c[i],
            shed=shed_c[i],
            served=served_c[i],
            served_in_slo=in_slo_c[i],
            timed_out=timed_out_c[i],
            failed=failed_c[i],
            queued=queued[i],
        )
        for i in range(4)
    )
    recycles = getattr(ctrl, "recycles", {})
    return Result(
        arm=arm,
        seed=seed,
        hours=cfg.n_ticks * T / 3600.0,
        replicas_peak=cfg.replicas_peak,
        classes=classes,
        replica_hours=replica_s / 3600.0,
        peak_replicas=peak,
        recycles=sum(recycles.values()),
        recycles_by_reason=tuple(sorted(recycles.items())),
        recycles_stuck=getattr(ctrl, "recycles_stuck", 0),
        oom_crashes=oom,
        hard_failures=hard,
        level_seconds=tuple(level_s),
        ticks=tuple(ticks),
        wall_s=time.perf_counter() - wall0,
    )
