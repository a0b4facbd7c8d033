"""Leak detection and the watchdog's action ladder.

**Trend.** The watchdog samples rss/vram/threads/fds about once a second. A series whose
fitted rise is *credible* (R² ≥ ``r2_threshold``) and *steep* (slope ≥ its
``slope_threshold_per_h``) leaks, and has a time to its limit where it has one. The
slope is Theil–Sen's (the median of pairwise slopes: up to ~29 % wild points ignored),
not least squares', which a GC sawtooth or one spike pulls wherever it falls; R² is
``1 - SS_res/SS_tot`` around that line (it can be negative). Time-to-limit starts from
the fitted value at the newest sample, so one GC tooth does not move it.

**Bounded window.** Samples fall into a ``ballast.policies.window.TimeWindow`` of ``max_points``
buckets, each fitted as one point (mean time, mean value): memory and the O(n²) fit are
bounded by ``max_points`` whatever the sampling rate. A sample whose time steps back
lands at the start of the newest bucket. No verdict before the samples span
``min_span_ratio`` of the window in ``min_points`` buckets.

**Two windows** (SRE's fast and slow burn). A short window (``short_window_s``), fitted
the same way, names a leak once its samples span ``short_min_span_s``, if the limit is
less than ``short_horizon_s`` away and the rise is *sustained*: each half, fitted alone,
rises at least half as fast as the whole (a one-off step or growth that stopped leaves
one half flat; a sawtooth with teeth shorter than the span drops in both; raise
``short_min_span_s`` where teeth are longer). The trend reported is the window whose
limit comes sooner.

**Ladder**: gc, empty the CUDA cache (skipped without a GPU), refuse new work, restart.
One rung per ``step_interval_s`` while the problem is a *warning*, so each cheaper remedy
shows its effect first; every remaining rung at once when it is *critical*. Whatever the
trends, usage at ``warning_ratio`` of a limit is a warning and at ``critical_ratio``
critical (uWSGI's reload-on-rss). When the problem clears the ladder resets and the
replica is ready again, unless a recycle was requested: that is never taken back (the
controller may hold its lease), and the replica stays not ready. A leak further than
``warn_tto_s`` from its limit (or without one) is named with severity "ok": slow leaks
are the max-age recycle's.

**Hang.** Work in flight and no heartbeat for more than ``missed`` intervals is hung (the
controller kills it); an idle replica, or one with no first heartbeat yet (starting,
Serve's health check's), never is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from ballast.policies.validation import (
    check_fields,
    check_finite,
    check_int,
    check_name,
    check_positive,
    check_ratio,
    is_finite,
)
from ballast.policies.window import TimeWindow

_EPSILON = 1e-9  # span / ratio comparisons: 0.97 × limit must not need one more byte


# --------------------------------------------------------------------------- trend


@dataclass(frozen=True)
class SeriesSpec:
    name: str  # "rss_bytes", "vram_bytes", "threads", "fds"
    slope_threshold_per_h: float  # a credible rise at or above this (units/h) is a leak
    limit: float | None = None  # where the replica fails; None: no time-to-limit

    def __post_init__(self) -> None:
        check_fields(self, check_name, "name")
        check_fields(self, check_positive, "slope_threshold_per_h")
        check_fields(self, check_positive, "limit", optional=True)


@dataclass(frozen=True)
class LeakConfig:
    window_s: float = 3600.0  # long (slow-burn) trend window
    min_span_ratio: float = 0.5  # no long verdict until samples span this fraction of the window...
    min_points: int = 10  # ...and fill this many buckets (the short window's too)
    max_points: int = 120  # buckets per window: the memory bound, and n for the O(n²) fit
    r2_threshold: float = 0.7  # below this fit quality a slope is noise, not a trend
    # Short (fast-burn) window: a leak that would reach its limit within short_horizon_s
    # is named as soon as short_min_span_s of samples show it, not after half an hour.
    short_window_s: float = 300.0
    short_min_span_s: float = 90.0  # longer than a GC tooth: a drop must land in the span
    short_max_points: int = 60  # 5 s buckets at the default: 1 Hz samples averaged by 5
    short_horizon_s: float = 3600.0  # the short window names only leaks this close to their limit

    def __post_init__(self) -> None:
        check_fields(self, check_positive, "window_s")
        check_fields(self, check_ratio, "min_span_ratio")
        check_fields(self, check_int, "min_points", minimum=3)  # R² of fewer than 3 points is always 1
        check_fields(self, check_int, "max_points", "short_max_points", minimum=3)
        if self.min_points > min(self.max_points, self.short_max_points):  # a window that could never be judged
            bound = min(self.max_points, self.short_max_points)
            raise ValueError(f"min_points: must be <= max_points and short_max_points ({bound}), got {self.min_points}")
        check_fields(self, check_ratio, "r2_threshold")
        check_fields(self, check_positive, "short_window_s", "short_min_span_s", "short_horizon_s")
        if self.short_window_s > self.window_s:
            raise ValueError(f"short_window_s: must be <= window_s ({self.window_s}), got {self.short_window_s}")
        if self.short_min_span_s > self.short_window_s:
            raise ValueError(
                f"short_min_span_s: must be <= short_window_s ({self.short_window_s}), got {self.short_min_span_s}"
            )


@dataclass(frozen=True)
class Trend:
    name: str
    slope_per_h: float  # Theil–Sen slope, units per hour
    fitted_now: float  # the line's value at the newest point, not the noisy last sample
    r2: float  # 1 - SS_res/SS_tot around that line; 0 when SS_tot == 0; may be negative
    points: int
    span_s: float
    judged: bool  # enough span and points for a verdict
    leaking: bool  # judged, r2 >= r2_threshold and slope_per_h >= the spec's threshold (short: and more, see fit_short)
    time_to_limit_s: float | None  # judged, credible, rising, with a limit: floored at 0
    short: bool = False  # fitted over the short (fast-burn) window rather than the long one


def theil_sen(ts: Sequence[float], vs: Sequence[float]) -> tuple[float, float]:
    """(slope per unit t, intercept): the median pairwise slope, intercept = median(v - slope·t).

    Pairs with equal t carry no slope and are left out; with no usable pair the
    slope is 0 and the intercept the median value.
    """
    if len(ts) != len(vs) or not ts:
        raise ValueError(f"ts, vs: need the same non-zero length, got {len(ts)} and {len(vs)}")
    slopes: list[float] = []
    n = len(ts)
    for i in range(n - 1):
        ti, vi = ts[i], vs[i]
        slopes.extend((vj - vi) / (tj - ti) for tj, vj in zip(ts[i + 1 :], vs[i + 1 :]) if tj != ti)
    slope = _median(slopes) if slopes else 0.0
    return slope, _median([v - slope * t for t, v in zip(ts, vs)])


def _median(xs: list[float]) -> float:
    xs.sort()
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2.0


@dataclass(frozen=True)
class _Line:
    slope_per_s: float
    fitted_now: float
    r2: float
    span_s: float
    ts: list[float]  # relative to the first point
    vs: list[float]


def _line(points: Sequence[tuple[float, float]]) -> _Line:
    if not points:
        raise ValueError("points: need at least one")
    t0 = points[0][0]
    # Times relative to the first point: seconds since boot squared in SS sums lose digits.
    ts = [t - t0 for t, _ in points]
    if any(b < a for a, b in zip(ts, ts[1:])):
        raise ValueError("points: must be sorted by time")
    vs = [v for _, v in points]
    slope_per_s, intercept = theil_sen(ts, vs)
    mean = sum(vs) / len(vs)
    ss_tot = sum((v - mean) ** 2 for v in vs)
    ss_res = sum((v - intercept - slope_per_s * t) ** 2 for t, v in zip(ts, vs))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    return _Line(slope_per_s, intercept + slope_per_s * ts[-1], r2, ts[-1], ts, vs)


def _time_to_limit(line: _Line, spec: SeriesSpec) -> float | None:
    if line.slope_per_s > 0 and spec.limit is not None:
        return max(0.0, (spec.limit - line.fitted_now) / line.slope_per_s)
    return None


def fit(points: Sequence[tuple[float, float]], spec: SeriesSpec, cfg: LeakConfig) -> Trend:
    """The long-window (slow-burn) trend of one series over ``points`` (t_s, value), sorted by t."""
    line = _line(points)
    judged = len(points) >= cfg.min_points and line.span_s >= cfg.min_span_ratio * cfg.window_s - _EPSILON
    credible = judged and line.r2 >= cfg.r2_threshold
    slope_per_h = line.slope_per_s * 3600.0
    return Trend(
        name=spec.name,
        slope_per_h=slope_per_h,
        fitted_now=line.fitted_now,
        r2=line.r2,
        points=len(points),
        span_s=line.span_s,
        judged=judged,
        leaking=credible and slope_per_h >= spec.slope_threshold_per_h,
        time_to_limit_s=_time_to_limit(line, spec) if credible else None,
    )


def fit_short(points: Sequence[tuple[float, float]], spec: SeriesSpec, cfg: LeakConfig) -> Trend:
    """The short-window (fast-burn) trend: a leak only if it is close to its limit *and* still rising.

    Judged once the points span ``short_min_span_s`` in ``min_points`` buckets. A leak
    when, besides the long window's tests (R², slope threshold), the time to the limit
    is under ``short_horizon_s`` and each half of the points, fitted on its own, rises
    at no less than half the whole slope. Over a short span a one-off step fits a line
    with R² up to 0.75, and growth that has just stopped still fits one well; either
    leaves one half flat. A real leak rises in both.
    """
    line = _line(points)
    n = len(points)
    judged = n >= cfg.min_points and line.span_s >= cfg.short_min_span_s - _EPSILON
    credible = judged and line.r2 >= cfg.r2_threshold
    slope_per_h = line.slope_per_s * 3600.0
    tto = _time_to_limit(line, spec) if credible else None
    half = n // 2
    sustained = credible and all(
        theil_sen(ts, vs)[0] >= 0.5 * line.slope_per_s
        for ts, vs in ((line.ts[:half], line.vs[:half]), (line.ts[half:], line.vs[half:]))
    )
    return Trend(
        name=spec.name,
        slope_per_h=slope_per_h,
        fitted_now=line.fitted_now,
        r2=line.r2,
        points=n,
        span_s=line.span_s,
        judged=judged,
        leaking=sustained
        and slope_per_h >= spec.slope_threshold_per_h
        and tto is not None
        and tto < cfg.short_horizon_s,
        time_to_limit_s=tto,
        short=True,
    )


class _Buckets:
    """Several series over one window, a ``TimeWindow`` of (count, sum of t, sum of value) each."""

    def __init__(self, names: Sequence[str], window_s: float, max_points: int) -> None:
        width_s = window_s / max_points
        self._windows = {name: TimeWindow(width_s, max_points, fields=3) for name in names}

    def observe(self, t_s: float, values: Mapping[str, float | None]) -> None:
        for name, window in self._windows.items():
            v = values.get(name)
            if v is None or not is_finite(v):
                continue  # NaN from a broken reader must not poison a whole window
            # A sample whose clock stepped back lands in the newest bucket, counted at
            # that bucket's start, so bucket mean times stay in bucket order.
            start_s = window.newest_start_s()
            window.add((1, t_s if start_s is None else max(t_s, start_s), v), t_s)

    def points(self, name: str, now_s: float) -> list[tuple[float, float]]:
        return [(t / n, v / n) for n, t, v in self._windows[name].buckets(now_s)]

    def reset(self, name: str | None) -> None:
        for n, window in self._windows.items():
            if name is None or n == name:
                window.clear()

    def count(self, name: str) -> int:
        return len(self._windows[name])


class LeakDetector:
    """Two bucketed windows (long, short) of several series and their trends.

    Not thread-safe: one watchdog owns it.
    """

    def __init__(self, specs: Sequence[SeriesSpec], cfg: LeakConfig) -> None:
        if not isinstance(cfg, LeakConfig):
            raise ValueError(f"cfg: must be a LeakConfig, got {cfg!r}")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"specs: names must be unique, got {names}")
        self._specs = {s.name: s for s in specs}
        self._cfg = cfg
        self._long = _Buckets(names, cfg.window_s, cfg.max_points)
        self._short = _Buckets(names, cfg.short_window_s, cfg.short_max_points)

    def observe(self, t_s: float, values: Mapping[str, float | None]) -> None:
        """Add one sample per known series; None, missing and non-finite values are skipped."""
        self._long.observe(t_s, values)
        self._short.observe(t_s, values)

    def trends(self, now_s: float) -> dict[str, Trend]:
        """One trend per series that has points in the window ending at ``now_s``.

        The long window's trend, unless the short window names a leak that the long
        one does not, or names one that reaches the limit sooner: then the short one.
        """
        out: dict[str, Trend] = {}
        for name, spec in self._specs.items():
            points = self._long.points(name, now_s)
            if not points:
                continue
            slow = fit(points, spec, self._cfg)
            out[name] = slow
            short_points = self._short.points(name, now_s)
            if len(short_points) < self._cfg.min_points:
                continue  # cannot be judged: spare the fit
            fast = fit_short(short_points, spec, self._cfg)
            # fast.leaking implies fast.time_to_limit_s is not None (fit_short).
            fast_limit_s = fast.time_to_limit_s
            if (
                fast.leaking
                and fast_limit_s is not None
                and not (slow.leaking and slow.time_to_limit_s is not None and slow.time_to_limit_s <= fast_limit_s)
            ):
                out[name] = fast
        return out

    def points(self, name: str, now_s: float) -> list[tuple[float, float]]:
        """The long window's bucket points (mean time, mean value) for ``name``, oldest first."""
        return self._long.points(name, now_s)

    def reset(self, name: str | None = None) -> None:
        """Forget one series (or all), e.g. after a recycle: the old trend says nothing of the new process."""
        self._long.reset(name)
        self._short.reset(name)

    def bucket_count(self, name: str) -> int:
        """Buckets held for ``name`` in the long window (for tests and the status page)."""
        return self._long.count(name)


# --------------------------------------------------------------------------- ladder


class Action(str, Enum):
    GC = "gc_collect"
    EMPTY_CACHE = "empty_cache"
    STOP_INTAKE = "stop_intake"
    RECYCLE = "request_recycle"


_RUNGS = (Action.GC, Action.EMPTY_CACHE, Action.STOP_INTAKE, Action.RECYCLE)  # rung n takes _RUNGS[n - 1]


@dataclass(frozen=True)
class Usage:
    name: str
    value: float
    limit: float | None

    def __post_init__(self) -> None:
        check_fields(self, check_finite, "value")
        check_fields(self, check_positive, "limit", optional=True)


@dataclass(frozen=True)
class LadderConfig:
    step_interval_s: float = 60.0
    warn_tto_s: float = 6 * 3600.0
    critical_tto_s: float = 3600.0
    warning_ratio: float = 0.90
    critical_ratio: float = 0.97

    def __post_init__(self) -> None:
        check_fields(self, check_positive, "step_interval_s", "warn_tto_s", "critical_tto_s")
        if self.critical_tto_s > self.warn_tto_s:
            raise ValueError(f"critical_tto_s: must be <= warn_tto_s ({self.warn_tto_s}), got {self.critical_tto_s}")
        check_fields(self, check_ratio, "warning_ratio", "critical_ratio")
        if self.warning_ratio > self.critical_ratio:
            raise ValueError(
                f"warning_ratio: must be <= critical_ratio ({self.critical_ratio}), got {self.warning_ratio}"
            )


@dataclass(frozen=True)
class LadderState:
    rung: int = 0  # 0 nothing taken; 1 gc; 2 empty_cache; 3 stop intake; 4 recycle requested
    last_step_s: float | None = None
    reason: str | None = None  # the verdict that took the last rung

    def __post_init__(self) -> None:
        check_fields(self, check_int, "rung", minimum=0, maximum=4)


@dataclass(frozen=True)
class Verdict:
    severity: str  # "ok" | "warning" | "critical"
    reason: str | None
    actions: tuple[Action, ...]
    ready: bool
    recycle: bool


def _fmt_rate(name: str, slope_per_h: float) -> str:
    if name.endswith("_bytes"):
        return f"{slope_per_h / 2**20:.1f} MiB/h"
    return f"{slope_per_h:.1f}/h"


def _findings(trends: Mapping[str, Trend], usage: Sequence[Usage], cfg: LadderConfig) -> list[tuple[int, str]]:
    """(level, text) per problem; level 2 critical, 1 warning, 0 named but not acted on."""
    found: list[tuple[int, str]] = []
    for u in usage:
        if u.limit is None:
            continue
        ratio = u.value / u.limit
        level = 2 if ratio >= cfg.critical_ratio - _EPSILON else 1 if ratio >= cfg.warning_ratio - _EPSILON else -1
        if level > 0:
            found.append((level, f"{u.name} at {ratio:.0%} of limit"))
    for tr in trends.values():
        if not tr.leaking:
            continue
        tto = tr.time_to_limit_s
        level = 0 if tto is None or tto >= cfg.warn_tto_s else 2 if tto < cfg.critical_tto_s else 1
        eta = "no limit" if tto is None else f"limit in {tto / 3600:.1f}h"
        where = " (short window)" if tr.short else ""
        found.append((level, f"{tr.name} leak {_fmt_rate(tr.name, tr.slope_per_h)}, {eta}{where}"))
    found.sort(key=lambda f: -f[0])  # stable: worst first, input order within a level
    return found


def _next_rung(rung: int, has_gpu: bool) -> int:
    rung += 1
    return 3 if rung == 2 and not has_gpu else rung


def assess(
    trends: Mapping[str, Trend],
    usage: Sequence[Usage],
    has_gpu: bool,
    state: LadderState,
    cfg: LadderConfig,
    now_s: float,
) -> tuple[Verdict, LadderState]:
    """One watchdog tick: the verdict, the actions to take now, and the new ladder state."""
    found = _findings(trends, usage, cfg)
    level = found[0][0] if found else 0
    reason = "; ".join(text for _, text in found) or None
    taken: list[Action] = []
    if level == 0:
        # Cleared: back to ready, unless a recycle was asked for (never taken back).
        new = state if state.rung == 4 else LadderState()
    elif state.rung == 4:
        new = state
    elif level == 2:
        rung = state.rung
        while rung < 4:
            rung = _next_rung(rung, has_gpu)
            taken.append(_RUNGS[rung - 1])
        new = LadderState(rung, now_s, reason)
    elif state.last_step_s is None or now_s - state.last_step_s >= cfg.step_interval_s:
        rung = _next_rung(state.rung, has_gpu)
        taken.append(_RUNGS[rung - 1])
        new = LadderState(rung, now_s, reason)
    else:
        new = state  # the last rung is still getting its step_interval_s to work
    severity = ("ok", "warning", "critical")[level]
    return Verdict(severity, reason, tuple(taken), ready=new.rung < 3, recycle=new.rung == 4), new


STALLED = "stalled"  # the replica says its work loop has not moved, work in flight
SILENT = "silent"  # no heartbeat arrives, work last seen in flight


def hang_reason(
    stalled_s: float,
    silent_s: float | None,
    inflight: int,
    interval_s: float,
    stall_missed: int = 3,
    silent_missed: int = 10,
) -> str | None:
    """Why a replica is hung, or None.

    - ``STALLED``: its last heartbeat said its work loop had not moved for more than
      ``stall_missed × interval_s`` with work in flight. The replica measures that on its
      own clock, so a heartbeat that arrives late (a busy node, a slow RPC) is not
      taken for a stall.
    - ``SILENT``: no heartbeat for more than ``silent_missed × interval_s`` while work
      was last seen in flight: an event loop blocked solid sends none. Heartbeats cross
      processes, so this needs more intervals than a stall the replica reports itself.

    ``silent_s`` is None before the first heartbeat. Exactly a limit is not yet hung.
    """
    check_positive("interval_s", interval_s)
    check_int("stall_missed", stall_missed, minimum=1)
    check_int("silent_missed", silent_missed, minimum=1)
    if inflight <= 0:
        return None  # idle: nothing to be stuck on
    if stalled_s > stall_missed * interval_s:
        return STALLED
    if silent_s is not None and silent_s > silent_missed * interval_s:
        return SILENT
    return None


def engine_lost_reason(gone: Sequence[str], engine_error: str | None) -> str | None:
    """Why a replica whose engine lost a process is hung, or None.

    An engine of several ranks serves only whole: a rank (or the engine core) that went
    away, or an engine that reported itself dead, leaves a replica that will answer
    nothing more, idle or not, so it is killed as a hung one is, and its requests go
    elsewhere. ``gone``: each engine process found gone, as "NAME (pid N) exited" (or
    "is stopped"); ``engine_error``: what the replica's engine said of its own death.
    A process named is the more precise of the two and goes first.
    """
    if gone:
        return "engine process " + "; ".join(gone)
    if engine_error:
        return f"engine dead: {engine_error}"
    return None
