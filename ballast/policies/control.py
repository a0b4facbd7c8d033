"""The controller's tick as a policy: reports in, level and desired replicas out.

``ballast.control.controller.ControllerCore`` and the fleet simulator
(``loadtest.sim.controllers.BallastController``) both run this code; neither keeps
a copy of it. The glue gathers the fresh reports (expiry, bounds, the error
window's buckets) and applies the decision (snapshot, Serve's target).

* ``fold_reports``: replica and router reports become the level's inputs.
* ``ongoing_requests``: the autoscaler's concurrency input.
* ``routing_summary``: how the model's requests spread over its replicas (status, metrics).

Both are called once per model: with the routers' reports as that model sees them
(``model_views``: each report's ``RouterReport.load``), the replicas of that model's deployments
(``of_deployments``: its own and its fallback's) and its own deployment's name. A
model's level and replicas are then its own: flooding one model moves no other's.
* ``ControlPolicy.step``: ``degradation.decide`` + ``autoscale.decide`` + the
  recycle surge, exactly in the order the controller always ran them.

Reports are the typed messages of ``ballast.policies.reports``, checked when built and
again when the controller takes them in: counts >= 0, measures finite >= 0 or None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ballast.policies import autoscale, degradation, recycle
from ballast.policies.autoscale import AutoscaleConfig, AutoscaleDecision, AutoscaleSample, AutoscaleState
from ballast.policies.degradation import DegradationConfig, DegradationDecision, DegradationState, LoadSignals
from ballast.policies.reports import ModelLoad, ReplicaReport, RouterReport, WatchdogReport
from ballast.policies.validation import check_fields, check_int, check_non_negative


def of_deployment(replicas: Sequence[ReplicaReport], deployment: str) -> list[ReplicaReport]:
    """The replicas of one deployment."""
    return [r for r in replicas if r.deployment == deployment]


def of_deployments(replicas: Sequence[ReplicaReport], *deployments: str) -> list[ReplicaReport]:
    """The replicas of any of ``deployments`` (a model's own and its fallback's)."""
    return [r for r in replicas if r.deployment in deployments]


def engine_rows(replicas: Sequence[ReplicaReport], deployment: str) -> int | None:
    """The rows ``deployment``'s engines run usefully together (each replica's
    ``engine_rows``); None unless every replica of it reports one (an engine Ballast
    batches, or one whose steps do not say yet: the replicas' slots bound it alone)."""
    rows = [r.engine_rows for r in of_deployment(replicas, deployment)]
    if not rows or any(n is None for n in rows):
        return None
    return sum(n for n in rows if n is not None)


def model_views(routers: Sequence[RouterReport], model: str) -> list[ModelLoad]:
    """Every router's load of ``model`` (``RouterReport.load``: idle where it reported none)."""
    return [r.load(model) for r in routers]


def fold_reports(
    routers: Sequence[ModelLoad],
    replicas: Sequence[ReplicaReport],
    primary: str,
    requests: int = 0,
    errors: int = 0,
) -> LoadSignals:
    """The degradation level's inputs from the fresh reports.

    ``replicas`` holds every deployment's; queue and KV signals come from ``primary``
    only (the fallback's load is its own), GPU util and VRAM from all of them.
    ``requests``/``errors`` are the routers' outcomes over the error window.
    """
    check_int("requests", requests, minimum=0)
    check_int("errors", errors, minimum=0)
    mine = of_deployment(replicas, primary)
    running = sum(int(r.running) for r in mine)
    # Admitted but not yet computing: whatever routers have in flight minus what
    # replicas are running covers both the handle's queue and the batch queues.
    queue = sum(int(r.queued) for r in mine)
    if routers:
        queue = max(queue, sum(r.inflight for r in routers) - running)
    # Demand by criticality over the routers' windows, and their gates' answer rate
    # while full (capacity): absent unless some router's gate was full.
    demand: dict[str, float] = {}
    for r in routers:
        for crit, rps in r.demand_rps.items():
            demand[crit] = demand.get(crit, 0.0) + float(rps)
    sustained, recent_max = _recent_demand(routers)
    full = any(r.gate_full for r in routers)
    senders: list[ModelLoad | ReplicaReport] = [*routers, *mine]
    waits = [float(r.queue_wait_p95_ms) for r in senders if r.queue_wait_p95_ms is not None]
    utils = [float(r.gpu_util_pct) for r in replicas if r.gpu_util_pct is not None]
    kvs = [float(r.kv_util_pct) for r in mine if r.kv_util_pct is not None]
    vrams = [float(r.vram_pct) for r in replicas if r.vram_pct is not None]
    return LoadSignals(
        queue_length=max(0, queue),
        queue_wait_p95_ms=max(waits) if waits else None,  # the worst sender's p95
        gpu_util_pct=sum(utils) / len(utils) if utils else None,
        # The router spreads rows over the replicas: full when they are full on average.
        kv_util_pct=sum(kvs) / len(kvs) if kvs else None,
        vram_pct=max(vrams) if vrams else None,
        error_rate=(errors / requests) if requests else None,
        request_count=requests,
        demand_rps=demand or None,
        demand_sustained_rps=sustained,
        demand_recent_max_rps=recent_max,
        # Every router's answers are the model's work; they measure its capacity only
        # while some gate was pushing against it.
        capacity_rps=sum(float(r.served_rps) for r in routers) if full else None,
    )


def _recent_demand(routers: Sequence[ModelLoad]) -> tuple[dict[str, float] | None, dict[str, float] | None]:
    """The routers' last two report intervals' rates, summed by criticality; None (read the
    window instead) while a router that sees demand has not two reports of it yet."""
    if not routers or any(r.demand_rps and not r.demand_sustained_rps for r in routers):
        return None, None
    low: dict[str, float] = {}
    high: dict[str, float] = {}
    for r in routers:
        for crit, rps in r.demand_sustained_rps.items():
            low[crit] = low.get(crit, 0.0) + float(rps)
        for crit, rps in r.demand_recent_max_rps.items():
            high[crit] = high.get(crit, 0.0) + float(rps)
    return (low, high) if low or high else (None, None)


def ongoing_requests(
    routers: Sequence[ModelLoad], replicas: Sequence[ReplicaReport], primary: str, queue_length: int
) -> float:
    """Requests the primary deployment holds or is about to: the autoscaler's input.

    The larger of what its replicas report (running + queued) and what the level
    sees (queue + demand held at the routers' gates + running).
    """
    mine = of_deployment(replicas, primary)
    # No int() here: reports carry ints, and the simulator's running is a fluid (a float).
    running = sum(r.running for r in mine)
    held = sum(r.running + r.queued for r in mine)
    waiting = sum(r.gate_waiting for r in routers)
    return max(held, queue_length + waiting + running)


@dataclass(frozen=True)
class RoutingSummary:
    """How a model's requests are spread over its replicas, from the fresh reports.

    ``prefix_hit_ratio``: prompt tokens its replicas found in their prefix caches over those
    they looked up, since each started (vLLM's counters; None: no replica counts them).
    ``routed_by_prefix_ratio``: the requests the routers sent to a replica holding the start
    of their prompt over all they sent it, since each started (None: none sent yet).
    ``load_max_over_mean``: the most loaded replica's requests (running + queued) over the
    mean (None: fewer than two replicas, or none holds any)."""

    prefix_hit_ratio: float | None = None
    routed_by_prefix_ratio: float | None = None
    load_max_over_mean: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return {
            "prefix_hit_ratio": self.prefix_hit_ratio,
            "routed_by_prefix_ratio": self.routed_by_prefix_ratio,
            "load_max_over_mean": self.load_max_over_mean,
        }


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 3) if whole > 0 else None


def routing_summary(routers: Sequence[ModelLoad], replicas: Sequence[ReplicaReport], primary: str) -> RoutingSummary:
    """The model's ``RoutingSummary``: its routers' views (``model_views``), the replicas of
    its own deployment ``primary``."""
    mine = of_deployment(replicas, primary)
    counted = [r for r in mine if r.prefix_cache_queries is not None]
    queries = sum(r.prefix_cache_queries or 0 for r in counted)
    hits = sum(r.prefix_cache_hits or 0 for r in counted)
    routed = sum(sum(r.routed.values()) for r in routers)
    by_prefix = sum(r.routed.get("prefix", 0) for r in routers)
    loads = [float(r.running + r.queued) for r in mine]
    mean = sum(loads) / len(loads) if len(mine) >= 2 else 0.0
    return RoutingSummary(
        prefix_hit_ratio=_ratio(hits, queries) if counted else None,
        routed_by_prefix_ratio=_ratio(by_prefix, routed),
        load_max_over_mean=_ratio(max(loads), mean) if mean > 0 else None,
    )


def serving_replicas(replicas: Sequence[ReplicaReport], watchdogs: Mapping[str, WatchdogReport], primary: str) -> int:
    """Primary replicas taking traffic now (``ballast.policies.recycle.takes_traffic``): reporting,
    not draining for a recycle, not hung. Their shortfall against the target is the
    capacity gap the level does not shed for (ballast/policies/degradation.py)."""
    return sum(
        1
        for r in of_deployment(replicas, primary)
        if recycle.takes_traffic(r, watchdogs.get(r.replica_id), in_flight=False)
    )


def current_target(state: AutoscaleState, running_replicas: int, cfg: AutoscaleConfig) -> int:
    """The deployment's current target as the autoscaler must see it.

    It is what this controller last asked Serve for: running lags it both ways (a
    replica starting, a replica draining), and feeding running back in would undo a
    scale-down before Serve acts on it. Only a controller with no decision yet
    starts from running.
    """
    last = state.last_desired
    return last if last is not None else max(running_replicas, cfg.min_replicas)


@dataclass(frozen=True)
class ControlInputs:
    """One tick's inputs, already folded from the reports."""

    signals: LoadSignals
    ongoing_requests: float
    running_replicas: int  # primary replicas reporting now
    surging: bool = False  # the recycler wants one replica more (ballast.policies.recycle.surging)
    serving_replicas: int | None = None  # primary replicas taking traffic (serving_replicas); None: unknown

    def __post_init__(self) -> None:
        check_fields(self, check_non_negative, "ongoing_requests")
        check_fields(self, check_int, "running_replicas", minimum=0)
        if self.serving_replicas is not None:
            check_fields(self, check_int, "serving_replicas", minimum=0)


@dataclass(frozen=True)
class ControlState:
    degradation: DegradationState = field(default_factory=DegradationState)
    autoscale: AutoscaleState = field(default_factory=AutoscaleState)


@dataclass(frozen=True)
class ControlDecision:
    level: DegradationDecision  # degradation.decide's decision
    scale: AutoscaleDecision
    desired_replicas: int  # the autoscaler's answer plus the surge, within max_replicas
    recycle_surge: int  # what the surge added (0 or 1)


def control_step(
    inputs: ControlInputs,
    state: ControlState,
    deg_cfg: DegradationConfig,
    as_cfg: AutoscaleConfig,
    now_s: float,
) -> tuple[ControlDecision, ControlState]:
    """The controller's tick: the level, then the autoscaler, then the surge.

    The level sees the replicas serving against the target Serve was last asked for
    (the capacity gap: a replica recycled, killed or still starting), and whether a
    recycle of the primary is under way (the recycler's surge).
    """
    target = current_target(state.autoscale, inputs.running_replicas, as_cfg)
    signals = inputs.signals
    if inputs.serving_replicas is not None:
        signals = replace(signals, replicas_serving=inputs.serving_replicas, replicas_target=target)
    if inputs.surging:  # a recycle of the primary under way: what it costs is not demand
        signals = replace(signals, recycling=True)
    level, deg_state = degradation.decide(signals, state.degradation, deg_cfg, now_s)
    scale, as_state = autoscale.decide(
        AutoscaleSample(
            t_s=now_s, ongoing_requests=float(inputs.ongoing_requests), gpu_util_pct=inputs.signals.gpu_util_pct
        ),
        target,
        state.autoscale,
        as_cfg,
    )
    # The recycler's surge (from the last tick): one replica more while the primary has a
    # recycle waiting on min_available or in flight, or a replica its watchdog stopped.
    desired = min(as_cfg.max_replicas, scale.desired_replicas + (1 if inputs.surging else 0))
    return (
        ControlDecision(
            level=level, scale=scale, desired_replicas=desired, recycle_surge=desired - scale.desired_replicas
        ),
        ControlState(degradation=deg_state, autoscale=as_state),
    )


class ControlPolicy:
    """``control_step`` with its state held: what a controller calls once per tick."""

    def __init__(self, deg_cfg: DegradationConfig, as_cfg: AutoscaleConfig, state: ControlState | None = None) -> None:
        self.deg_cfg = deg_cfg
        self.as_cfg = as_cfg
        self.state = state or ControlState()

    def step(self, inputs: ControlInputs, now_s: float) -> ControlDecision:
        decision, self.state = control_step(inputs, self.state, self.deg_cfg, self.as_cfg, now_s)
        return decision
