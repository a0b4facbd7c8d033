"""An adaptive concurrency limit on the way to the model (AIMD on queue wait).

The degradation level sheds whole criticality classes, which is coarse: at four times
capacity, dropping to "critical only" can leave the model half idle, and keeping
"critical + sheddable_plus" can still queue far past any deadline. The limit here is
the fine control underneath. Each router lets at most ``value`` requests be at the
model at once; the rest wait at the router, most critical first (ballast/policies/gate.py
decides, ballast/router/gate.py holds the waiters).

How the limit moves (per ``interval_s`` window, on an injected clock):

- the window's p90 queue wait (time at the model before compute starts) above
  ``target_wait_ms`` means the model is queueing, and an admitted request that ran
  out of its deadline at the model means the limit let in more than the model could
  answer in time (with iteration-level batching a row joins at once and the whole
  batch slows down, so overload shows as slower steps, not as waiting): either
  multiplies the limit by ``decrease_factor``; so does a window whose p90 service
  time (slot to answer) is over ``target_service_ratio`` of the requests' own time
  budgets: the batch is slowing toward the deadlines, and backing off before they
  are missed avoids the burst of misses that a limit creeping up to the wall costs
  (every row of a batch that got too slow misses together). The default, 0.4, keeps
  most of a request's budget for the wait line, where order by criticality works:
  past the model's knee (a compute-bound batch answers no more rows per second for
  being bigger) a higher limit only lengthens every service time, and each
  millisecond of it is one the line no longer has;
- otherwise, if the limit was reached during the window (requests were held back),
  add one: there may be room;
- otherwise hold: a limit nobody reaches says nothing about the model.

A cut by the slow rule is a trial (``slow_cut_min_gain``): it must make the engine's
service faster. Past a batch's knee, fewer rows make each row's token come sooner; an
engine whose step time is the host's (vLLM on a CPU) or a burst of long prompts does not
speed up for fewer rows, and there each cut only lowers throughput. So the window after
next (the one after is still mostly requests begun before the cut) compares the median
time per generated token with the cut window's: a cut that did not buy at least
``slow_cut_min_gain`` of the speedup its share of rows would (a cut of 10 % by 0.8: 8 %
faster) is undone, and the slow rule rests while service stays within
``SLOW_REARM`` of where the cut did not help, for at most ``SLOW_REST_S``. With a step
time ``a + b x rows``, a 10 % cut speeds each token by ``10 % x b rows / (a + b rows)`` and
costs ``10 % x a / (a + b rows)`` of throughput: 0.8 keeps only cuts that cost at most a
fifth of their share, so the slow rule settles where the engine answers 0.8 or more of
what it can, never lower. Only the slow
rule is tried this way: a queue wait over target or a deadline missed at the model says
the engine holds more than it serves, and those cuts stand. The latency budget still
decides, at the wait line (``ballast.policies.gate``), which requests can make their
deadline; the engine's answer to a cut decides how many rows it runs.

For an engine that schedules itself (vLLM), the slow rule is off and the limit follows
the engine's curve instead (``rows_curve_gain``): each window gives one point, the mean
rows this caller had at the model and the median service time per generated token of
the answers that came back, and a ``StepCurve`` (ballast/policies/engines.py) fits
``a + b x rows`` through them. Its knee, where more rows stop buying throughput (``gain``
of the asymptote), caps the limit as a ceiling does: past it, more rows make every
answer slower and no more of them. The knee is measured on this host, so a slower host
moves ``a`` and ``b`` together and keeps it; the latency budget still decides, at the wait
line, which requests can make their deadline. Ballast's own engines keep the slow rule:
their batch is the replica's, sized by its scheduler's KV budget, and for them a cut
does make each token sooner (the trial above checks that it does).

So the model's own queue stays near the target, and what does not fit waits in an
order that matters (criticality) instead of a FIFO that does not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ballast.policies.engines import DEFAULT_GAIN, StepCurve
from ballast.policies.stats import nearest_rank
from ballast.policies.validation import check_fields, check_int, check_positive, check_ratio

MAX_SAMPLES = 1024  # queue-wait samples kept per window (bounded)
SLOW_REARM = 1.25  # the slow rule rests until service per token is this much slower than when a cut did not help
SLOW_REST_S = 30.0  # ... or this long: the engine's answer to a cut is asked again
CURVE_HORIZON = 240  # windows the rows curve remembers (older ones weigh less): 2 min at 0.5 s
CURVE_MIN_WINDOWS = 20  # windows with answers before the curve caps the limit


@dataclass(frozen=True)
class LimiterConfig:
    initial: int = 16
    min_limit: int = 4
    max_limit: int = 256
    target_wait_ms: float = 300.0
    interval_s: float = 0.5
    decrease_factor: float = 0.9
    target_service_ratio: float | None = 0.4
    slow_cut_min_gain: float | None = 0.8  # None: a slow cut always stands
    rows_curve_gain: float | None = None  # the rows curve's knee caps the limit; None: off

    def __post_init__(self) -> None:
        check_fields(self, check_int, "min_limit", minimum=1)
        check_fields(self, check_int, "initial", minimum=self.min_limit)
        check_fields(self, check_int, "max_limit", minimum=self.initial)
        check_fields(self, check_positive, "target_wait_ms", "interval_s")
        check_fields(self, check_ratio, "target_service_ratio", "slow_cut_min_gain", optional=True)
        check_fields(self, check_ratio, "rows_curve_gain", optional=True)
        if self.rows_curve_gain == 1:  # the asymptote itself is never reached
            raise ValueError("rows_curve_gain: must be in (0, 1), got 1")
        check_fields(self, check_ratio, "decrease_factor")
        if self.decrease_factor == 1:  # (0, 1]: a factor of 1 would never decrease
            raise ValueError(f"decrease_factor: must be in (0, 1), got {self.decrease_factor!r}")


class AimdLimit:
    """The limit and its window; ``observe`` / ``saturated`` feed it, ``value`` reads it."""

    def __init__(self, cfg: LimiterConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self._clock = clock
        self._value = float(cfg.initial)
        self._waits: list[float] = []
        self._ratios: list[float] = []
        self._per_token: list[float] = []  # seconds of service per generated token
        # A slow cut on trial: (limit before, service per token then, windows until judged).
        self._trial: tuple[float, float, int] | None = None
        # The slow rule rests: (service per token where a cut did not help, until when).
        self._rest: tuple[float, float] | None = None
        self.undone = 0  # slow cuts undone: they did not make service faster
        self._saturated = False
        self._missed = False
        self._window_end = clock() + cfg.interval_s
        self._ceiling: int | None = None
        # Fitted for every engine (batch dispatch reads it: ``curve_fit``); its knee caps the
        # limit only where ``rows_curve_gain`` is set.
        self._curve = StepCurve(
            CURVE_HORIZON, cfg.rows_curve_gain or DEFAULT_GAIN, min_weight=CURVE_MIN_WINDOWS, min_rows=cfg.min_limit
        )
        self._knee: int | None = None  # the curve's, as of the last window (where it caps)
        self._fit: tuple[float, float] | None = None  # the curve's last fit, kept while a window gives none
        # Rows this caller has at the model now, and their integral over the window.
        self._rows, self._rows_at, self._rows_area = 0, clock(), 0.0
        self._window_start = clock()
        self.decreases = 0
        self.increases = 0
        # Why the limit went down, by signal (a window may carry more than one; the first
        # in this order is counted): a deadline missed, a slow service, a queue wait.
        self.decreases_by = {"missed": 0, "slow": 0, "wait": 0}

    @property
    def value(self) -> int:
        self._tick()
        cap = self._cap()
        return int(self._value) if cap is None else max(1, min(int(self._value), cap))

    def _cap(self) -> int | None:
        """The ceiling and the rows curve's knee, the lower of those known."""
        caps = [c for c in (self._ceiling, self._knee) if c is not None]
        return min(caps) if caps else None

    def rows_in_flight(self, rows: int) -> None:
        """This caller's requests at the model now (the gate says so at every change)."""
        now = self._clock()
        self._tick()
        self._rows_area += self._rows * (now - max(self._rows_at, self._window_start))
        self._rows, self._rows_at = rows, now

    def set_ceiling(self, ceiling: int | None) -> None:
        """What the model can take at once from this caller (None: no ceiling).

        Beyond it requests would queue in Serve's handle, first in first out: the
        gate's order by criticality would be lost, and a request's deadline would run
        out where the replica cannot see it (so its timeout reads as a model failure).
        The AIMD value is not grown past it either, so a ceiling that rises again
        (a replica added) is climbed to, not jumped over.
        """
        self._ceiling = None if ceiling is None else max(1, int(ceiling))

    def observe(self, wait_ms: float) -> None:
        """One request's queue wait at the model (ms)."""
        self._tick()
        if len(self._waits) < MAX_SAMPLES:
            self._waits.append(wait_ms)

    def observe_service(self, ratio: float, per_token_s: float | None = None) -> None:
        """One answered request's service time over its own time budget (0..1+), and its
        service time per generated token (None: not known; the slow cut's trial reads it)."""
        self._tick()
        if len(self._ratios) < MAX_SAMPLES:
            self._ratios.append(ratio)
        if per_token_s is not None and len(self._per_token) < MAX_SAMPLES:
            self._per_token.append(per_token_s)

    def observe_tokens(self, per_token_s: float) -> None:
        """Service per generated token of an answer the slow rule does not judge (a batch
        line): a point for the rows curve only."""
        self._tick()
        if len(self._per_token) < MAX_SAMPLES:
            self._per_token.append(per_token_s)

    def missed(self) -> None:
        """An admitted request ran out of its deadline at the model."""
        self._tick()
        self._missed = True

    def saturated(self) -> None:
        """A request found the limit reached."""
        self._tick()
        self._saturated = True

    def _tick(self) -> None:
        now = self._clock()
        if now < self._window_end:
            return
        c = self.cfg
        # nearest_rank is None for no samples.
        per_token = nearest_rank(self._per_token, 0.5)
        undone = self._judge_trial(per_token)
        slow = (
            c.target_service_ratio is not None
            and (ratio_p90 := nearest_rank(self._ratios, 0.9)) is not None
            and ratio_p90 > c.target_service_ratio
            and not undone
            and self._trial is None  # a slow cut on trial: its verdict first
            and not self._resting(now, per_token)
        )
        self._fit_rows(now, per_token)
        wait_p90 = nearest_rank(self._waits, 0.9)
        waited = wait_p90 is not None and wait_p90 > c.target_wait_ms
        if self._missed or slow or waited:
            before = self._value
            self._value = max(float(c.min_limit), math.floor(self._value * c.decrease_factor))
            self.decreases += 1
            self.decreases_by["missed" if self._missed else "slow" if slow else "wait"] += 1
            if self._missed or waited:
                self._trial = None  # the engine holds more than it serves: the cut stands
            elif c.slow_cut_min_gain is not None and per_token is not None and self._value < before:
                self._trial = (before, per_token, 2)
        elif (
            self._saturated
            and self._trial is None
            and not undone
            and ((cap := self._cap()) is None or self._value < cap)
        ):
            self._value = min(float(c.max_limit), self._value + 1.0)
            self.increases += 1
        self._waits = []
        self._ratios = []
        self._per_token = []
        self._saturated = False
        self._missed = False
        # Windows with no traffic at all are skipped, not replayed one by one.
        self._window_end = now + c.interval_s

    def _fit_rows(self, now: float, per_token: float | None) -> None:
        """The window's point on the rows curve (its mean rows at the model, its answers'
        median service per token), the fit and the knee as of now; then a new window's rows.
        A fit stands until the next one (rows that stop varying give none)."""
        span = now - self._window_start
        area = self._rows_area + self._rows * (now - max(self._rows_at, self._window_start))
        if per_token is not None and span > 0:
            self._curve.observe(area / span, per_token)
        self._fit = self._curve.fit() or self._fit
        if self.cfg.rows_curve_gain is not None:
            self._knee = self._curve.rows()
        self._rows_area, self._window_start = 0.0, now

    def curve_fit(self) -> tuple[float, float] | None:
        """The rows curve's ``(a, b)`` as last fitted (``StepCurve.fit``); None before the first."""
        self._tick()
        return self._fit

    def _judge_trial(self, per_token: float | None) -> bool:
        """The slow cut on trial, judged in the window after next: undone (True) when service
        per token did not fall by ``slow_cut_min_gain`` of the cut's share of rows."""
        if self._trial is None or per_token is None:
            return False
        before, then, windows = self._trial
        if windows > 1:
            self._trial = (before, then, windows - 1)
            return False
        self._trial = None
        assert self.cfg.slow_cut_min_gain is not None  # a trial is only opened with it
        expected = self.cfg.slow_cut_min_gain * (1.0 - self._value / before)
        if per_token <= then * (1.0 - expected):
            return False  # the cut made service faster: it stands
        self._value = max(self._value, before)
        self.undone += 1
        self._rest = (then, self._clock() + SLOW_REST_S)
        return True

    def _resting(self, now: float, per_token: float | None) -> bool:
        """The slow rule rests after a cut it made did not help, until service per token
        is ``SLOW_REARM`` slower than then or ``SLOW_REST_S`` have passed."""
        if self._rest is None:
            return False
        then, until = self._rest
        if now >= until or (per_token is not None and per_token > then * SLOW_REARM):
            self._rest = None
            return False
        return True

    def snapshot(self) -> dict[str, Any]:
        return {
            "limit": self.value,
            # what the model takes from this caller (its replicas' slots, or the rows its
            # engines run usefully, this router's share); None: not known yet
            "ceiling": self._ceiling,
            "increases": self.increases,
            "decreases": self.decreases,
            "decreases_by": dict(self.decreases_by),
            "slow_cuts_undone": self.undone,
            # the rows curve: its fit, and its knee where it caps the limit (rows_curve_gain)
            "rows_curve": {**self._curve.snapshot(), "rows": self._knee},
            # this window's samples so far, each list bounded by MAX_SAMPLES
            "window_samples": max(len(self._waits), len(self._ratios)),
        }
