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

So the model's own queue stays near the target, and what does not fit waits in an
order that matters (criticality) instead of a FIFO that does not.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ballast.policies.stats import nearest_rank
from ballast.policies.validation import check_fields, check_int, check_positive, check_ratio

MAX_SAMPLES = 1024  # queue-wait samples kept per window (bounded)


@dataclass(frozen=True)
class LimiterConfig:
    initial: int = 16
    min_limit: int = 4
    max_limit: int = 256
    target_wait_ms: float = 300.0
    interval_s: float = 0.5
    decrease_factor: float = 0.9
    target_service_ratio: Optional[float] = 0.4

    def __post_init__(self) -> None:
        check_fields(self, check_int, "min_limit", minimum=1)
        check_fields(self, check_int, "initial", minimum=self.min_limit)
        check_fields(self, check_int, "max_limit", minimum=self.initial)
        check_fields(self, check_positive, "target_wait_ms", "interval_s")
        check_fields(self, check_ratio, "target_service_ratio", optional=True)
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
        self._saturated = False
        self._missed = False
        self._window_end = clock() + cfg.interval_s
        self._ceiling: Optional[int] = None
        self.decreases = 0
        self.increases = 0
        # Why the limit went down, by signal (a window may carry more than one; the first
        # in this order is counted): a deadline missed, a slow service, a queue wait.
        self.decreases_by = {"missed": 0, "slow": 0, "wait": 0}

    @property
    def value(self) -> int:
        self._tick()
        v = int(self._value)
        return v if self._ceiling is None else max(1, min(v, self._ceiling))

    def set_ceiling(self, ceiling: Optional[int]) -> None:
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

    def observe_service(self, ratio: float) -> None:
        """One answered request's service time over its own time budget (0..1+)."""
        self._tick()
        if len(self._ratios) < MAX_SAMPLES:
            self._ratios.append(ratio)

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
        slow = (
            c.target_service_ratio is not None
            and (ratio_p90 := nearest_rank(self._ratios, 0.9)) is not None
            and ratio_p90 > c.target_service_ratio
        )
        wait_p90 = nearest_rank(self._waits, 0.9)
        waited = wait_p90 is not None and wait_p90 > c.target_wait_ms
        if self._missed or slow or waited:
            self._value = max(float(c.min_limit), math.floor(self._value * c.decrease_factor))
            self.decreases += 1
            self.decreases_by["missed" if self._missed else "slow" if slow else "wait"] += 1
        elif self._saturated and (self._ceiling is None or self._value < self._ceiling):
            self._value = min(float(c.max_limit), self._value + 1.0)
            self.increases += 1
        self._waits = []
        self._ratios = []
        self._saturated = False
        self._missed = False
        # Windows with no traffic at all are skipped, not replayed one by one.
        self._window_end = now + c.interval_s

    def snapshot(self) -> dict[str, Any]:
        return {
            "limit": self.value,
            "increases": self.increases,
            "decreases": self.decreases,
            "decreases_by": dict(self.decreases_by),
            # this window's samples so far, each list bounded by MAX_SAMPLES
            "window_samples": max(len(self._waits), len(self._ratios)),
        }
