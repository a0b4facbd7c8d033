"""Batch work in the capacity interactive traffic leaves: how many batch lines a router may
start for a model now, how long a failed line waits before it is tried again, and how much
of the spare capacity batch work used.

- **Rows** (``batch_rows``): a batch row started now holds a slot of the model's gate for
  about one service time, and every interactive request that arrives meanwhile must still
  find a free slot. So batch may fill only what the gate's limit leaves beyond the
  interactive rows in flight, the interactive arrivals expected within one service time
  (``ceil(rate x service_s)``) and a fixed reserve (``reserve_rows``: what the forecast
  misses, a burst above the rate); the batch rows already held count against that room.
  Only at level 0: any higher level sheds an interactive class, and batch, below them all,
  stops first. Invariant: while arrivals within one service time stay within the forecast
  plus the reserve, interactive + batch rows never pass the limit, so batch makes no
  interactive request wait; a rising rate takes batch to 0 first (batch rows end within a
  service time and are not replaced).
- **The engine's step** (``step_cap``, ``RowsReference``): the gate's limit is the rows the
  engine runs *usefully*, not the rows at which an interactive answer stays as fast, and
  every row in a step slows the step: ``step(rows) = a + b x rows`` (the gate's
  ``StepCurve`` fit, ``ballast.policies.engines``). So batch rows are also kept within a
  second bound, on the total rows (interactive + batch): at most ``R`` where
  ``step(R) = (1 + slack) x step(r)``, i.e. ``R = r + slack x (a / b + r)``, and ``r`` the
  larger of the interactive rows now and ``RowsReference``'s: a high quantile over the last
  ``reference_s`` (a day) of the rows interactive traffic would hold by itself
  (``rows_alone``: its arrival rate, its answers' tokens and the curve, by Little's law;
  not the rows in flight, which batch itself would raise). At the day's peak (interactive
  rows at or above the reference) a batch row makes an interactive step at most ``slack``
  slower; in the valley batch fills the engine up to the step the peak's interactive
  traffic made by itself, so an interactive answer in the valley is no slower than one at
  the peak was without batch, and the day's tail latency moves by ``slack`` at most.
  Without a fit yet: one batch row beside the interactive ones; with no interactive row in
  the reference window (a model that serves batch alone, or a router that has seen none
  since it started): the gate's limit, until the first interactive row is sampled.
- **Backoff** (``full_jitter_s``): AWS's full jitter, the router's own retry backoff
  (``ballast.policies.retry.backoff_s``) with the batch's base and cap.
- **Spare used** (``spare_tokens``, ``SpareMeter``): per interval, the tokens the engine
  could serve at its measured capacity less the interactive tokens it served (never below
  0) are the spare; the batch tokens served over the spare summed is ``spare_used``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from ballast.policies.retry import RetryConfig, backoff_s
from ballast.policies.validation import check_int, check_non_negative, check_positive

# rate x service_s a hair above an integer (1.1 x 100 = 110.00000000000001) is that integer:
# without it a whole slot would be kept for a float's rounding.
_EPSILON = 1e-9


def expected_arrivals(rate_per_s: float, service_s: float) -> int:
    """Interactive arrivals expected within one service time, rounded up."""
    return max(0, math.ceil(rate_per_s * service_s - _EPSILON))


def batch_rows(
    level: int,
    limit: int,
    in_flight_interactive: int,
    interactive_rate_per_s: float,
    service_s: float,
    reserve_rows: int,
    held_batch: int,
    rows_cap: int | None = None,
) -> int:
    """How many more batch lines a router may start for a model now (never negative): 0
    unless ``level`` is 0, else the gate ``limit`` less the interactive rows in flight, the
    interactive arrivals expected within ``service_s`` and ``reserve_rows``, and no more than
    ``rows_cap`` (``step_cap``; None: no such bound) less the interactive rows in flight;
    less the ``held_batch`` rows batch holds already (why: the module docstring)."""
    check_int("level", level, minimum=0)
    check_int("limit", limit, minimum=0)
    check_int("in_flight_interactive", in_flight_interactive, minimum=0)
    check_non_negative("interactive_rate_per_s", interactive_rate_per_s)
    check_non_negative("service_s", service_s)
    check_int("reserve_rows", reserve_rows, minimum=0)
    check_int("held_batch", held_batch, minimum=0)
    if level != 0:
        return 0
    room = limit - in_flight_interactive - expected_arrivals(interactive_rate_per_s, service_s) - reserve_rows
    if rows_cap is not None:
        check_int("rows_cap", rows_cap, minimum=0)
        room = min(room, rows_cap - in_flight_interactive)
    return max(0, room - held_batch)


def step_cap(
    fit: tuple[float, float] | None,
    interactive_rows: int,
    reference_rows: int | None,
    slack: float,
    limit: int,
) -> int:
    """The most rows, interactive and batch together, a model's engine may run now so that
    batch work leaves interactive steps within ``slack`` (the module docstring): with the
    step curve's ``fit`` ``(a, b)``, ``floor(r + slack x (a / b + r))`` for ``r`` the largest
    of ``interactive_rows``, ``reference_rows`` and 1 (the row of an interactive request that
    arrives now); ``limit`` when ``reference_rows`` is
    None (no interactive traffic in the reference window) or rows cost nothing (``b <= 0``);
    one more than ``interactive_rows`` when there is no fit yet. Never above ``limit``."""
    check_int("interactive_rows", interactive_rows, minimum=0)
    check_non_negative("slack", slack)
    check_int("limit", limit, minimum=0)
    if reference_rows is None:
        return limit
    check_int("reference_rows", reference_rows, minimum=0)
    if fit is None:
        return min(limit, interactive_rows + 1)
    a, b = fit
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return limit
    r = max(interactive_rows, reference_rows, 1)  # an interactive arrival sees its own row at least
    rows = math.floor(r + slack * (max(a, 0.0) / b + r) + _EPSILON)
    return max(0, min(limit, rows))


def rows_alone(rate_per_s: float, tokens_per_answer: float, fit: tuple[float, float], limit: int) -> int:
    """The rows interactive traffic would hold by itself at ``rate_per_s`` answers of
    ``tokens_per_answer`` tokens, on the step curve ``fit`` ``(a, b)`` (service per token
    ``a + b x rows``): Little's law, ``r = rate x tokens x (a + b x r)``, so
    ``r = rate x tokens x a / (1 - rate x tokens x b)``, rounded up; ``limit`` where the
    engine cannot keep up at any rows (``rate x tokens x b >= 1``). Read from the arrival
    rate, not from the rows in flight: rows in flight grow when batch slows the answers,
    and a reference taken from them would let batch grow itself."""
    check_non_negative("rate_per_s", rate_per_s)
    check_non_negative("tokens_per_answer", tokens_per_answer)
    check_int("limit", limit, minimum=0)
    a, b = max(fit[0], 0.0), max(fit[1], 0.0)
    demand = rate_per_s * tokens_per_answer  # tokens per second asked
    if demand * b >= 1.0:
        return limit
    return min(limit, math.ceil(demand * a / (1.0 - demand * b) - _EPSILON))


REFERENCE_QUANTILE = 0.95  # RowsReference: the interactive rows' level it keeps
MAX_REFERENCE_ROWS = 1024  # its histogram's bins (rows above are counted in the last)


class RowsReference:
    """A high quantile (``REFERENCE_QUANTILE``) of a model's interactive rows at one router,
    sampled once per dispatch step, older samples weighing less (``horizon_s``: a sample
    that old weighs 1/e), on an injected clock. Bounded: one weight per rows value up to
    ``MAX_REFERENCE_ROWS``. ``value`` is None while no sample in the window had a row in
    flight (at least one sample's weight of them): no interactive traffic to keep room for."""

    def __init__(self, horizon_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        check_positive("horizon_s", horizon_s)
        self._horizon_s = horizon_s
        self._clock = clock
        self._at = clock()
        self._weights: list[float] = [0.0]

    def sample(self, rows: int) -> None:
        check_int("rows", rows, minimum=0)
        now = self._clock()
        if now > self._at:
            keep = math.exp(-(now - self._at) / self._horizon_s)
            self._weights = [w * keep for w in self._weights]
            self._at = now
        i = min(rows, MAX_REFERENCE_ROWS)
        if i >= len(self._weights):
            self._weights.extend([0.0] * (i + 1 - len(self._weights)))
        self._weights[i] += 1.0

    def value(self) -> int | None:
        """The rows at or below which ``REFERENCE_QUANTILE`` of the (weighted) samples lie."""
        if sum(self._weights[1:]) < 1.0:
            return None
        total = sum(self._weights)
        running = 0.0
        for rows, w in enumerate(self._weights):
            running += w
            if running >= REFERENCE_QUANTILE * total - _EPSILON:
                return rows
        return len(self._weights) - 1


def full_jitter_s(attempt: int, base_s: float, cap_s: float, rng: Callable[[], float]) -> float:
    """The wait before retry ``attempt`` (0: the first retry), uniform in
    [0, min(cap_s, base_s x 2**attempt)) from ``rng`` (u in [0, 1), e.g. an injected
    ``random.Random().random``). ``retry.backoff_s`` counts its first retry as 1."""
    check_int("attempt", attempt, minimum=0)
    return backoff_s(attempt + 1, RetryConfig(base_backoff_s=base_s, max_backoff_s=cap_s), rng)


def spare_tokens(capacity_tokens_per_s: float, interval_s: float, interactive_tokens: int) -> float:
    """Tokens the engine could have served beyond interactive demand in ``interval_s``: its
    capacity over the interval less the interactive tokens served, never below 0."""
    check_non_negative("capacity_tokens_per_s", capacity_tokens_per_s)
    check_non_negative("interval_s", interval_s)
    check_int("interactive_tokens", interactive_tokens, minimum=0)
    return max(0.0, capacity_tokens_per_s * interval_s - interactive_tokens)


class SpareMeter:
    """Spare tokens and the batch tokens served within them, interval by interval, on an
    injected clock. Each ``record`` closes the interval since the previous one (or since
    the meter was made): the caller passes the model's measured capacity for it and the
    tokens each kind of work was served in it. Counters only grow; nothing is kept per
    interval."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since_s = clock()
        self.intervals = 0
        self.spare_tokens = 0.0
        self.batch_tokens = 0
        self.interactive_tokens = 0

    def record(self, capacity_tokens_per_s: float, interactive_tokens: int, batch_tokens: int) -> float:
        """Close the interval ending now; returns its spare tokens."""
        check_int("batch_tokens", batch_tokens, minimum=0)
        now_s = self._clock()
        spare = spare_tokens(capacity_tokens_per_s, now_s - self._since_s, interactive_tokens)
        self._since_s = now_s
        self.intervals += 1
        self.spare_tokens += spare
        self.interactive_tokens += interactive_tokens
        self.batch_tokens += batch_tokens
        return spare

    def spare_used(self) -> float | None:
        """Batch tokens served over the spare tokens; None while there has been no spare.
        Above 1 when batch was served beyond the measured capacity (it is not clipped)."""
        return self.batch_tokens / self.spare_tokens if self.spare_tokens > 0 else None

    def snapshot(self) -> dict[str, Any]:
        return {
            "intervals": self.intervals,
            "spare_tokens": self.spare_tokens,
            "batch_tokens": self.batch_tokens,
            "interactive_tokens": self.interactive_tokens,
            "spare_used": self.spare_used(),
        }
