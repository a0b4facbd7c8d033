"""``controller``, ``degradation``, ``autoscale`` and ``recycle``: the control loop and the
policies it runs."""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from ballast.config.base import Strict, frozen_config, ordered
from ballast.policies.criticality import Criticality
from ballast.policies.degradation import DEFAULT_CONSTRAINTS
from ballast.policies.recycle import RecycleConfig


class ControllerConfig(Strict):
    name: str = "ballast-controller"
    namespace: str = "ballast"
    tick_s: float = Field(default=0.5, gt=0, le=1.0)
    # How often routers and replicas push a report (and pull the snapshot back).
    report_interval_s: float = Field(default=0.5, gt=0, le=5)
    # A report older than this no longer counts (its sender is gone or stuck).
    report_expiry_s: PositiveFloat = 3.0
    # A snapshot older than this is stale: keep it up to max_stale_s, then fail static.
    snapshot_stale_s: PositiveFloat = 3.0
    snapshot_max_stale_s: PositiveFloat = 15.0
    # The conservative level used once the snapshot is older than snapshot_max_stale_s.
    fail_static_level: int = Field(default=1, ge=0, le=4)
    # Outcome window for the error rate.
    error_window_s: PositiveFloat = 10.0
    call_timeout_s: PositiveFloat = 1.0
    # Ray CPUs the controller and the shared idempotency key table ask for. Above 0 they
    # cannot land on a head started with --num-cpus=0 (cluster/cluster.yaml), so they
    # live on a worker and keep working while the head is down.
    num_cpus: float = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _stale_order(self) -> ControllerConfig:
        ordered(self, "snapshot_stale_s", "snapshot_max_stale_s")
        return self


class LevelConstraintsModel(Strict):
    max_tokens: PositiveInt
    max_batch_size: PositiveInt
    streaming: bool
    admitted: list[Criticality]


def _default_levels() -> list[LevelConstraintsModel]:
    return [LevelConstraintsModel(**c.to_dict()) for c in DEFAULT_CONSTRAINTS]


class DegradationSettings(Strict):
    queue_length_thresholds: tuple[int, int, int, int] = (50, 100, 200, 500)
    queue_wait_ms_thresholds: tuple[float, float, float, float] = (250.0, 500.0, 1000.0, 2000.0)
    # The primary replicas' KV token budget reserved, percent (llm-d sheds at 80).
    kv_util_pct_thresholds: tuple[float | None, float | None, float | None, float | None] = (
        80.0,
        90.0,
        97.0,
        None,
    )
    gpu_util_pct_thresholds: tuple[float | None, float | None, float | None, float | None] = (
        85.0,
        92.0,
        97.0,
        None,
    )
    vram_pct_thresholds: tuple[float | None, float | None, float | None, float | None] = (
        None,
        None,
        97.0,
        99.0,
    )
    error_rate_threshold: float = Field(default=0.1, gt=0, le=1)
    error_rate_min_requests: PositiveInt = 20
    # Shed a whole class at the door only when the classes kept fill the model by
    # themselves: level k when the demand of what it admits >= ratio x capacity
    # (ballast/policies/degradation.py). null: demand never asks for a level.
    demand_shed_ratio: float | None = Field(default=1.1, gt=0)
    # A level the demand rule reached from the routers' last two reports (a step) holds while
    # what it admits still asks for release_ratio x capacity at its last reports' peak, and
    # drops as soon as it does not (below demand_shed_ratio: the band keeps it from flapping).
    # null: such a level drops as any other, after stable_window_s.
    demand_release_ratio: float | None = Field(default=0.9, gt=0)
    # Routers measure demand by criticality and the gate's throughput over this window.
    demand_window_s: PositiveFloat = 5.0
    # The capacity demand is held against: the most the gates answered while full over this
    # long, so a host's stall of a few seconds does not read as a smaller model. 0: the
    # latest window alone.
    capacity_window_s: float = Field(default=30.0, ge=0)
    # HAProxy refuses, per class, what passes this x the model's measured capacity counting
    # the classes above it (the last second's arrivals): a crowd is cut at the edge before
    # the routers' reports have seen it. Above demand_shed_ratio. null: no such ceiling.
    edge_ceiling_ratio: float | None = Field(default=1.5, gt=0)
    # The ceiling's capacity is the peak measured per serving replica within this long.
    edge_capacity_memory_s: PositiveFloat = 3600.0
    stable_window_s: PositiveFloat = 30.0  # a lower target must hold this long; then the level drops to it
    # One report moves the level one up; a higher target asked for this long moves it all the way.
    up_confirm_s: PositiveFloat = 1.0
    # While fewer primary replicas serve than wanted (recycle, kill, crash, scale-up), queue
    # length, queue wait and demand hold the level but do not raise it, for at most
    # capacity_gap_max_s and capacity_gap_settle_s after (ballast/policies/degradation.py).
    capacity_gap_max_s: float = Field(default=120.0, ge=0)
    capacity_gap_settle_s: float = Field(default=10.0, ge=0)
    levels: list[LevelConstraintsModel] = Field(default_factory=_default_levels, min_length=5, max_length=5)


class AutoscaleSettings(Strict):
    target_ongoing_requests: PositiveFloat = 8.0
    target_gpu_util_pct: float | None = Field(default=80.0, gt=0, le=100)
    stable_window_s: PositiveFloat = 60.0
    panic_window_s: PositiveFloat = 6.0
    panic_threshold_ratio: PositiveFloat = 2.0
    scale_down_delay_s: float = Field(default=30.0, ge=0)
    max_scale_down_step: PositiveInt = 1
    # The Serve policy adapter trusts the controller's decision while it is younger than this.
    decision_max_age_s: PositiveFloat = 5.0


class RecycleSettings(Strict):
    """Staggered replica recycling run by the controller: a rolling restart, each recycle under a lease."""

    enabled: bool = True
    max_age_s: PositiveFloat | None = 6 * 3600.0  # null: no age trigger
    jitter_ratio: float = Field(default=0.1, ge=0, lt=1)  # each replica's age threshold spread by ± this
    window_start_hour: float | None = Field(
        default=2.0, ge=0, lt=24
    )  # preferred low-traffic window (local time); null: any time
    window_end_hour: float | None = Field(default=5.0, ge=0, lt=24)
    forced_max_age_s: PositiveFloat | None = 24 * 3600.0  # recycled at this age whatever the window or level
    max_unavailable: PositiveInt = 1
    min_available: int = Field(default=1, ge=0)
    # One replica more (within max_replicas) while a recycle of the primary waits on
    # min_available or is in flight: a lone replica can then be recycled, never leaving none.
    surge: bool = True
    block_at_level: int = Field(default=3, ge=0, le=5)  # no scheduled recycles at this level or above
    recycle_timeout_s: PositiveFloat = 600.0  # a recycle not complete by then is stuck (alert), its slot freed
    lease_ttl_s: PositiveFloat = 1800.0  # hard TTL of a recycle lease
    lease_heartbeat_s: PositiveFloat = 2.0  # the controller heartbeats its lease; 3 missed: expired
    restart_estimate_s: PositiveFloat = 60.0  # T_restart for the expected availability until one is measured

    @model_validator(mode="after")
    def _ages(self) -> RecycleSettings:
        if self.max_age_s and self.forced_max_age_s and self.forced_max_age_s < self.max_age_s:
            raise ValueError("forced_max_age_s must be >= max_age_s")
        if (self.window_start_hour is None) != (self.window_end_hour is None):
            raise ValueError("window_start_hour and window_end_hour are set together (or both null)")
        if self.window_start_hour is not None and self.window_start_hour == self.window_end_hour:
            raise ValueError("window_start_hour must differ from window_end_hour (null both for any time)")
        return self

    def recycle_config(self) -> RecycleConfig:
        """The planner's config; with ``enabled: false`` no age triggers (requested recycles still go)."""
        return frozen_config(
            RecycleConfig,
            self,
            max_age_s=self.max_age_s if self.enabled else None,
            forced_max_age_s=self.forced_max_age_s if self.enabled else None,
        )
