"""Degradation level: how far the service steps down its quality under load.

Five levels, 0 (normal) … 4 (emergency), each with constraints the router and the
replicas apply (largest ``max_tokens``, largest batch, streaming, criticalities
admitted). Each load signal (queue length, queue wait, KV cache use, GPU util, VRAM,
error rate, demand by criticality) asks for a level through its thresholds (the KV
cache enters level 1 at 80 %, as llm-d's saturation detector sheds at 0.8); the target
is the highest asked for. The level moves fast both ways, but only on evidence:

* **Up one level on one sample**, in the same tick, so shedding starts within one
  control tick. Further only once a target above the level has been asked for on every
  tick for ``up_confirm_s``: then straight to the lowest target of that streak. One slow
  report costs at most one level, for a moment.
* **Down after one stable window**: a lower target held, uninterrupted, for
  ``stable_window_s`` drops the level to the highest target of that window; a tick whose
  target is back at or above the level breaks the streak. This hysteresis keeps the
  level from flapping when shedding itself makes the signals look healthy.

**Missing capacity is not demand.** While the primary serves with fewer replicas than it
had (``DegradationState.serving_high``, never above the autoscaler's target) or one of
the controller's recycles is under way, and for ``capacity_gap_settle_s`` after, the
signals that waiting for the replacement inflates (queue length, queue wait, KV cache,
demand over capacity) may hold the level but not raise it: the replacement cures them,
shedding does not. A gap longer than ``capacity_gap_max_s`` is the new capacity. GPU
util, VRAM and the error rate are never held. A scale-up is no gap.

**Demand by criticality** picks which classes to shed. The gate already serves classes
in order while the model is full, so refusing a class at the door pays only when the
classes left fill the model by themselves: level ``k`` is asked for when the demand of
the classes it admits is at least ``demand_shed_ratio`` × the capacity (the gate's
answer rate while full). The ratio is above 1 because classes that are all served offer
about what is answered and must not read as filling the model. The capacity is the most
the gate answered while full over ``capacity_window_s``, not the last window alone: a
host that stalls for a few seconds answers less in that window, yet the model is no
smaller, and reading the dip as capacity shed half the traffic at 1 C for a whole
``stable_window_s`` (docs/benchmarks.md). BBR estimates a path's bottleneck bandwidth
the same way, as a windowed maximum of its delivery rate. A model that did get smaller
(a replica lost, a slower host) is read so once its old peak leaves the window; the
gate's limit and line protect it meanwhile.

Absent signals (``None``: no GPU, no traffic yet, a silent watchdog) are ignored, never
read as zero (hiding overload) nor as the maximum (shedding all on a CPU-only host).
Written by hand: no library offers a multi-signal, multi-level hysteresis with injected
time and these semantics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, NamedTuple

from ballast.policies.criticality import Criticality
from ballast.policies.levels import DEFAULT_CONSTRAINTS as DEFAULT_CONSTRAINTS
from ballast.policies.levels import MAX_LEVEL as MAX_LEVEL
from ballast.policies.levels import NUM_LEVELS as NUM_LEVELS
from ballast.policies.levels import LevelConstraints as LevelConstraints
from ballast.policies.levels import check_level as _check_level
from ballast.policies.validation import (
    check_fields,
    check_finite,
    check_int,
    check_non_negative,
    check_positive,
    check_ratio,
    is_finite,
)


def _fmt(value: float) -> str:
    # Compact numbers for reason strings: 230, 92.5, 0.15.
    return f"{value:g}"


# --------------------------------------------------------------------------- config

_THRESHOLD_FIELDS = (
    "queue_length_thresholds",
    "queue_wait_ms_thresholds",
    "kv_util_pct_thresholds",
    "gpu_util_pct_thresholds",
    "vram_pct_thresholds",
)


@dataclass(frozen=True)
class DegradationConfig:
    """Thresholds and per-level constraints.

    Each ``*_thresholds`` tuple holds the value that ENTERS levels 1, 2, 3, 4
    (``value >= threshold``). ``None`` means that signal alone never asks for
    that level (GPU util never asks for level 4; VRAM only matters at 97 %/99 %).
    Non-None entries must be strictly ascending.

    The constraints must get stricter (or stay equal) as the level rises; the
    fail-static rule "when unsure, use a higher level" relies on that.
    """

    queue_length_thresholds: tuple[int | None, ...] = (50, 100, 200, 500)
    queue_wait_ms_thresholds: tuple[float | None, ...] = (250.0, 500.0, 1000.0, 2000.0)
    #: The share of the primary replicas' KV token budget reserved (mean over replicas).
    kv_util_pct_thresholds: tuple[float | None, ...] = (80.0, 90.0, 97.0, None)
    gpu_util_pct_thresholds: tuple[float | None, ...] = (85.0, 92.0, 97.0, None)
    vram_pct_thresholds: tuple[float | None, ...] = (None, None, 97.0, 99.0)
    error_rate_threshold: float = 0.1
    #: The level an error rate at or above the threshold asks for (3: critical).
    error_rate_level: int = 3
    #: Below this many requests in the window the error rate is noise; ignored.
    error_rate_min_requests: int = 20
    #: Level k is asked for when the demand of the classes it admits >= this × capacity
    #: (above 1, so that classes that are all being served never qualify).
    #: None: demand never asks for a level.
    demand_shed_ratio: float | None = 1.1
    #: A level the demand rule reached on the routers' last two reports holds while the
    #: classes it admits ask at least this × capacity at their recent peak, and drops at
    #: once below it (below ``demand_shed_ratio``). None: it drops after ``stable_window_s``.
    demand_release_ratio: float | None = 0.9
    #: The demand rule's capacity: the highest answer rate measured while full over this
    #: long (0: the latest measurement alone).
    capacity_window_s: float = 30.0
    #: HAProxy refuses what passes this × the model's capacity, counting the classes above
    #: (ballast.policies.edge.EdgeCeiling): a crowd is cut there before the reports see it.
    #: Above ``demand_shed_ratio``, so that the level sheds first once it has seen the
    #: demand. None: no ceiling.
    edge_ceiling_ratio: float | None = 1.5
    #: How long the ceiling's measured capacity is held against lower measurements.
    edge_capacity_memory_s: float = 3600.0
    stable_window_s: float = 30.0
    #: A target two or more above the level must persist this long before the level follows it.
    up_confirm_s: float = 1.0
    #: Queue signals inflated by missing replicas hold the level for at most this long.
    capacity_gap_max_s: float = 120.0
    #: ... and for this long after the gap closes (the replicas' queue-wait window).
    capacity_gap_settle_s: float = 10.0
    constraints: tuple[LevelConstraints, ...] = field(default=DEFAULT_CONSTRAINTS)

    def __post_init__(self) -> None:
        for name in _THRESHOLD_FIELDS:
            self._validate_thresholds(name)
        check_fields(self, check_ratio, "error_rate_threshold")
        check_fields(self, _check_level, "error_rate_level")
        if self.error_rate_level == 0:
            raise ValueError("error_rate_level: must be >= 1, got 0")
        check_fields(self, check_int, "error_rate_min_requests", minimum=0)
        check_fields(self, check_positive, "demand_shed_ratio", "demand_release_ratio", optional=True)
        shed, release = self.demand_shed_ratio, self.demand_release_ratio
        if shed is not None and release is not None and release >= shed:
            raise ValueError(
                f"demand_release_ratio: must be below demand_shed_ratio ({shed!r}) to keep a band, got {release!r}"
            )
        check_fields(self, check_positive, "edge_ceiling_ratio", optional=True)
        ceiling = self.edge_ceiling_ratio
        if shed is not None and ceiling is not None and ceiling <= shed:
            raise ValueError(f"edge_ceiling_ratio: must be above demand_shed_ratio ({shed!r}), got {ceiling!r}")
        check_fields(self, check_positive, "stable_window_s", "up_confirm_s", "edge_capacity_memory_s")
        check_fields(self, check_non_negative, "capacity_gap_max_s", "capacity_gap_settle_s", "capacity_window_s")
        self._validate_constraints()

    def _validate_thresholds(self, name: str) -> None:
        raw = getattr(self, name)
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
            raise ValueError(f"{name}: must be a sequence of {MAX_LEVEL} values, got {raw!r}")
        values = tuple(raw)  # lists from pydantic/YAML are fine; stored as a tuple
        if len(values) != MAX_LEVEL:
            raise ValueError(f"{name}: must have {MAX_LEVEL} entries (levels 1..{MAX_LEVEL}), got {len(values)}")
        previous: float | None = None
        for value in values:
            if value is None:
                continue
            if not is_finite(value) or value < 0:
                raise ValueError(f"{name}: entries must be finite numbers >= 0 or None, got {value!r}")
            if previous is not None and value <= previous:
                raise ValueError(f"{name}: must be strictly ascending, got {values!r}")
            previous = value
        object.__setattr__(self, name, values)

    def _validate_constraints(self) -> None:
        raw = self.constraints
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
            raise ValueError(f"constraints: must be a sequence of {NUM_LEVELS} LevelConstraints")
        levels = tuple(raw)
        if len(levels) != NUM_LEVELS:
            raise ValueError(f"constraints: must have {NUM_LEVELS} levels (0..{MAX_LEVEL}), got {len(levels)}")
        for i, c in enumerate(levels):
            if not isinstance(c, LevelConstraints):
                raise ValueError(f"constraints: level {i} is not a LevelConstraints, got {c!r}")
        for i in range(1, NUM_LEVELS):
            lower, higher = levels[i - 1], levels[i]
            if higher.max_tokens > lower.max_tokens:
                raise ValueError(f"constraints: level {i} max_tokens exceeds level {i - 1}")
            if higher.max_batch_size > lower.max_batch_size:
                raise ValueError(f"constraints: level {i} max_batch_size exceeds level {i - 1}")
            if higher.streaming and not lower.streaming:
                raise ValueError(f"constraints: level {i} allows streaming but level {i - 1} does not")
            if not higher.admitted <= lower.admitted:
                raise ValueError(f"constraints: level {i} admits a criticality that level {i - 1} refuses")
        object.__setattr__(self, "constraints", levels)

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue_length_thresholds": list(self.queue_length_thresholds),
            "queue_wait_ms_thresholds": list(self.queue_wait_ms_thresholds),
            "kv_util_pct_thresholds": list(self.kv_util_pct_thresholds),
            "gpu_util_pct_thresholds": list(self.gpu_util_pct_thresholds),
            "vram_pct_thresholds": list(self.vram_pct_thresholds),
            "error_rate_threshold": self.error_rate_threshold,
            "error_rate_level": self.error_rate_level,
            "error_rate_min_requests": self.error_rate_min_requests,
            "demand_shed_ratio": self.demand_shed_ratio,
            "demand_release_ratio": self.demand_release_ratio,
            "capacity_window_s": self.capacity_window_s,
            "stable_window_s": self.stable_window_s,
            "up_confirm_s": self.up_confirm_s,
            "capacity_gap_max_s": self.capacity_gap_max_s,
            "capacity_gap_settle_s": self.capacity_gap_settle_s,
            "constraints": [c.to_dict() for c in self.constraints],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DegradationConfig:
        """Build from a plain mapping; absent keys keep their defaults.

        ``constraints`` entries may be dicts or LevelConstraints. Unknown keys
        are rejected so a typo in the config file is not silently ignored.
        """
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown degradation config field")
        kwargs = dict(data)
        if "constraints" in kwargs:
            kwargs["constraints"] = tuple(
                c if isinstance(c, LevelConstraints) else LevelConstraints.from_dict(c) for c in kwargs["constraints"]
            )
        return cls(**kwargs)


# --------------------------------------------------------------------------- signals


_DEMANDS = ("demand_rps", "demand_sustained_rps", "demand_recent_max_rps")


@dataclass(frozen=True)
class LoadSignals:
    """One control tick's view of load. ``None`` = absent, and then ignored."""

    queue_length: int
    queue_wait_p95_ms: float | None
    gpu_util_pct: float | None
    vram_pct: float | None
    error_rate: float | None
    #: Requests in the error-rate window; gates the error-rate signal.
    request_count: int = 0
    #: Requests per second offered per criticality (by value), whether admitted or not.
    demand_rps: Mapping[str, float] | None = None
    #: The same over the routers' last two report intervals: the lower of the two rates
    #: (a step that holds) and the higher (a step that is over); None: read ``demand_rps``.
    demand_sustained_rps: Mapping[str, float] | None = None
    demand_recent_max_rps: Mapping[str, float] | None = None
    #: Answers per second from the model while the gate was full; None when it was not.
    capacity_rps: float | None = None
    #: Primary replicas taking traffic now, and how many the controller wants (None: unknown).
    replicas_serving: int | None = None
    replicas_target: int | None = None
    #: One of the controller's own recycles of the primary is under way (its surge or its drain).
    recycling: bool = False
    #: The primary replicas' KV token budget reserved by rows in flight, percent (mean).
    kv_util_pct: float | None = None

    def __post_init__(self) -> None:
        check_fields(self, check_int, "queue_length", minimum=0)
        check_fields(
            self,
            check_non_negative,
            "queue_wait_p95_ms",
            "gpu_util_pct",
            "kv_util_pct",
            "vram_pct",
            "error_rate",
            optional=True,
        )
        if self.error_rate is not None and self.error_rate > 1:
            raise ValueError(f"error_rate: must be in [0, 1], got {self.error_rate!r}")
        check_fields(self, check_int, "request_count", minimum=0)
        check_fields(self, check_non_negative, "capacity_rps", optional=True)
        if self.replicas_serving is not None:
            check_fields(self, check_int, "replicas_serving", minimum=0)
        if self.replicas_target is not None:
            check_fields(self, check_int, "replicas_target", minimum=0)
        for name in _DEMANDS:
            rates = getattr(self, name)
            if rates is None:
                continue
            if not isinstance(rates, Mapping):
                raise ValueError(f"{name}: must be a mapping, got {rates!r}")
            for crit, rps in rates.items():
                try:
                    Criticality(crit)
                except ValueError:
                    raise ValueError(f"{name}: unknown criticality {crit!r}") from None
                check_non_negative(f"{name}[{crit}]", rps, optional=True)
                if rps is None:
                    raise ValueError(f"{name}[{crit}]: must be a number")

    def to_dict(self) -> dict[str, Any]:
        """The signals as plain data (the snapshot's ``inputs``, the status's)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in _DEMANDS:
            out[name] = dict(out[name]) if out[name] is not None else None
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoadSignals:
        """The signals ``to_dict`` wrote; keys it does not know are ignored (a newer sender's),
        one it needs and lacks is a ValueError naming it, and each value is checked as when built."""
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        if missing:
            raise ValueError(f"{missing[0]}: missing from load signals")
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def _level_for(value: float, thresholds: tuple[float | None, ...]) -> tuple[int, float | None]:
    """Highest level whose threshold ``value`` reaches, and that threshold."""
    for i in range(MAX_LEVEL - 1, -1, -1):
        threshold = thresholds[i]
        if threshold is not None and value >= threshold:
            return i + 1, threshold
    return 0, None


def target_level(
    signals: LoadSignals, cfg: DegradationConfig, load_cap: int | None = None, held: int | None = None
) -> tuple[int, str]:
    """The level the current signals ask for, and which signal asked.

    The result is the maximum over the present signals. Signals are checked in
    priority order — queue length, queue wait p95, KV utilisation, GPU
    util, VRAM, error rate — and on a tie the first in that order names the reason, so the
    reason points at the most direct overload signal (queue) rather than the
    lagging ones (GPU duty cycle, errors). Reason looks like
    ``"queue_length=230>=200"``; ``"normal"`` for level 0.

    ``load_cap``: the queue-derived signals (queue length, queue wait, KV, demand) ask
    for at most this level (a capacity gap; see the module docstring). ``held``: the level
    the demand rule reached on the routers' last reports, which it holds within its band.
    """
    level, reason, _ = _target_detail(signals, cfg, load_cap, held)
    return level, reason


def _target_detail(
    signals: LoadSignals, cfg: DegradationConfig, load_cap: int | None, held: int | None
) -> tuple[int, str, bool]:
    """``target_level``, and whether the demand rule asked it from the last two reports (a step)."""
    best = (0, "normal")
    for name, value, thresholds, capped in (
        ("queue_length", signals.queue_length, cfg.queue_length_thresholds, True),
        ("queue_wait_p95_ms", signals.queue_wait_p95_ms, cfg.queue_wait_ms_thresholds, True),
        ("kv_util_pct", signals.kv_util_pct, cfg.kv_util_pct_thresholds, True),
        ("gpu_util_pct", signals.gpu_util_pct, cfg.gpu_util_pct_thresholds, False),
        ("vram_pct", signals.vram_pct, cfg.vram_pct_thresholds, False),
    ):
        asked = _asked(name, value, thresholds, load_cap if capped else None)
        if asked is not None and asked[0] > best[0]:  # strict: the earlier signal keeps a tie
            best = asked
    by_demand = _by_demand(signals, cfg, load_cap, held)
    step = False  # whether the demand rule, read on the last two reports, names the level
    if by_demand is not None and by_demand[0] > best[0]:
        best, step = (by_demand[0], by_demand[1]), by_demand[2]
    # A handful of failures out of a handful of requests is noise, not overload.
    if (
        signals.error_rate is not None
        and signals.request_count >= cfg.error_rate_min_requests
        and signals.error_rate >= cfg.error_rate_threshold
        and cfg.error_rate_level > best[0]
    ):
        best = (
            cfg.error_rate_level,
            f"error_rate={_fmt(signals.error_rate)}>={_fmt(cfg.error_rate_threshold)} (n={signals.request_count})",
        )
        step = False
    return best[0], best[1], step


def _asked(
    name: str, value: float | None, thresholds: tuple[float | None, ...], cap: int | None
) -> tuple[int, str] | None:
    """The level one signal asks for (at most ``cap``) and its reason; None when it asks for none."""
    if value is None:
        return None
    level, threshold = _level_for(value, thresholds)
    if cap is not None and level > cap:
        level = cap
        threshold = thresholds[cap - 1] if cap > 0 else None
    if threshold is None:
        return None
    return level, f"{name}={_fmt(value)}>={_fmt(threshold)}"


def _by_demand(
    signals: LoadSignals, cfg: DegradationConfig, load_cap: int | None, held: int | None
) -> tuple[int, str, bool] | None:
    """The deepest level whose admitted classes still fill the model by themselves, its
    reason, and whether it was read on the routers' last two reports; None: none.

    With the last two reports (``demand_sustained_rps``), a step is read as it holds: a
    crowd that arrived shows in both, and asks for its level on the first tick after
    them. A level ``held`` from such a step stays while its admitted classes' recent peak
    (``demand_recent_max_rps``) is at least ``demand_release_ratio`` × capacity: the band
    between the two ratios keeps it from flapping, and a crowd that left shows in neither
    report. Without them, the window's mean (``demand_rps``)."""
    capacity = signals.capacity_rps
    if cfg.demand_shed_ratio is None or not capacity:
        return None
    recent = signals.demand_sustained_rps is not None
    demand = signals.demand_sustained_rps if recent else signals.demand_rps
    name = "demand_now" if recent else "demand"
    top = MAX_LEVEL if load_cap is None else min(MAX_LEVEL, load_cap)
    need = cfg.demand_shed_ratio * capacity
    asked: tuple[int, str, bool] | None = None
    for level in range(top, 0, -1):
        admitted = cfg.constraints[level].admitted
        rate = _admitted_rate(demand, admitted)
        if admitted and rate >= need:
            asked = (
                level,
                f"{name}={_fmt(round(rate, 1))}>={_fmt(round(need, 1))} (capacity_rps) for " + _classes(cfg, level),
                recent,
            )
            break
    release = cfg.demand_release_ratio
    if recent and release is not None and held and held <= top and (asked is None or asked[0] < held):
        peak = _admitted_rate(signals.demand_recent_max_rps, cfg.constraints[held].admitted)
        keep = release * capacity
        if cfg.constraints[held].admitted and peak >= keep:
            asked = (
                held,
                f"demand_now peak={_fmt(round(peak, 1))}>={_fmt(round(keep, 1))} "
                f"(release_ratio x capacity_rps) for " + _classes(cfg, held),
                True,
            )
    return asked


def _admitted_rate(rates: Mapping[str, float] | None, admitted: frozenset[Criticality]) -> float:
    return sum(rps for crit, rps in (rates or {}).items() if Criticality(crit) in admitted)


def _classes(cfg: DegradationConfig, level: int) -> str:
    return ",".join(c.value for c in cfg.constraints[level].admitted_sorted())


# --------------------------------------------------------------------------- decision


@dataclass(frozen=True)
class DegradationState:
    """Carried between ticks by the controller.

    * ``lower_since_s``/``lower_max``: when the target first went below ``level`` in
      the current uninterrupted streak, and the highest target seen since; ``None``
      when there is no such streak.
    * ``up_since_s``/``up_min``: when a target above ``level`` was first asked for in
      the current streak, and the lowest target asked for since; ``None`` when none.
    * ``gap_since_s``/``gap_last_s``: when the current (or last) capacity gap began,
      and the last tick it was seen; ``None`` when none is remembered.
    * ``serving_high``: the primary replicas the deployment had serving (at most its
      target); ``None`` before the first count.
    * ``capacity_peak_rps``/``capacity_peak_s``: the highest capacity measured within
      ``capacity_window_s`` and when; ``None`` when none is remembered.
    * ``by_demand``: the level is one the demand rule reached on the routers' last two
      reports (a step), and it drops as the step ends, not after ``stable_window_s``.
    """

    level: int = 0
    lower_since_s: float | None = None
    lower_max: int | None = None
    up_since_s: float | None = None
    up_min: int | None = None
    gap_since_s: float | None = None
    gap_last_s: float | None = None
    serving_high: int | None = None
    capacity_peak_rps: float | None = None
    capacity_peak_s: float | None = None
    by_demand: bool = False

    def __post_init__(self) -> None:
        check_fields(self, _check_level, "level")
        if not isinstance(self.by_demand, bool):
            raise ValueError(f"by_demand: must be a bool, got {self.by_demand!r}")
        check_fields(
            self,
            check_finite,
            "lower_since_s",
            "up_since_s",
            "gap_since_s",
            "gap_last_s",
            "capacity_peak_rps",
            "capacity_peak_s",
            optional=True,
        )
        for name in ("lower_max", "up_min"):
            if getattr(self, name) is not None:
                _check_level(name, getattr(self, name))
        if self.serving_high is not None:
            check_fields(self, check_int, "serving_high", minimum=0)


@dataclass(frozen=True)
class DegradationDecision:
    level: int
    target_level: int
    reason: str
    constraints: LevelConstraints
    changed: bool
    #: Missing replicas are holding the queue signals this tick (see the module docstring).
    capacity_gap: bool = False


@dataclass(frozen=True)
class _Gap:
    holding: bool
    since_s: float | None
    last_s: float | None
    serving_high: int | None
    age_s: float = 0.0
    missing: bool = False  # replicas missing this tick (else a recycle of ours, or the settle time)


def _gap(signals: LoadSignals, state: DegradationState, cfg: DegradationConfig, now_s: float) -> _Gap:
    """This tick's capacity gap: fewer replicas serving than the deployment had, or one of
    the controller's own recycles under way (a replacement starting beside a replica on
    the same host, the switch from the old replica to the new one).

    What it had (``serving_high``) follows the serving count up, and down with the
    autoscaler's target; a gap older than ``capacity_gap_max_s`` is accepted as the
    new capacity. A gap that reopens within the settle time continues the previous
    one, so a replica flapping in and out cannot restart the clock.
    """
    since, last, high = state.gap_since_s, state.gap_last_s, state.serving_high
    if last is not None and (now_s < last or now_s - last > cfg.capacity_gap_settle_s):
        since = last = None  # settled (or a clock from another process): forgotten
    serving, target = signals.replicas_serving, signals.replicas_target
    missing = False
    if serving is not None and target is not None:
        high = serving if high is None else max(min(high, target), serving)
        missing = serving < high
    if missing or signals.recycling:
        since = now_s if since is None else since
        last = now_s
        if missing and now_s - since >= cfg.capacity_gap_max_s:
            high = serving  # missing that long: it is the capacity now
    if since is None or last is None:
        return _Gap(False, None, None, high)
    age = last - since
    return _Gap(age < cfg.capacity_gap_max_s, since, last, high, age, missing)


def decide(
    signals: LoadSignals,
    state: DegradationState,
    cfg: DegradationConfig,
    now_s: float,
) -> tuple[DegradationDecision, DegradationState]:
    """One control tick: one level up on a sample, to the target on evidence, down in one window.

    Tick semantics (window W = ``cfg.stable_window_s``, confirm C = ``cfg.up_confirm_s``):

    * target > level, first such tick: level + 1 now, and an up-streak starts
      (unless level + 1 is the target). On later ticks of the streak the level
      holds until the streak is C old, then jumps to the lowest target of the streak.
    * target == level: both streaks are cleared (interrupted).
    * target < level: the first such tick starts a down-streak at ``now_s``; once
      ``now_s - lower_since_s >= W`` the level drops to the highest target seen in
      the streak and, if the target is still lower, a new streak starts at ``now_s``.

    During a capacity gap (``_gap``) the target is computed with the queue signals
    capped at the current level (``target_level(load_cap=level)``).

    A clock that went backwards (``now_s`` before a streak's start, e.g. state
    restored from another process) restarts that streak rather than freezing it.
    """
    check_finite("now_s", now_s)
    level = state.level
    peak = _capacity_peak(signals.capacity_rps, state, cfg, now_s)
    if signals.capacity_rps is not None:  # measured this tick: held against the window's peak
        signals = replace(signals, capacity_rps=peak.rps)
    gap = _gap(signals, state, cfg, now_s)
    held = level if state.by_demand else None
    target, target_reason, a_step = _target(signals, cfg, level, gap, held)
    by_demand = state.by_demand
    if target > level and a_step:  # a crowd the last two reports both saw: its level now
        step = _Step(target, f"up {level}->{target}: {target_reason} (a step: both last reports)")
        by_demand = True
    elif target > level:
        step = _step_up(level, target, target_reason, state, cfg, now_s)
        by_demand = False
    elif target == level:
        step = _Step(level, target_reason if level == 0 else f"hold {level}: {target_reason}")
    elif state.by_demand and signals.demand_sustained_rps is not None and cfg.demand_release_ratio is not None:
        # The step that raised it is over (neither last report asks for the level): down to
        # what is asked now, the band having kept it from flapping.
        step = _Step(target, f"down {level}->{target}: {target_reason} (the step is over)")
        by_demand = a_step
    else:
        step = _step_down(level, target, target_reason, state, cfg, now_s)
        by_demand = by_demand and step.level == level
    new_level, reason = step.level, step.reason
    up_since, up_min, lower_since, lower_max = step.up_since_s, step.up_min, step.lower_since_s, step.lower_max

    decision = DegradationDecision(
        level=new_level,
        target_level=target,
        reason=reason,
        constraints=cfg.constraints[new_level],
        changed=new_level != state.level,
        capacity_gap=gap.holding,
    )
    new_state = DegradationState(
        level=new_level,
        lower_since_s=lower_since,
        lower_max=lower_max,
        up_since_s=up_since,
        up_min=up_min,
        gap_since_s=gap.since_s,
        gap_last_s=gap.last_s,
        serving_high=gap.serving_high,
        capacity_peak_rps=peak.rps,
        capacity_peak_s=peak.at_s,
        by_demand=by_demand and new_level > 0,
    )
    return decision, new_state


class _Peak(NamedTuple):
    """The capacity the demand rule reads this tick (with ``capacity_rps`` measured), and when it was measured."""

    rps: float | None
    at_s: float | None


def _capacity_peak(measured: float | None, state: DegradationState, cfg: DegradationConfig, now_s: float) -> _Peak:
    """The highest capacity measured within ``capacity_window_s``: the new measurement when
    it is at least the remembered peak, the peak while it is in the window; a peak older
    than the window (or stamped after ``now_s``: a clock that went back) is forgotten."""
    rps, at = state.capacity_peak_rps, state.capacity_peak_s
    if rps is None or at is None or now_s < at or now_s - at > cfg.capacity_window_s:
        rps = at = None
    if measured is not None and (rps is None or measured >= rps):
        return _Peak(measured, now_s)
    return _Peak(rps, at)


class _Step(NamedTuple):
    """A tick's move: the new level, why, and the streaks it leaves open."""

    level: int
    reason: str
    up_since_s: float | None = None
    up_min: int | None = None
    lower_since_s: float | None = None
    lower_max: int | None = None


def _target(
    signals: LoadSignals, cfg: DegradationConfig, level: int, gap: _Gap, held: int | None
) -> tuple[int, str, bool]:
    """The level the signals ask for, and whether it is a step's (``_target_detail``);
    during a capacity gap with the queue signals held at ``level``."""
    target, reason, a_step = _target_detail(signals, cfg, level if gap.holding else None, held)
    if gap.holding:
        raw, _ = target_level(signals, cfg)
        if raw > target:
            what = (
                f"capacity gap {signals.replicas_serving}/{gap.serving_high}"
                if gap.missing
                else ("recycle under way" if signals.recycling else "capacity gap settling")
            )
            reason += f" [{what} for {_fmt(round(gap.age_s, 1))}s: queue signals held at {level}, would ask {raw}]"
    return target, reason, a_step


def _step_up(level: int, target: int, why: str, state: DegradationState, cfg: DegradationConfig, now_s: float) -> _Step:
    """One level up on the first tick; to the lowest target of the streak once it held ``up_confirm_s``."""
    if state.up_since_s is None or state.up_min is None or now_s < state.up_since_s:
        new_level = level + 1
        reason = f"up {level}->{new_level}: {why}"
        if target <= new_level:
            return _Step(new_level, reason)
        # More asked: it must persist to be followed.
        return _Step(new_level, reason + f" (to {target} if it holds {_fmt(cfg.up_confirm_s)}s)", now_s, target)
    up_since, up_min = state.up_since_s, min(state.up_min, target)
    held_s = now_s - up_since
    if held_s >= cfg.up_confirm_s:
        new_level = max(level, up_min)
        return _Step(new_level, f"up {level}->{new_level}: {why} held {_fmt(round(held_s, 3))}s")
    return _Step(
        level,
        f"hold {level}: target {target} ({why}) for {_fmt(round(held_s, 3))}s of {_fmt(cfg.up_confirm_s)}s",
        up_since,
        up_min,
    )


def _step_down(
    level: int, target: int, why: str, state: DegradationState, cfg: DegradationConfig, now_s: float
) -> _Step:
    """Down to the highest target of the streak once it held one ``stable_window_s``."""
    if state.lower_since_s is None or state.lower_max is None or now_s < state.lower_since_s:
        lower_since, lower_max = now_s, target
    else:
        lower_since, lower_max = state.lower_since_s, max(state.lower_max, target)
    held_s = now_s - lower_since
    if held_s < cfg.stable_window_s:
        return _Step(
            level,
            f"hold {level}: target {target} ({why}) for {_fmt(round(held_s, 3))}s of {_fmt(cfg.stable_window_s)}s",
            lower_since_s=lower_since,
            lower_max=lower_max,
        )
    reason = (
        f"down {level}->{lower_max}: target {target} ({why}) "
        f"held {_fmt(round(held_s, 3))}s>={_fmt(cfg.stable_window_s)}s"
    )
    # Still lower than the new level: the next step needs a fresh window.
    if target < lower_max:
        return _Step(lower_max, reason, lower_since_s=now_s, lower_max=target)
    return _Step(lower_max, reason)


def conservative_level(last_level: int | None, floor: int) -> int:
    """The level a router uses when its snapshot is too stale to trust.

    Fail-static: keep the last known level if it was already strict, but never
    go below ``floor`` — an unreachable controller more likely means trouble
    than calm, and higher levels are guaranteed stricter (see DegradationConfig).
    """
    if last_level is not None:
        _check_level("last_level", last_level)
    _check_level("floor", floor)
    return max(last_level or 0, floor)
