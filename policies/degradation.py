"""Degradation level: how far the service steps down its quality under load.

Five levels, 0 (normal) … 4 (emergency). Each level carries constraints that the
router and the model replicas apply: the largest ``max_tokens`` granted, the
largest batch, whether streaming is allowed, and which criticalities are still
admitted. Default thresholds and constraints follow the seed document's
degradation table (queue length 50/100/200/500, GPU util 85/92/97, VRAM 99 %
emergency, error rate > 10 % critical); queue-wait thresholds are ours.

The level moves asymmetrically, on purpose:

* **Up at once.** When any signal asks for a higher level the level jumps there
  in the same tick: shedding must start within one control tick of overload.
* **Down one level per stable window.** A lower target must hold, uninterrupted,
  for ``stable_window_s`` before the level drops by one; the streak then starts
  again. A single tick whose target is back at (or above) the current level
  breaks the streak. This is the hysteresis that keeps the level from flapping
  when shedding itself makes the load signals look healthy.

**Demand by criticality** is the signal that picks *which* classes to shed. The
router's gate already serves the classes in order of criticality while the model is
full, so shedding a whole class at the door only pays when the classes that would
remain fill the model by themselves: then the shed class would get nothing anyway,
and refusing it at the door is cheaper and clearer than refusing it in line. So a
level ``k`` is asked for when the demand of the classes level ``k`` admits is at
least ``demand_shed_ratio`` (1.1) × the capacity (the rate the model answers while
the gate is full). The ratio is above 1 on purpose: classes that are all being
served offer about what is answered, and must not read as filling the model. At four times capacity with 20 % critical traffic this asks for
level 1 (sheddable out) and not level 2, which would idle the fifth of the model
that sheddable_plus fills.

Signals that are absent (``None``: no GPU, no traffic yet, a watchdog that has
not reported) are ignored, never treated as zero (which would hide overload) or
as the maximum (which would shed everything on a CPU-only host).

Written by hand rather than taken from a library: no library offers a
multi-signal, multi-level hysteresis with injected time and these semantics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.criticality import Criticality

from policies.validation import check_finite, check_int, check_non_negative, check_positive, check_ratio, is_finite

#: Levels are 0 … MAX_LEVEL inclusive.
MAX_LEVEL = 4
NUM_LEVELS = MAX_LEVEL + 1


def _check_level(name: str, value: object) -> None:
    check_int(name, value, minimum=0, maximum=MAX_LEVEL)


def _fmt(value: float) -> str:
    # Compact numbers for reason strings: 230, 92.5, 0.15.
    return f"{value:g}"


# --------------------------------------------------------------------------- constraints


@dataclass(frozen=True)
class LevelConstraints:
    """What is allowed at one degradation level.

    ``admitted`` accepts any iterable of criticalities or their string values
    (so a pydantic model or a JSON list can be passed straight in) and is
    normalised to a ``frozenset[Criticality]``. An empty set means the level
    admits no new requests at all (in-flight work still completes).
    """

    max_tokens: int
    max_batch_size: int
    streaming: bool
    admitted: frozenset[Criticality]

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_int("max_batch_size", self.max_batch_size, minimum=1)
        if not isinstance(self.streaming, bool):
            raise ValueError(f"streaming: must be a bool, got {self.streaming!r}")
        if isinstance(self.admitted, (str, bytes)) or not isinstance(self.admitted, Iterable):
            raise ValueError(f"admitted: must be a collection of criticalities, got {self.admitted!r}")
        try:
            admitted = frozenset(Criticality(c) for c in self.admitted)
        except ValueError:
            raise ValueError(f"admitted: unknown criticality in {self.admitted!r}") from None
        object.__setattr__(self, "admitted", admitted)

    def admitted_sorted(self) -> list[Criticality]:
        """Admitted classes, most important first (stable for JSON and logs)."""
        return sorted(self.admitted, key=lambda c: c.rank)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "max_batch_size": self.max_batch_size,
            "streaming": self.streaming,
            "admitted": [c.value for c in self.admitted_sorted()],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LevelConstraints:
        missing = [k for k in ("max_tokens", "max_batch_size", "streaming", "admitted") if k not in data]
        if missing:
            raise ValueError(f"{missing[0]}: missing from level constraints {dict(data)!r}")
        return cls(
            max_tokens=data["max_tokens"],
            max_batch_size=data["max_batch_size"],
            streaming=data["streaming"],
            admitted=data["admitted"],
        )


_ALL = frozenset(Criticality)

#: Seed table: level 0 … 4. Level 4 admits nothing new; in-flight work finishes.
DEFAULT_CONSTRAINTS: tuple[LevelConstraints, ...] = (
    LevelConstraints(max_tokens=8192, max_batch_size=32, streaming=True, admitted=_ALL),
    LevelConstraints(
        max_tokens=4096,
        max_batch_size=24,
        streaming=True,
        admitted=_ALL - {Criticality.SHEDDABLE},
    ),
    LevelConstraints(
        max_tokens=2048,
        max_batch_size=16,
        streaming=False,
        admitted=frozenset({Criticality.CRITICAL_PLUS, Criticality.CRITICAL}),
    ),
    LevelConstraints(
        max_tokens=1024,
        max_batch_size=8,
        streaming=False,
        admitted=frozenset({Criticality.CRITICAL_PLUS}),
    ),
    LevelConstraints(max_tokens=512, max_batch_size=4, streaming=False, admitted=frozenset()),
)


# --------------------------------------------------------------------------- config

_THRESHOLD_FIELDS = (
    "queue_length_thresholds",
    "queue_wait_ms_thresholds",
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
    gpu_util_pct_thresholds: tuple[float | None, ...] = (85.0, 92.0, 97.0, None)
    vram_pct_thresholds: tuple[float | None, ...] = (None, None, 97.0, 99.0)
    error_rate_threshold: float = 0.1
    #: The level an error rate at or above the threshold asks for (seed: critical).
    error_rate_level: int = 3
    #: Below this many requests in the window the error rate is noise; ignored.
    error_rate_min_requests: int = 20
    #: Level k is asked for when the demand of the classes it admits >= this × capacity
    #: (above 1, so that classes that are all being served never qualify).
    #: None: demand never asks for a level.
    demand_shed_ratio: float | None = 1.1
    stable_window_s: float = 30.0
    constraints: tuple[LevelConstraints, ...] = field(default=DEFAULT_CONSTRAINTS)

    def __post_init__(self) -> None:
        for name in _THRESHOLD_FIELDS:
            self._validate_thresholds(name)
        check_ratio("error_rate_threshold", self.error_rate_threshold)
        _check_level("error_rate_level", self.error_rate_level)
        if self.error_rate_level == 0:
            raise ValueError("error_rate_level: must be >= 1, got 0")
        check_int("error_rate_min_requests", self.error_rate_min_requests, minimum=0)
        check_positive("demand_shed_ratio", self.demand_shed_ratio, optional=True)
        check_positive("stable_window_s", self.stable_window_s)
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
            if not is_finite(value) or value < 0:  # type: ignore[operator]
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
            "gpu_util_pct_thresholds": list(self.gpu_util_pct_thresholds),
            "vram_pct_thresholds": list(self.vram_pct_thresholds),
            "error_rate_threshold": self.error_rate_threshold,
            "error_rate_level": self.error_rate_level,
            "error_rate_min_requests": self.error_rate_min_requests,
            "demand_shed_ratio": self.demand_shed_ratio,
            "stable_window_s": self.stable_window_s,
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
                c if isinstance(c, LevelConstraints) else LevelConstraints.from_dict(c)
                for c in kwargs["constraints"]
            )
        return cls(**kwargs)


# --------------------------------------------------------------------------- signals


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
    #: Answers per second from the model while the gate was full; None when it was not.
    capacity_rps: float | None = None

    def __post_init__(self) -> None:
        check_int("queue_length", self.queue_length, minimum=0)
        check_non_negative("queue_wait_p95_ms", self.queue_wait_p95_ms, optional=True)
        check_non_negative("gpu_util_pct", self.gpu_util_pct, optional=True)
        check_non_negative("vram_pct", self.vram_pct, optional=True)
        check_non_negative("error_rate", self.error_rate, optional=True)
        if self.error_rate is not None and self.error_rate > 1:
            raise ValueError(f"error_rate: must be in [0, 1], got {self.error_rate!r}")
        check_int("request_count", self.request_count, minimum=0)
        check_non_negative("capacity_rps", self.capacity_rps, optional=True)
        if self.demand_rps is not None:
            if not isinstance(self.demand_rps, Mapping):
                raise ValueError(f"demand_rps: must be a mapping, got {self.demand_rps!r}")
            for crit, rps in self.demand_rps.items():
                try:
                    Criticality(crit)
                except ValueError:
                    raise ValueError(f"demand_rps: unknown criticality {crit!r}") from None
                check_non_negative(f"demand_rps[{crit}]", rps, optional=True)
                if rps is None:
                    raise ValueError(f"demand_rps[{crit}]: must be a number")


def _level_for(value: float, thresholds: tuple[float | None, ...]) -> tuple[int, float | None]:
    """Highest level whose threshold ``value`` reaches, and that threshold."""
    for i in range(MAX_LEVEL - 1, -1, -1):
        threshold = thresholds[i]
        if threshold is not None and value >= threshold:
            return i + 1, threshold
    return 0, None


def target_level(signals: LoadSignals, cfg: DegradationConfig) -> tuple[int, str]:
    """The level the current signals ask for, and which signal asked.

    The result is the maximum over the present signals. Signals are checked in
    the DESIGN priority order — queue length, queue wait p95, GPU util, VRAM,
    error rate — and on a tie the first in that order names the reason, so the
    reason points at the most direct overload signal (queue) rather than the
    lagging ones (GPU duty cycle, errors). Reason looks like
    ``"queue_length=230>=200"``; ``"normal"`` for level 0.
    """
    best_level = 0
    best_reason = "normal"

    def consider(name: str, value: float | None, thresholds: tuple[float | None, ...]) -> None:
        nonlocal best_level, best_reason
        if value is None:
            return
        level, threshold = _level_for(value, thresholds)
        # Strict ">" keeps the earlier (higher-priority) signal on a tie.
        if level > best_level and threshold is not None:
            best_level = level
            best_reason = f"{name}={_fmt(value)}>={_fmt(threshold)}"

    consider("queue_length", signals.queue_length, cfg.queue_length_thresholds)
    consider("queue_wait_p95_ms", signals.queue_wait_p95_ms, cfg.queue_wait_ms_thresholds)
    consider("gpu_util_pct", signals.gpu_util_pct, cfg.gpu_util_pct_thresholds)
    consider("vram_pct", signals.vram_pct, cfg.vram_pct_thresholds)

    # The deepest level whose admitted classes still fill the model by themselves.
    if cfg.demand_shed_ratio is not None and signals.demand_rps and signals.capacity_rps:
        for level in range(MAX_LEVEL, best_level, -1):
            admitted = cfg.constraints[level].admitted
            demand = sum(rps for crit, rps in signals.demand_rps.items() if Criticality(crit) in admitted)
            need = cfg.demand_shed_ratio * signals.capacity_rps
            if admitted and demand >= need:
                best_level = level
                best_reason = (
                    f"demand={_fmt(round(demand, 1))}>={_fmt(round(need, 1))} (capacity_rps) for "
                    + ",".join(c.value for c in cfg.constraints[level].admitted_sorted())
                )
                break

    # A handful of failures out of a handful of requests is noise, not overload.
    if (
        signals.error_rate is not None
        and signals.request_count >= cfg.error_rate_min_requests
        and signals.error_rate >= cfg.error_rate_threshold
        and cfg.error_rate_level > best_level
    ):
        best_level = cfg.error_rate_level
        best_reason = (
            f"error_rate={_fmt(signals.error_rate)}>={_fmt(cfg.error_rate_threshold)}"
            f" (n={signals.request_count})"
        )
    return best_level, best_reason


# --------------------------------------------------------------------------- decision


@dataclass(frozen=True)
class DegradationState:
    """Carried between ticks by the controller.

    ``lower_since_s`` is when the target first went below ``level`` in the
    current uninterrupted streak; ``None`` when there is no such streak.
    """

    level: int = 0
    lower_since_s: float | None = None

    def __post_init__(self) -> None:
        _check_level("level", self.level)
        check_finite("lower_since_s", self.lower_since_s, optional=True)


@dataclass(frozen=True)
class DegradationDecision:
    level: int
    target_level: int
    reason: str
    constraints: LevelConstraints
    changed: bool


def decide(
    signals: LoadSignals,
    state: DegradationState,
    cfg: DegradationConfig,
    now_s: float,
) -> tuple[DegradationDecision, DegradationState]:
    """One control tick: up at once, down one level per stable window.

    Tick semantics (window W = ``cfg.stable_window_s``):

    * target > level: level = target now; any down-streak is cleared.
    * target == level: the down-streak is cleared (interrupted).
    * target < level: the first such tick starts the streak at ``now_s``; once
      ``now_s - lower_since_s >= W`` the level drops by exactly one and, if the
      target is still lower, a new streak starts at ``now_s``. So 4 → 0 takes
      four full windows, never fewer.

    A clock that went backwards (``now_s < lower_since_s``, e.g. state restored
    from another process) restarts the streak rather than freezing it.
    """
    check_finite("now_s", now_s)
    target, target_reason = target_level(signals, cfg)
    level = state.level
    lower_since_s = state.lower_since_s

    if target > level:
        new_level, new_lower_since_s = target, None
        reason = f"up {level}->{target}: {target_reason}"
    elif target == level:
        new_level, new_lower_since_s = level, None
        reason = target_reason if level == 0 else f"hold {level}: {target_reason}"
    else:
        if lower_since_s is None or now_s < lower_since_s:
            lower_since_s = now_s
        held_s = now_s - lower_since_s
        if held_s >= cfg.stable_window_s:
            new_level = level - 1
            # Still lower than the new level: the next step needs a fresh window.
            new_lower_since_s = now_s if target < new_level else None
            reason = (
                f"down {level}->{new_level}: target {target} ({target_reason})"
                f" held {_fmt(held_s)}s>={_fmt(cfg.stable_window_s)}s"
            )
        else:
            new_level, new_lower_since_s = level, lower_since_s
            reason = (
                f"hold {level}: target {target} ({target_reason})"
                f" for {_fmt(held_s)}s of {_fmt(cfg.stable_window_s)}s"
            )

    decision = DegradationDecision(
        level=new_level,
        target_level=target,
        reason=reason,
        constraints=cfg.constraints[new_level],
        changed=new_level != state.level,
    )
    return decision, DegradationState(level=new_level, lower_since_s=new_lower_since_s)


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
