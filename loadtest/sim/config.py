"""The simulator's configuration, and the policy configs each arm runs with.

Ballast's arms use the production defaults (``ballast.config``'s seeds, built
here as the same frozen policy dataclasses) except for the few settings that
are *absolute counts* and so cannot be right for both a 4-replica deployment and
a 1,000-replica fleet. Those are scaled with the fleet and listed by
``fleet_scaled_settings`` so the report says so:

* degradation ``queue_length_thresholds`` (default 50/100/200/500 requests,
  sized for the default ``max_replicas = 4``): scaled by ``replicas_peak / 4``;
* autoscale ``max_scale_down_step`` (default 1 per 30 s, i.e. 120 replicas/h):
  ``ceil(replicas_peak / 100)``;
* recycle ``max_unavailable`` (default 1, i.e. ~40 recycles/h at a 90 s cold
  start): ``ceil(replicas_peak / 100)``.

With ``tenancy`` set (``TenancyConfig``), the requests belong to tenants and wait at
routers' gates in fair-share order (``tenants``); its ``lag_tokens`` is an absolute count
too and is scaled like the queue thresholds. Without it (the default) there is one FIFO.

The baselines get the same target load per replica as Ballast so that the
comparison is about the policies, not the targets: Ray Serve's queue-length
rule uses ``target_ongoing_requests = 8`` (Ray's own default is 2, which on a
batching model would run every replica at a quarter of its batch), and the
HPA rule targets the utilization a replica has at that same concurrency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ballast.config import FairnessSettings
from ballast.policies.autoscale import AutoscaleConfig
from ballast.policies.degradation import DegradationConfig
from ballast.policies.fairness import FairnessConfig
from ballast.policies.leak import LadderConfig, LeakConfig
from ballast.policies.recycle import RecycleConfig
from ballast.policies.validation import check_fields, check_fraction, check_int, check_positive

from .model import LoadProfile, ServiceModel

GIB = 2**30
MB = 2**20

#: Arms, in report order.
BALLAST = "ballast"
BALLAST_NO_RECYCLE = "ballast_no_recycle"
RAY_SERVE = "ray_serve_default"
HPA = "hpa_utilization"
ARMS: tuple[str, ...] = (BALLAST, BALLAST_NO_RECYCLE, RAY_SERVE, HPA)

#: Production's fair-share settings (``fairness:`` in the deployment config).
PRODUCTION_FAIRNESS = FairnessSettings()


@dataclass(frozen=True)
class TenantSpec:
    """A tenant: its weight, its share of the arrivals, what each of its requests costs,
    and the routers its traffic enters (split evenly among them)."""

    name: str
    weight: float = 1.0
    #: Relative to the other tenants' (normalized over them), in every class.
    arrival_share: float = 1.0
    prompt_tokens: int = 100
    #: Its max_tokens; every request generates all of them.
    output_tokens: int = 100
    routers: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tenant name: must not be empty")
        for name in ("weight", "arrival_share"):
            check_positive(f"{self.name}.{name}", getattr(self, name))
        for name in ("prompt_tokens", "output_tokens"):
            check_int(f"{self.name}.{name}", getattr(self, name), minimum=0)
        if not self.routers or len(set(self.routers)) != len(self.routers):
            raise ValueError(f"{self.name}.routers: must be distinct router indices, got {self.routers!r}")


@dataclass(frozen=True)
class TenancyConfig:
    """Tenants at routers' gates (``tenants.TenantLines``), with production's fairness knobs."""

    tenants: tuple[TenantSpec, ...]
    routers: int = 1
    #: ``fairness.enabled``: the counters order each class's waiters; off, the oldest goes first.
    enabled: bool = PRODUCTION_FAIRNESS.enabled
    #: ``fairness.shared``: the controller merges the counters and apportions the fleet among routers.
    shared: bool = PRODUCTION_FAIRNESS.shared
    fairness: FairnessConfig = field(default_factory=PRODUCTION_FAIRNESS.policy_config)
    #: None: production's ``fairness.lag_tokens`` scaled to the fleet (``SimConfig.fair_lag_tokens``).
    lag_tokens: float | None = None
    router_floor_ratio: float = PRODUCTION_FAIRNESS.router_floor_ratio
    #: Quanta a router grants per tick (at most, plus one per line it empties).
    grants_per_router: int = 16

    def __post_init__(self) -> None:
        if not self.tenants or len({t.name for t in self.tenants}) != len(self.tenants):
            raise ValueError("tenancy.tenants: must be one or more tenants with distinct names")
        check_int("tenancy.routers", self.routers, minimum=1)
        for t in self.tenants:
            if any(not isinstance(r, int) or not 0 <= r < self.routers for r in t.routers):
                raise ValueError(f"{t.name}.routers: must be in [0, {self.routers}), got {t.routers!r}")
        check_positive("tenancy.lag_tokens", self.lag_tokens, optional=True)
        if not 0 <= self.router_floor_ratio < 1:
            raise ValueError(f"tenancy.router_floor_ratio: must be in [0, 1), got {self.router_floor_ratio!r}")
        check_int("tenancy.grants_per_router", self.grants_per_router, minimum=1)


@dataclass(frozen=True)
class SimConfig:
    # ---- size and time
    #: Replicas the noon peak needs at the target concurrency.
    replicas_peak: int = 1000
    #: The cluster's bound on replicas, as a ratio of ``replicas_peak``.
    max_replicas_ratio: float = 1.2
    min_replicas: int = 1
    hours: float = 24.0
    #: Control tick: the controller (and the baselines' loops) decide once per tick.
    tick_s: float = 1.0
    #: Hour of day at t = 0.
    start_hour: float = 0.0

    # ---- requests
    slo_s: float = 1.0
    #: A request still queued this long after it arrived is given up (client timeout).
    timeout_s: float = 30.0
    #: Share of arrivals per criticality, in rank order (critical_plus … sheddable).
    mix: tuple[float, float, float, float] = (0.10, 0.40, 0.30, 0.20)
    service: ServiceModel = ServiceModel()
    load: LoadProfile = LoadProfile()
    #: Batch size of the baselines (Ballast's comes from the degradation level; level 0 = 32).
    max_batch_size: int = 32
    #: Per-replica running + queued requests every autoscaler aims for.
    target_ongoing_requests: float = 8.0

    # ---- replicas
    cold_start_s: tuple[float, float] = (60.0, 120.0)
    #: Mean time between hard failures of one replica (crash, node loss).
    mtbf_h: float = 1000.0
    #: Fraction of replicas that leak host memory at a constant rate.
    leak_fraction: float = 0.10
    #: A leaking replica's time from ready to OOM is lognormal: median and sigma (of ln).
    leak_tto_median_h: float = 8.0
    leak_tto_sigma: float = 0.6
    mem_limit_bytes: float = 64.0 * GIB
    #: Memory a fresh replica holds, as a ratio of the limit.
    mem_base_ratio: float = 0.5
    #: Replicas at t = 0 are a running fleet: process ages uniform in [0, this).
    initial_age_max_h: float = 6.0

    #: How often the Ballast arm runs the recycle planner (production: every controller tick).
    recycle_interval_s: float = 10.0
    #: One replica more while a recycle waits on min_available or is in flight, or a
    #: watchdog stopped a replica (production's ``recycle.surge``, default on).
    recycle_surge: bool = True

    # ---- baselines
    ray_upscale_delay_s: float = 30.0
    ray_downscale_delay_s: float = 600.0
    ray_look_back_s: float = 30.0
    hpa_sync_s: float = 15.0
    hpa_stabilization_s: float = 300.0
    hpa_tolerance: float = 0.1
    #: Metric window of the utilization the HPA reads (a scrape + rate window).
    hpa_metric_window_s: float = 30.0
    #: None: the utilization a replica has at ``target_ongoing_requests`` (same operating point).
    hpa_target_util_pct: float | None = None

    # ---- fleet-scaled Ballast settings (None: derived from replicas_peak, see module docstring)
    max_unavailable: int | None = None
    max_scale_down_step: int | None = None
    queue_length_scale: float | None = None

    #: Keep one ``TickRecord`` per tick in the Result (tests, plots); off for long runs.
    record_ticks: bool = False

    #: Tenants in fair-share order at routers' gates; None: the fleet's one FIFO.
    tenancy: TenancyConfig | None = None

    def __post_init__(self) -> None:
        check_fields(self, check_int, "replicas_peak", minimum=1)
        if self.max_replicas_ratio < 1:
            raise ValueError(f"max_replicas_ratio: must be >= 1, got {self.max_replicas_ratio!r}")
        if not isinstance(self.min_replicas, int) or not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas: must be an int in [0, max_replicas], got {self.min_replicas!r}")
        check_fields(
            self,
            check_positive,
            "hours",
            "tick_s",
            "slo_s",
            "timeout_s",
            "target_ongoing_requests",
            "mtbf_h",
            "leak_tto_median_h",
            "mem_limit_bytes",
            "ray_look_back_s",
            "hpa_sync_s",
            "hpa_metric_window_s",
            "recycle_interval_s",
        )
        if not 0 <= self.start_hour < 24:
            raise ValueError(f"start_hour: must be in [0, 24), got {self.start_hour!r}")
        if len(self.mix) != 4 or any(x < 0 for x in self.mix) or abs(sum(self.mix) - 1.0) > 1e-9:
            raise ValueError(f"mix: must be 4 shares >= 0 summing to 1, got {self.mix!r}")
        lo, hi = self.cold_start_s
        if not 0 < lo <= hi:
            raise ValueError(f"cold_start_s: must be (lo, hi) with 0 < lo <= hi, got {self.cold_start_s!r}")
        check_fields(self, check_fraction, "leak_fraction", "mem_base_ratio", "hpa_tolerance")
        if self.leak_tto_sigma < 0 or self.initial_age_max_h < 0:
            raise ValueError("leak_tto_sigma, initial_age_max_h: must be >= 0")
        if self.max_batch_size < 1 or self.ray_upscale_delay_s < 0 or self.ray_downscale_delay_s < 0:
            raise ValueError("max_batch_size >= 1 and Ray delays >= 0 required")
        if self.hpa_target_util_pct is not None and not 0 < self.hpa_target_util_pct <= 100:
            raise ValueError(f"hpa_target_util_pct: must be in (0, 100], got {self.hpa_target_util_pct!r}")
        for name in ("max_unavailable", "max_scale_down_step"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}: must be an int >= 1 or None, got {v!r}")
        check_fields(self, check_positive, "queue_length_scale", optional=True)

    # ---- derived
    @property
    def max_replicas(self) -> int:
        return math.ceil(self.replicas_peak * self.max_replicas_ratio)

    @property
    def n_ticks(self) -> int:
        return max(1, round(self.hours * 3600.0 / self.tick_s))

    @property
    def target_rate_per_replica(self) -> float:
        """Requests/s one replica serves at ``target_ongoing_requests`` (Little's law, level 0)."""
        b = self.target_ongoing_requests
        return b / self.service.service_s(b)

    @property
    def peak_rate_per_s(self) -> float:
        """Noon arrival rate: ``replicas_peak`` replicas at the target concurrency."""
        return self.replicas_peak * self.target_rate_per_replica

    def hpa_target(self) -> float:
        if self.hpa_target_util_pct is not None:
            return self.hpa_target_util_pct
        return 100.0 * self.target_rate_per_replica / self.service.max_rate_per_s(self.max_batch_size)

    def scaled_count(self, value: int | None) -> int:
        return value if value is not None else max(1, math.ceil(self.replicas_peak / 100))

    def queue_scale(self) -> float:
        return self.queue_length_scale if self.queue_length_scale is not None else max(1.0, self.replicas_peak / 4)

    def fair_lag_tokens(self) -> float:
        """``tenancy.lag_tokens``, else production's scaled like the queue thresholds."""
        if self.tenancy is not None and self.tenancy.lag_tokens is not None:
            return self.tenancy.lag_tokens
        return PRODUCTION_FAIRNESS.lag_tokens * self.queue_scale()


# --------------------------------------------------------------------------- policy configs


def degradation_config(cfg: SimConfig) -> DegradationConfig:
    base = DegradationConfig()
    k = cfg.queue_scale()
    return DegradationConfig(
        queue_length_thresholds=tuple(None if x is None else int(round(x * k)) for x in base.queue_length_thresholds),
    )


def autoscale_config(cfg: SimConfig) -> AutoscaleConfig:
    # No GPU utilization signal: the simulated replicas report none (as on a CPU host),
    # so the policy runs on concurrency alone; see the package docstring.
    return AutoscaleConfig(
        min_replicas=cfg.min_replicas,
        max_replicas=cfg.max_replicas,
        target_ongoing_requests=cfg.target_ongoing_requests,
        target_gpu_util_pct=None,
        max_scale_down_step=cfg.scaled_count(cfg.max_scale_down_step),
    )


def recycle_config(cfg: SimConfig) -> RecycleConfig:
    return RecycleConfig(max_unavailable=cfg.scaled_count(cfg.max_unavailable))


@dataclass(frozen=True)
class WatchdogModel:
    """The production watchdog's settings that the analytic leak verdict needs."""

    warmup_s: float = 120.0
    rss_leak_bytes_per_h: float = 30.0 * MB
    leak: LeakConfig = field(default_factory=LeakConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)


def fleet_scaled_settings(cfg: SimConfig) -> dict[str, str]:
    """The Ballast settings changed from the production defaults for this fleet size."""
    deg = degradation_config(cfg)
    return {
        "degradation.queue_length_thresholds": "/".join(str(x) for x in deg.queue_length_thresholds),
        "autoscale.max_scale_down_step": str(cfg.scaled_count(cfg.max_scale_down_step)),
        "recycle.max_unavailable": str(cfg.scaled_count(cfg.max_unavailable)),
    }
