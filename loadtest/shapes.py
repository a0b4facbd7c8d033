"""Load shapes as data: a 24-hour diurnal profile, a time scale, step/burst stages.

Pure functions of run time; nothing here imports Locust (``loadtest/locustfile.py``
wraps these in a ``LoadTestShape``), so the shapes are tested without it.

* ``DiurnalProfile``: the share of the peak load at each hour of a day, a small table
  of ``(hour, fraction)`` points joined by straight lines (piecewise linear, so the
  curve is continuous, including across midnight: the 24:00 point must equal the
  00:00 one). ``DEFAULT_DIURNAL`` has a trough around 03:00, a noon peak and a
  sharp evening spike around 20:00.
* ``TimeScale``: real seconds → simulated seconds. ``TimeScale(96)`` runs the
  86 400-second day in 900 real seconds (15 minutes).
* ``DiurnalShape``: users over a run = peak users × profile fraction of the
  simulated time of day; ``None`` once the (scaled) day is over, so the run stops by
  itself.
* ``StepShape``: stages ``(duration_s, users, spawn_rate_per_s)`` played in order;
  ``step_burst(peak_users)`` builds the default step-then-burst one from the ratio
  table ``STEP_BURST_RATIOS``.

Every value is checked where it is built; a bad one raises ``ValueError`` naming
its field.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ballast.policies.validation import (
    check_fields,
    check_finite,
    check_int,
    check_non_negative,
    check_positive,
    is_finite,
)

DAY_S = 86_400.0
HOUR_S = 3_600.0


# =========================================================================== diurnal


@dataclass(frozen=True)
class DiurnalPoint:
    """At ``hour`` (0–24, local simulated time) the load is ``fraction`` of the peak."""

    hour: float
    fraction: float

    def __post_init__(self) -> None:
        if not is_finite(self.hour) or not 0 <= self.hour <= 24:
            raise ValueError(f"hour: must be within [0, 24], got {self.hour!r}")
        if not is_finite(self.fraction) or not 0 <= self.fraction <= 1:
            raise ValueError(f"fraction: must be within [0, 1], got {self.fraction!r}")


@dataclass(frozen=True)
class DiurnalProfile:
    """A day as ``(hour, fraction)`` points, linear in between.

    Invariants (checked): the first point is at 00:00 and the last at 24:00 with
    the same fraction (no jump at midnight), hours strictly increase.
    """

    points: tuple[DiurnalPoint, ...]

    def __post_init__(self) -> None:
        pts = tuple(p if isinstance(p, DiurnalPoint) else DiurnalPoint(*p) for p in self.points)
        object.__setattr__(self, "points", pts)
        if len(pts) < 2:
            raise ValueError(f"points: need at least 2 (00:00 and 24:00), got {len(pts)}")
        if pts[0].hour != 0 or pts[-1].hour != 24:
            raise ValueError(f"points: must start at hour 0 and end at hour 24, got {pts[0].hour} .. {pts[-1].hour}")
        if pts[0].fraction != pts[-1].fraction:
            raise ValueError(
                f"points: the 24:00 fraction ({pts[-1].fraction}) must equal the 00:00 one ({pts[0].fraction})"
            )
        for a, b in zip(pts, pts[1:]):
            if b.hour <= a.hour:
                raise ValueError(f"points: hours must strictly increase, got {a.hour} then {b.hour}")

    def fraction_at_hour(self, hour: float) -> float:
        """The load fraction at ``hour`` of the day (any real; taken modulo 24)."""
        check_finite("hour", hour)
        h = hour % 24.0
        hours = [p.hour for p in self.points]
        i = bisect.bisect_right(hours, h) - 1  # points[i].hour <= h < points[i + 1].hour
        i = min(i, len(self.points) - 2)
        a, b = self.points[i], self.points[i + 1]
        return a.fraction + (b.fraction - a.fraction) * (h - a.hour) / (b.hour - a.hour)

    def fraction(self, t_sim_s: float) -> float:
        """The load fraction ``t_sim_s`` simulated seconds after midnight (modulo a day)."""
        check_finite("t_s", t_sim_s)
        return self.fraction_at_hour(t_sim_s / HOUR_S)


#: Trough ~03:00, morning ramp, noon peak (1.0), afternoon sag, a sharp evening spike
#: at 20:00 (up from 18:00, down again by 21:00), night decline.
DEFAULT_DIURNAL = DiurnalProfile(
    (
        DiurnalPoint(0, 0.25),
        DiurnalPoint(3, 0.08),
        DiurnalPoint(6, 0.20),
        DiurnalPoint(9, 0.65),
        DiurnalPoint(12, 1.00),
        DiurnalPoint(15, 0.75),
        DiurnalPoint(18, 0.50),
        DiurnalPoint(20, 0.90),
        DiurnalPoint(21, 0.45),
        DiurnalPoint(24, 0.25),
    )
)


def diurnal(t_s: float, profile: DiurnalProfile = DEFAULT_DIURNAL) -> float:
    """The users/rate multiplier (0–1) at ``t_s`` simulated seconds after midnight."""
    return profile.fraction(t_s)


# =========================================================================== time scale


@dataclass(frozen=True)
class TimeScale:
    """``factor`` simulated seconds pass per real second (96: a day in 15 minutes)."""

    factor: float = 1.0

    def __post_init__(self) -> None:
        check_positive("time_scale", self.factor)
        if self.factor > DAY_S:
            raise ValueError(f"time_scale: at most {DAY_S:.0f} (a day in one second), got {self.factor!r}")

    def sim_s(self, real_s: float) -> float:
        check_non_negative("real_s", real_s)
        return real_s * self.factor

    def real_s(self, sim_s: float) -> float:
        check_non_negative("sim_s", sim_s)
        return sim_s / self.factor

    @property
    def day_real_s(self) -> float:
        """How long one simulated day takes in real seconds."""
        return DAY_S / self.factor


# =========================================================================== shapes


@dataclass(frozen=True)
class DiurnalShape:
    """A day of load: ``peak_users × profile`` at the simulated time of day.

    The run starts at ``start_hour`` simulated and ends (``tick`` → None) one
    simulated day later. Users never go below ``min_users`` (a trough is quiet,
    not empty); ``spawn_rate_per_s`` is how fast Locust may move toward a new count.
    """

    peak_users: int
    time_scale: TimeScale = TimeScale(96.0)
    profile: DiurnalProfile = DEFAULT_DIURNAL
    min_users: int = 1
    spawn_rate_per_s: float = 0.0  # 0: derived, peak_users / 10 per second, at least 1
    start_hour: float = 0.0

    def __post_init__(self) -> None:
        check_fields(self, check_int, "peak_users", minimum=1)
        check_fields(self, check_int, "min_users", minimum=0)
        if self.min_users > self.peak_users:
            raise ValueError(f"min_users: must be <= peak_users ({self.peak_users}), got {self.min_users}")
        if not isinstance(self.time_scale, TimeScale):
            raise ValueError(f"time_scale: must be a TimeScale, got {self.time_scale!r}")
        if not isinstance(self.profile, DiurnalProfile):
            raise ValueError(f"profile: must be a DiurnalProfile, got {self.profile!r}")
        check_fields(self, check_non_negative, "spawn_rate_per_s")
        if not is_finite(self.start_hour) or not 0 <= self.start_hour < 24:
            raise ValueError(f"start_hour: must be within [0, 24), got {self.start_hour!r}")

    @property
    def duration_s(self) -> float:
        """Real seconds the run lasts: one simulated day."""
        return self.time_scale.day_real_s

    @property
    def spawn_rate(self) -> float:
        return self.spawn_rate_per_s or max(1.0, self.peak_users / 10.0)

    def sim_time_of_day_s(self, run_time_s: float) -> float:
        return (self.start_hour * HOUR_S + self.time_scale.sim_s(run_time_s)) % DAY_S

    def users_at(self, run_time_s: float) -> int:
        frac = self.profile.fraction(self.sim_time_of_day_s(run_time_s))
        return max(self.min_users, round(self.peak_users * frac))

    def tick(self, run_time_s: float) -> tuple[int, float] | None:
        """``(users, spawn_rate)`` at ``run_time_s`` real seconds into the run, None once the day is over."""
        check_non_negative("run_time_s", run_time_s)
        if run_time_s >= self.duration_s:
            return None
        return self.users_at(run_time_s), self.spawn_rate


@dataclass(frozen=True)
class Stage:
    """Hold ``users`` for ``duration_s`` real seconds, reaching them at ``spawn_rate`` users/s."""

    duration_s: float
    users: int
    spawn_rate: float

    def __post_init__(self) -> None:
        check_fields(self, check_positive, "duration_s")
        check_fields(self, check_int, "users", minimum=0)
        check_fields(self, check_positive, "spawn_rate")


@dataclass(frozen=True)
class StepShape:
    """Stages played in order; ``tick`` → None after the last one ends."""

    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        stages = tuple(s if isinstance(s, Stage) else Stage(*s) for s in self.stages)
        object.__setattr__(self, "stages", stages)
        if not stages:
            raise ValueError("stages: need at least one stage")

    @property
    def duration_s(self) -> float:
        return math.fsum(s.duration_s for s in self.stages)

    def stage_at(self, run_time_s: float) -> Stage | None:
        check_non_negative("run_time_s", run_time_s)
        end_s = 0.0
        for stage in self.stages:
            end_s += stage.duration_s
            if run_time_s < end_s:
                return stage
        return None

    def tick(self, run_time_s: float) -> tuple[int, float] | None:
        stage = self.stage_at(run_time_s)
        return None if stage is None else (stage.users, stage.spawn_rate)


#: (duration_s, share of peak users) for the step/burst shape: a baseline, a step up,
#: a short burst to the peak, back to the baseline (does the stack recover?).
STEP_BURST_RATIOS: tuple[tuple[float, float], ...] = (
    (60.0, 0.2),
    (60.0, 0.5),
    (30.0, 1.0),
    (60.0, 0.2),
)


def step_burst(
    peak_users: int,
    ratios: tuple[tuple[float, float], ...] = STEP_BURST_RATIOS,
    time_scale: TimeScale = TimeScale(1.0),
) -> StepShape:
    """``StepShape`` from a ``(duration_s, share of peak)`` table; durations divided by the time scale.

    Each stage spawns fast enough to reach its users within ~2 s (a burst is a burst).
    """
    check_int("peak_users", peak_users, minimum=1)
    if not ratios:
        raise ValueError("ratios: need at least one (duration_s, share) row")
    stages = []
    for duration_s, share in ratios:
        if not is_finite(share) or not 0 <= share <= 1:
            raise ValueError(f"share: must be within [0, 1], got {share!r}")
        check_positive("duration_s", duration_s)
        users = max(1, math.ceil(peak_users * share)) if share > 0 else 0
        stages.append(Stage(duration_s / time_scale.factor, users, max(1.0, users / 2.0)))
    return StepShape(tuple(stages))
