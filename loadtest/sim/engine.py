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
   what its serving replicas can at the level's batch size (``fleet.RequestQueue``;
   with ``SimConfig.tenancy``, ``tenants.TenantLines``: routers' lines in fair-share
   order);
4. at ``t + T`` the arm's control loop decides (``controllers``; with tenants, the
   controller's fair-share step too) and Serve reconciles the fleet to the target.

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
from .tenants import TenantLines, TenantStats


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
    #: Per tenant, with ``SimConfig.tenancy`` (else empty).
    tenants: tuple[TenantStats, ...] = ()
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
    arr = arrivals(cfg, seed) if arrivals_per_tick is None else arrivals_per_tick
    if arr.shape != (cfg.n_ticks, 4):
        raise ValueError(f"arrivals_per_tick: must have shape {(cfg.n_ticks, 4)}, got {arr.shape}")
    run = _Run(cfg, arm, seed)
    for j, a in enumerate(arr.tolist()):
        run.tick(j * cfg.tick_s, a)
    return run.result(arm, seed, time.perf_counter() - wall0)


class _Run:
    """One arm through the run: its fleet, controller and queue, and the counters per class.

    ``tick`` takes the module docstring's four steps in order; the counters only grow
    (less what a dead replica took back), so ``result`` reads them once at the end.
    """

    def __init__(self, cfg: SimConfig, arm: str, seed: int) -> None:
        self.cfg, self.T, self.svc = cfg, cfg.tick_s, cfg.service
        # The fleet's own randomness is seeded apart from the arrivals, the same for every arm.
        self.fleet = Fleet(2 * cfg.max_replicas + 64, np.random.default_rng([seed, 1]), cfg)
        self.ctrl = _controller(cfg, arm, self.fleet)
        n0 = min(
            cfg.max_replicas,
            max(
                cfg.min_replicas,
                math.ceil(cfg.load.ratio(cfg.start_hour) * cfg.peak_rate_per_s / cfg.target_rate_per_replica),
            ),
        )
        ages = self.fleet.rng.uniform(0.0, cfg.initial_age_max_h * 3600.0, n0)
        self.fleet.start(n0, 0.0, age_s=ages)
        self.target = self.peak = n0
        self.tenants = None if cfg.tenancy is None else TenantLines(cfg.tenancy, cfg.fair_lag_tokens(), seed)
        self.queue: RequestQueue | TenantLines = RequestQueue() if self.tenants is None else self.tenants
        self.wants_p95 = isinstance(self.ctrl, BallastController)
        self.arrivals_c, self.shed_c, self.served_c = [0] * 4, [0] * 4, [0] * 4
        self.in_slo_c = [0.0] * 4
        self.timed_out_c, self.failed_c = [0] * 4, [0] * 4
        self.last_served, self.last_in_slo = [0] * 4, [0.0] * 4
        self.level_s = [0.0] * 5
        self.oom = self.hard = 0
        self.replica_s = self.cap_carry = self.lost_carry = self.batch_prev = 0.0
        self.ticks: list[TickRecord] = []
        self.live = n0

    def tick(self, t: float, a: list[int]) -> None:
        errors = self._fleet_moves(t)
        admitted = self._admit(a)
        errors += self._expire(t)
        got, started, batch, serving = self._serve(t, admitted)
        if self.cfg.record_ticks:
            self.ticks.append(
                TickRecord(
                    t,
                    self.ctrl.level,
                    self.target,
                    self.live,
                    serving,
                    tuple(a),
                    tuple(a[i] - admitted[i] for i in range(4)),
                    self.queue.total,
                )
            )
        self._control(t, got, started, batch, serving, errors)

    def _fleet_moves(self, t: float) -> int:
        """1. Replicas come up and die; a dead one's running batch is lost. Returns the requests lost."""
        fleet, ctrl = self.fleet, self.ctrl
        fleet.promote(t)
        dead, was_oom, was_serving = fleet.reap(t)
        errors = 0
        if dead.size:
            ctrl.forget(dead)
            n_oom = int(np.count_nonzero(was_oom))
            self.oom += n_oom
            self.hard += dead.size - n_oom
            errors = self._lose(self.batch_prev * int(np.count_nonzero(was_serving)) + self.lost_carry)
        ctrl.forget(fleet.drained())
        self.live = live = int(np.count_nonzero(fleet.live_mask()))
        self.replica_s += (live + fleet.count(DRAINING)) * self.T
        self.peak = max(self.peak, live)
        return errors

    def _lose(self, lost_f: float) -> int:
        """Take ``lost_f`` requests (the fraction carried over) back from the last tick's served, as failed."""
        lost = min(int(lost_f), sum(self.last_served))
        self.lost_carry = lost_f - int(lost_f)
        if lost:
            gone = split(lost, self.last_served)
            for i in range(4):
                if gone[i]:
                    share = self.last_in_slo[i] / self.last_served[i]
                    self.served_c[i] -= gone[i]
                    self.in_slo_c[i] -= gone[i] * share
                    self.failed_c[i] += gone[i]
                    self.last_in_slo[i] -= gone[i] * share
                    self.last_served[i] -= gone[i]
        return lost

    def _admit(self, a: list[int]) -> list[int]:
        """2. The tick's arrivals meet admission at the level decided last tick."""
        ok = self.ctrl.admitted()
        admitted = [a[i] if ok[i] else 0 for i in range(4)]
        for i in range(4):
            self.arrivals_c[i] += a[i]
            self.shed_c[i] += a[i] - admitted[i]
        return admitted

    def _expire(self, t: float) -> int:
        """3a. Requests queued past ``timeout_s`` are given up. Returns how many."""
        gone = self.queue.expire(t - self.cfg.timeout_s)
        for i in range(4):
            self.timed_out_c[i] += gone[i]
        return sum(gone)

    def _serve(self, t: float, admitted: list[int]) -> tuple:
        """3b. The serving replicas start what they can at the level's batch size."""
        T, svc, queue = self.T, self.svc, self.queue
        queue.push(admitted, t, T)
        serving = int(np.count_nonzero(self.fleet.serving_mask()))
        max_batch, work = self.ctrl.batch_and_work()
        mu = serving * svc.max_rate_per_s(max_batch, work)
        cap_f = mu * T + self.cap_carry
        cap = int(cap_f)
        demand = queue.total
        started = queue.startable(cap)
        self.cap_carry = cap_f - cap if demand >= cap else 0.0
        rate_per_replica = started / (serving * T) if serving else 0.0
        batch = svc.batch_for_rate(rate_per_replica, max_batch, work)
        service_s = svc.service_s(max(batch, 1.0), work)
        got = queue.serve(t, cap, mu, self.cfg.slo_s - service_s)
        for i in range(4):
            self.served_c[i] += got.counts[i]
            self.in_slo_c[i] += got.in_slo[i]
        self.last_served, self.last_in_slo = got.counts, got.in_slo
        self.batch_prev = batch
        self.level_s[self.ctrl.level] += T
        return got, started, batch, serving

    def _control(self, t: float, got, started: int, batch: float, serving: int, errors: int) -> None:
        """4. The control loop at t + T, then Serve reconciles the fleet to its target."""
        T, queue = self.T, self.queue
        if self.tenants is not None:
            self.tenants.control()
        wait_p95 = None
        if self.wants_p95:
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
            ready=self.fleet.count(READY),
            serving=serving,
        )
        self.target = self.ctrl.decide(view, self.target)
        _, stopped = self.fleet.scale_to(self.target, t + T)
        if stopped.size:
            self.ctrl.forget(stopped)

    def result(self, arm: str, seed: int, wall_s: float) -> Result:
        cfg, ctrl = self.cfg, self.ctrl
        queued = self.queue.per_class()
        classes = tuple(
            ClassStats(
                criticality=CLASSES[i].value,
                arrivals=self.arrivals_c[i],
                shed=self.shed_c[i],
                served=self.served_c[i],
                served_in_slo=self.in_slo_c[i],
                timed_out=self.timed_out_c[i],
                failed=self.failed_c[i],
                queued=queued[i],
            )
            for i in range(4)
        )
        recycles = getattr(ctrl, "recycles", {})
        return Result(
            arm=arm,
            seed=seed,
            hours=cfg.n_ticks * self.T / 3600.0,
            replicas_peak=cfg.replicas_peak,
            classes=classes,
            replica_hours=self.replica_s / 3600.0,
            peak_replicas=self.peak,
            recycles=sum(recycles.values()),
            recycles_by_reason=tuple(sorted(recycles.items())),
            recycles_stuck=getattr(ctrl, "recycles_stuck", 0),
            oom_crashes=self.oom,
            hard_failures=self.hard,
            level_seconds=tuple(self.level_s),
            ticks=tuple(self.ticks),
            tenants=() if self.tenants is None else self.tenants.stats(),
            wall_s=wall_s,
        )
