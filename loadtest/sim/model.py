"""What the simulated fleet is made of: the service-time model and the day's load.

**Service time.** A replica runs one batch of ``b`` requests at a time (Serve's
``@serve.batch``); each request in it takes ``s(b) = work × (t0 + t1·b)``
seconds, so a replica's throughput is ``b / s(b)`` requests per second. ``t0`` is
the per-step cost a batch amortizes (reading the weights: decoding is
memory-bound), ``t1`` what one more sequence adds. With the defaults a request
takes 0.41 s alone, 0.48 s in a batch of 8 (16.7 req/s per replica, the
autoscalers' target) and 0.72 s in a full batch of 32 (44.4 req/s), inside a
1 s SLO only if it hardly queues.

``work`` is how much of a request's generation is left after the degradation
level's ``max_tokens`` clamp: requested tokens are exponential (mean
``mean_tokens``), so the expected generated tokens are ``E[min(X, m)]`` and
``work = E[min(X, m)] / E[min(X, model_max)]``. With the default table and a
mean of 400 tokens, levels 0–2 cost almost nothing and levels 3–4 cut work to
92 % and 72 %.

A replica that is not saturated runs at the batch Little's law gives for its
arrival rate ``λ``: ``b = λ·s(b)``, i.e. ``b = λ·work·t0 / (1 − λ·work·t1)``,
capped at the level's ``max_batch_size``.

**Load.** A 24 h diurnal ratio of the noon peak (``diurnal_ratio``): a floor at
night, a Gaussian day centred on ``peak_hour``, and an evening flash crowd
(``Spike``) that ramps up in a minute to ``ratio`` × the noon peak. The rate is
sized so that the noon peak needs ``replicas_peak`` replicas at the autoscaler's
target concurrency. The spike (2× the noon peak, at 20:00 when the load is
~0.4× of it) needs five times the replicas running then; with 60–120 s cold
starts the fleet is overloaded for minutes, which is where shedding and
unbounded queueing part ways.

Pure functions and frozen dataclasses: no clock, no randomness here.
Written here rather than shared with ``loadtest/shapes.py`` (Locust stages in
wall time for real runs), which this module must not depend on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ballast.policies.criticality import Criticality
from ballast.policies.validation import check_fields, check_positive

#: Criticalities in rank order (critical_plus first); every per-class tuple in
#: the simulator uses this order.
CLASSES: tuple[Criticality, ...] = tuple(sorted(Criticality, key=lambda c: c.rank))


@dataclass(frozen=True)
class ServiceModel:
    t0_s: float = 0.4
    t1_s: float = 0.01
    mean_tokens: float = 400.0
    model_max_tokens: int = 8192

    def __post_init__(self) -> None:
        check_fields(self, check_positive, "t0_s", "t1_s", "mean_tokens", "model_max_tokens")

    def work_ratio(self, max_tokens: int) -> float:
        """Expected work under a ``max_tokens`` clamp, relative to the model's own limit."""
        m = min(max_tokens, self.model_max_tokens)
        return (1.0 - math.exp(-m / self.mean_tokens)) / (1.0 - math.exp(-self.model_max_tokens / self.mean_tokens))

    def service_s(self, batch: float, work: float = 1.0) -> float:
        """Seconds one request takes in a batch of ``batch``."""
        return work * (self.t0_s + self.t1_s * batch)

    def max_rate_per_s(self, max_batch: int, work: float = 1.0) -> float:
        """Requests per second of one saturated replica (full batches)."""
        return max_batch / self.service_s(max_batch, work)

    def batch_for_rate(self, rate_per_s: float, max_batch: int, work: float = 1.0) -> float:
        """The batch at which a replica serves ``rate_per_s`` (Little's law), capped at ``max_batch``."""
        if rate_per_s <= 0:
            return 0.0
        denom = 1.0 - rate_per_s * work * self.t1_s
        if denom <= 0:
            return float(max_batch)
        return min(float(max_batch), rate_per_s * work * self.t0_s / denom)


@dataclass(frozen=True)
class Spike:
    """The evening flash crowd: a trapezoid in hours of the day, as a ratio of the noon peak."""

    start_hour: float = 20.0
    ramp_up_s: float = 60.0
    hold_s: float = 900.0
    ramp_down_s: float = 300.0
    ratio: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.start_hour < 24:
            raise ValueError(f"start_hour: must be in [0, 24), got {self.start_hour!r}")
        check_fields(self, check_positive, "ramp_up_s", "ramp_down_s")
        if self.hold_s < 0 or self.ratio < 0:
            raise ValueError("hold_s, ratio: must be >= 0")

    def level(self, hour_of_day: float) -> float:
        x = (hour_of_day - self.start_hour) * 3600.0
        if x < 0:
            return 0.0
        if x < self.ramp_up_s:
            return x / self.ramp_up_s
        x -= self.ramp_up_s
        if x < self.hold_s:
            return 1.0
        x -= self.hold_s
        if x < self.ramp_down_s:
            return 1.0 - x / self.ramp_down_s
        return 0.0


@dataclass(frozen=True)
class LoadProfile:
    trough_ratio: float = 0.2
    peak_hour: float = 12.5
    peak_width_h: float = 4.0
    spike: Spike | None = Spike()

    def __post_init__(self) -> None:
        if not 0 <= self.trough_ratio <= 1:
            raise ValueError(f"trough_ratio: must be in [0, 1], got {self.trough_ratio!r}")
        check_fields(self, check_positive, "peak_width_h")

    def ratio(self, hour_of_day: float) -> float:
        """Arrival rate at ``hour_of_day`` as a ratio of the noon peak's (1.0 at ``peak_hour``)."""
        z = (hour_of_day - self.peak_hour) / self.peak_width_h
        day = self.trough_ratio + (1.0 - self.trough_ratio) * math.exp(-0.5 * z * z)
        if self.spike is None:
            return day
        # The spike rises to ``ratio`` × peak, whatever the day curve is doing then.
        s = self.spike.level(hour_of_day)
        return day + s * max(0.0, self.spike.ratio - day)
