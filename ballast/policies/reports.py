"""What routers, model replicas and watchdogs report to the controller: typed messages.

Each report is a frozen dataclass built where it is sent (the router's report loop,
the replica's report loop, the watchdog's sampling loop), pickled by Ray across the
actor call, kept by the controller and read by the policies as fields
(``ballast.policies.control``, ``ballast.policies.recycle``). Nothing on the way parses a dict.

Every report checks itself when built (``__post_init__``): counts are numbers >= 0,
measures are finite numbers >= 0 or None (absent, never a made-up zero), names are
non-empty. Unpickling does not run ``__post_init__``, so the controller checks what
arrives once more (``checked``) and drops, and counts, anything else: a malformed
report never reaches a tick.

A field a sender may leave out has an explicit default here; ``as_dict`` gives the
JSON shape where a report is shown (``/admin/replicas``, a replica's ``stats``).
``WatchdogOrders`` goes the other way on the same node: a watchdog's answer to its
replica's heartbeat.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar, Protocol, TypeVar

from ballast.policies.catalog import name_problem
from ballast.policies.criticality import Criticality
from ballast.policies.validation import check_fields, check_finite, check_int, check_name, check_non_negative, is_finite

#: Serve's namespace, where it names replica actors (what a hung replica is killed by).
SERVE_NAMESPACE = "serve"
#: The most models one router report may carry a load for (``RouterReport.models``).
MAX_REPORTED_MODELS = 64
#: The most engine processes a replica hands its watchdog (``WatchedReplica.engine_processes``:
#: an engine core and a worker per rank, and its rank actors on the node), and the longest name
#: each may carry. The replica cuts its list to them (``bounded_processes``); a list past them
#: is refused where a report is built or checked.
MAX_ENGINE_PROCESSES = 256
MAX_PROCESS_NAME_CHARS = 128


class _Dataclass(Protocol):
    """Any dataclass instance (what ``dataclasses`` marks every one with), standard library only."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


R = TypeVar("R", bound=_Dataclass)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be a bool, got {value!r}")


def _check_optional_str(name: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name}: must be a str or None, got {value!r}")


def _check_processes(name: str, value: object) -> None:
    """A tuple of at most ``MAX_ENGINE_PROCESSES`` (pid, name) pairs: a positive int and a
    str of 1-``MAX_PROCESS_NAME_CHARS`` characters each (the count checked before the pairs)."""
    ok = (
        isinstance(value, tuple)
        and len(value) <= MAX_ENGINE_PROCESSES
        and all(
            isinstance(p, tuple)
            and len(p) == 2
            and isinstance(p[0], int)
            and not isinstance(p[0], bool)
            and p[0] > 0
            and isinstance(p[1], str)
            and 0 < len(p[1]) <= MAX_PROCESS_NAME_CHARS
            for p in value
        )
    )
    if not ok:
        raise ValueError(
            f"{name}: must be a tuple of at most {MAX_ENGINE_PROCESSES} (pid, name) pairs, names of "
            f"1-{MAX_PROCESS_NAME_CHARS} characters, got {reprlib.repr(value)}"
        )


def bounded_processes(processes: Sequence[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    """``processes`` within ``WatchedReplica``'s bounds: the first ``MAX_ENGINE_PROCESSES`` in
    the order given (the engine's own first, as a replica lists them), each name cut to
    ``MAX_PROCESS_NAME_CHARS`` characters."""
    return tuple((pid, name[:MAX_PROCESS_NAME_CHARS]) for pid, name in processes[:MAX_ENGINE_PROCESSES])


def _check_rates(name: str, rates: object, *, criticalities: bool) -> None:
    """A mapping of names to finite rates >= 0 (criticality names where ``criticalities``)."""
    if not isinstance(rates, Mapping):
        raise ValueError(f"{name}: must be a mapping, got {rates!r}")
    for key, rate in rates.items():
        if criticalities:
            try:
                Criticality(key)
            except ValueError:
                raise ValueError(f"{name}: unknown criticality {key!r}") from None
        elif not isinstance(key, str):
            raise ValueError(f"{name}: keys must be str, got {key!r}")
        if not is_finite(rate) or rate < 0:
            raise ValueError(f"{name}: {key!r} must be a finite number >= 0, got {rate!r}")


def _check_amounts(name: str, amounts: object) -> None:
    """A mapping of names to finite numbers (of any sign)."""
    if not isinstance(amounts, Mapping):
        raise ValueError(f"{name}: must be a mapping, got {amounts!r}")
    for key, amount in amounts.items():
        if not isinstance(key, str):
            raise ValueError(f"{name}: keys must be str, got {key!r}")
        if not is_finite(amount):
            raise ValueError(f"{name}: {key!r} must be a finite number, got {amount!r}")


def checked(report: Any, kind: type[R]) -> R | None:
    """``report`` checked again as a ``kind`` (its ``__post_init__`` run anew); None if it is not one."""
    if type(report) is not kind:
        return None
    try:
        return replace(report)
    except (TypeError, ValueError):
        return None


def _check_load(load: ModelLoad) -> None:
    """A ``ModelLoad``'s fields, checked (again, for one that was unpickled)."""
    check_fields(load, check_int, "inflight", "requests", "errors", "shed", "lost_capacity", "gate_waiting", minimum=0)
    check_fields(load, check_non_negative, "queue_wait_p95_ms", optional=True)
    check_fields(load, check_non_negative, "served_rps")
    check_fields(load, _check_bool, "gate_full")
    check_fields(load, _check_rates, "demand_rps", "demand_sustained_rps", "demand_recent_max_rps", criticalities=True)
    check_fields(load, _check_routed, "routed")


#: Why a request went to its replica (``ModelLoad.routed``'s keys).
ROUTE_REASONS = ("prefix", "home", "adapter", "balance")


def _check_routed(name: str, routed: object) -> None:
    if not isinstance(routed, Mapping) or not set(routed) <= set(ROUTE_REASONS):
        raise ValueError(f"{name}: a mapping of {ROUTE_REASONS} to counts, got {routed!r}")
    bad = {reason: n for reason, n in routed.items() if isinstance(n, bool) or not isinstance(n, int) or n < 0}
    if bad:
        raise ValueError(f"{name}: counts are ints >= 0, got {bad!r}")


@dataclass(frozen=True)
class ModelLoad:
    """One model's load as one router saw it since its last report: an entry of
    ``RouterReport.models``, and what the controller's policies read for that model."""

    inflight: int = 0  # requests this router holds now
    # Outcomes since the last report (the controller's error window sums them).
    requests: int = 0
    errors: int = 0
    shed: int = 0
    lost_capacity: int = 0  # attempts lost with their replica or node: not model errors
    queue_wait_p95_ms: float | None = None  # None: no request waited at the gate
    # The gate's view over its demand window (ballast.policies.gate.DemandWindow); a router
    # without a gate leaves them at their defaults.
    gate_waiting: int = 0
    demand_rps: Mapping[str, float] = field(default_factory=dict)  # offered, by criticality
    served_rps: float = 0.0
    gate_full: bool = False  # the gate was full for most of the window: served_rps is capacity
    # The lower and the higher offered rate of its last two report intervals, by
    # criticality (DemandWindow: a step seen within a second); empty until two reports.
    demand_sustained_rps: Mapping[str, float] = field(default_factory=dict)
    demand_recent_max_rps: Mapping[str, float] = field(default_factory=dict)
    # This router's requests to the model's replicas since it started, by why the replica
    # (ballast.model.routing: prefix, home, adapter, balance).
    routed: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_load(self)


#: The load of a model a router did not report: nothing held, nothing counted.
IDLE = ModelLoad()


def _check_models(name: str, models: object) -> None:
    """``RouterReport.models``: at most MAX_REPORTED_MODELS model names, each a ``ModelLoad``
    checked anew (an unpickled one never ran its ``__post_init__``)."""
    if not isinstance(models, Mapping):
        raise ValueError(f"{name}: must be a mapping, got {models!r}")
    if len(models) > MAX_REPORTED_MODELS:
        raise ValueError(f"{name}: at most {MAX_REPORTED_MODELS} models, got {len(models)}")
    for model, load in models.items():
        problem = name_problem(model) if isinstance(model, str) else f"{model!r} must be a str"
        if problem is not None:
            raise ValueError(f"{name}: model name {problem}")
        if type(load) is not ModelLoad:
            raise ValueError(f"{name}: {model!r} must be a ModelLoad, got {type(load).__name__}")
        try:
            _check_load(load)
        except ValueError as e:
            raise ValueError(f"{name}.{model}.{e}") from None


@dataclass(frozen=True)
class RouterReport:
    """One router replica's report, every report interval: its load since the last one.

    ``models`` holds every model the router serves, each alike: its ``ModelLoad`` by name.
    ``load(model)`` gives one model's (``IDLE`` for a model this router did not report).
    The tenant fields are the router's, not a model's: its demand by tenant (a tenant's
    quota holds across models), and the fair-share charges and tenants waiting at the one
    gate per router whose counters the controller shares (the default model's).
    """

    router_id: str
    models: Mapping[str, ModelLoad] = field(default_factory=dict)  # every model this router serves
    demand_tokens_per_s: Mapping[str, float] = field(default_factory=dict)  # by tenant (quota leases)
    # What the gate charged each tenant's fair-share counter since the last report
    # (ballast.policies.fairness; negative where refunds outweighed charges).
    fair_charged: Mapping[str, float] = field(default_factory=dict)
    fair_backlogged: tuple[str, ...] = ()  # tenants waiting at the gate now

    def __post_init__(self) -> None:
        check_fields(self, check_name, "router_id")
        check_fields(self, _check_models, "models")
        check_fields(self, _check_rates, "demand_tokens_per_s", criticalities=False)
        check_fields(self, _check_amounts, "fair_charged")
        if not isinstance(self.fair_backlogged, tuple) or not all(
            isinstance(t, str) and t for t in self.fair_backlogged
        ):
            raise ValueError(f"fair_backlogged: must be a tuple of tenant names, got {self.fair_backlogged!r}")

    def load(self, model: str) -> ModelLoad:
        """Model ``model``'s load in this report: ``IDLE`` when this router did not report it."""
        return self.models.get(model, IDLE)


@dataclass(frozen=True)
class ReplicaReport:
    """One model replica's report, every report interval: its batch, KV budget and device."""

    replica_id: str
    deployment: str
    role: str | None = None  # "primary" or "fallback"
    # Counts; the fleet simulator's fluid model sends running as a fraction.
    queued: float = 0
    running: float = 0
    batches: int = 0
    batch_size_avg: float | None = None
    batch_size_limit: int = 0
    kv_util_pct: float | None = None
    kv_tokens_reserved: int | None = None
    kv_tokens_budget: int | None = None
    queue_wait_p95_ms: float | None = None
    # An engine that schedules itself (vLLM): the requests waiting inside it (counted in
    # queued too) and its prefix cache's hit rate; None for engines Ballast batches.
    engine_waiting: int | None = None
    prefix_cache_hit_pct: float | None = None
    # ... and the rows it runs usefully: where more rows stop buying throughput, from its
    # own steps' times (ballast/policies/engine_curve.py); None until its steps say so.
    engine_rows: int | None = None
    # vLLM's own prefix-cache counters since its engine started: prompt tokens looked up,
    # and found (a hit rate over any span is the difference of two reports).
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    # The KV blocks this replica reports holding to the routers (prefix affinity); None
    # where it reports none.
    prefix_blocks: int | None = None
    # None where the replica has no GPU (absent, not 0).
    gpu_util_pct: float | None = None
    vram_pct: float | None = None
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None
    device: str | None = None  # "cpu" or "cuda:N"
    chaos_leaked_bytes: int = 0
    chaos_vram_leaked_bytes: int = 0
    chaos_vram_leak: str | None = None  # None, "leaking", or "no_gpu"
    chaos: Mapping[str, Any] | None = None  # the chaos settings it applies; None when none
    started_at_s: float | None = None  # wall clock
    ready: bool = True  # its watchdog's verdict as the replica applies it
    draining: bool = False  # a recycle order is live: its health check fails

    def __post_init__(self) -> None:
        check_fields(self, check_name, "replica_id", "deployment")
        check_fields(self, check_non_negative, "queued", "running")
        check_fields(
            self,
            check_non_negative,
            "queue_wait_p95_ms",
            "kv_util_pct",
            "gpu_util_pct",
            "vram_pct",
            "engine_waiting",
            "engine_rows",
            "prefix_cache_hit_pct",
            "prefix_cache_queries",
            "prefix_cache_hits",
            "prefix_blocks",
            optional=True,
        )
        check_fields(self, check_finite, "started_at_s", optional=True)
        check_fields(self, _check_bool, "ready", "draining")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WatchedReplica:
    """The replica a watchdog watches: what the replica tells its watchdog when it spawns it."""

    replica_id: str
    deployment: str
    started_at_s: float | None = None  # wall clock
    gpu_uuid: str | None = None  # the replica's GPU; None without one
    pid: int | None = None
    actor_name: str | None = None  # None outside Ray: then nothing can be killed
    actor_namespace: str = SERVE_NAMESPACE
    # The engine's own processes on the replica's node, (pid, name) as they name themselves
    # (vLLM: its engine core and one worker per rank, "VLLM::Worker_TP1"): sampled with the
    # replica, and one that goes away is named. Empty for an engine in the replica's process.
    # At most MAX_ENGINE_PROCESSES, names of MAX_PROCESS_NAME_CHARS (``bounded_processes``).
    engine_processes: tuple[tuple[int, str], ...] = ()
    # The engine's ranks hold the GPUs, the replica none (a model of several ranks on GPUs):
    # its VRAM is what those processes use of every GPU of the node.
    rank_gpus: bool = False

    def __post_init__(self) -> None:
        check_fields(self, check_name, "replica_id", "deployment")
        check_fields(self, check_finite, "started_at_s", optional=True)
        check_fields(self, _check_optional_str, "actor_name")
        check_fields(self, check_name, "actor_namespace")
        _check_processes("engine_processes", self.engine_processes)
        check_fields(self, _check_bool, "rank_gpus")


@dataclass(frozen=True)
class SeriesTrend:
    """One watched series' trend (ballast.policies.leak.Trend) as the watchdog reports it."""

    slope_per_h: float
    r2: float
    leaking: bool
    time_to_limit_s: float | None
    short_window: bool  # judged over the short (fast-burn) window


@dataclass(frozen=True)
class WatchdogReport(WatchedReplica):
    """One watchdog's report, every watchdog interval: the replica it watches (its fields
    first), that replica's process and the watchdog's verdicts."""

    at_s: float | None = None  # wall clock of the sample
    # The sampled series; None where they could not be read (absent, not 0).
    rss_bytes: float | None = None
    vram_bytes: float | None = None
    threads: float | None = None
    fds: float | None = None
    rss_limit_bytes: float | None = None
    vram_total_bytes: float | None = None
    fd_limit: int | None = None
    gpu_util_pct: float | None = None
    cpu_pct: float | None = None
    heartbeat_age_s: float | None = None  # since its last heartbeat arrived; None before the first
    stalled_s: float = 0.0  # the replica's work loop has not moved with work in flight (its own clock)
    warming_up: bool = False
    inflight: int = 0
    hung: bool = False  # stalled past hang_missed_heartbeats, or silent past silent_missed_heartbeats
    # "stalled", "silent" (ballast.policies.leak.hang_reason), or an engine process gone
    # ("engine process VLLM::Worker_TP1 (pid 123) exited": ballast.policies.leak.engine_lost_reason)
    hung_reason: str | None = None
    severity: str = "ok"
    reason: str | None = None  # what this sample found
    action_reason: str | None = None  # what made the ladder take its last rung
    ready: bool = True  # False: the ladder stopped the replica's intake
    recycle_requested: bool = False
    critical: bool = False  # the request cannot wait (time-to-OOM short, VRAM critical)
    trends: Mapping[str, SeriesTrend] = field(default_factory=dict)
    actions_total: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, check_int, "inflight", minimum=0)
        check_fields(
            self,
            check_non_negative,
            "rss_bytes",
            "vram_bytes",
            "threads",
            "fds",
            "heartbeat_age_s",
            "stalled_s",
            optional=True,
        )
        check_fields(self, _check_bool, "warming_up", "hung", "ready", "recycle_requested", "critical")

    @classmethod
    def of(cls, replica: WatchedReplica, **fields: Any) -> WatchdogReport:
        """A report about ``replica``: its identity, then the sample's ``fields``."""
        return cls(**asdict(replica), **fields)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WatchdogOrders:
    """A watchdog's answer to its replica's heartbeat: what the replica must do now.

    ``actions`` (``ballast.policies.leak.Action`` values: gc_collect, empty_cache, ...) are
    delivered once each; ``ready`` False stops the replica's intake.
    """

    actions: tuple[str, ...] = ()
    ready: bool = True
    recycle: bool = False  # the watchdog asked the controller for a recycle
    hung: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.actions, tuple) or not all(isinstance(a, str) for a in self.actions):
            raise ValueError(f"actions: must be a tuple of str, got {self.actions!r}")
        check_fields(self, _check_bool, "ready", "recycle", "hung")
