"""Circuit breaker: one per backend, judged on failure rate and slow-call rate.

States (the ``ballast_breaker_state`` gauge values): CLOSED=0, OPEN=1, HALF_OPEN=2.

* **CLOSED.** Every call passes; outcomes go into a ``ballast.policies.window`` window, the
  last ``window_size`` calls (``window_kind="count"``) or ``window_s`` seconds
  (``"time"``). Once it holds ``min_calls`` calls, the breaker opens when the failure
  ratio reaches ``failure_rate_threshold`` or the slow-call ratio reaches
  ``slow_call_rate_threshold``. A call longer than ``slow_call_duration_s`` is slow
  whatever its outcome (as resilience4j counts): a slow failure is a failure and slow.
* **OPEN.** Every call is refused for ``open_duration_s`` ± ``open_jitter_ratio``
  (injected rng), so the routers' breakers for one backend do not probe it together.
* **HALF_OPEN.** Entered lazily, by the first ``allow()``/``state``/``snapshot()``/
  ``retry_after_s()`` after the open period. At most N = ``half_open_max_probes``
  probes are handed out in all. With ``required = ceil(half_open_success_threshold ×
  N)``: reopen as soon as more than ``N - required`` probes failed (the threshold is
  out of reach); else, once all N reported, reopen if their slow-call ratio reaches
  ``slow_call_rate_threshold``, otherwise close.
* **A half-open period ends by itself** ``half_open_max_wait_s`` after its first probe
  (resilience4j's ``maxWaitDurationInHalfOpenState``): back to OPEN, since an
  unanswered probe is no sign of health, so a permit never handed back cannot hold the
  breaker half-open. A period nobody probed never times out; one whose probes were all
  released starts over. The default, ``resilience.max_deadline_s``, cuts no probe that
  could still answer.

Invariants. Every transition empties the window and starts a new epoch; an outcome
whose permit is from an older epoch is ignored. ``record()`` and ``release()`` act
once per permit (record in one branch, release in a ``finally``); ``release()`` frees
a probe slot and counts nothing. No method awaits and the router calls from its one
event-loop thread, so ``allow()``'s check-then-increment of the probe count cannot
interleave: that bounds the probes without a lock (threads would need one around
every method). ``on_event`` runs synchronously, once per state change, after the
state is updated (it may read ``snapshot()``); it must not raise.

Written by hand: pybreaker counts consecutive failures (no rate window, no slow calls,
one trial call, wall clock), resilience4j is Java; neither takes an injected clock.
"""

from __future__ import annotations

import enum
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ballast.policies.validation import check_fields, check_int, check_name, check_positive, check_ratio, is_number
from ballast.policies.window import CountWindow, TimeWindow

# Ratios are compared as ``count >= threshold × total``; the product of a
# decimal threshold and an integer can land a hair above the integer it means
# (0.7 × 10 = 7.000000000000001), which without this tolerance would need one
# more failure than configured.
_EPSILON = 1e-9

WINDOW_KINDS = ("count", "time")


def _reaches(count: int, total: int, threshold: float) -> bool:
    return count >= threshold * total - _EPSILON


class BreakerState(enum.IntEnum):
    """Breaker states; the values are the ``ballast_breaker_state`` gauge values."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass(frozen=True)
class BreakerConfig:
    """Per-backend breaker settings. Defaults follow the seeds: 50 % failures
    over 100 calls (or 60 s), at least 10 calls, open 30 s, 5 probes."""

    #: "count": the last ``window_size`` calls; "time": the last ``window_s`` seconds.
    window_kind: str = "count"
    window_size: int = 100
    window_s: float = 60.0
    #: No judgement while the window holds fewer calls than this.
    min_calls: int = 10
    #: Open when failures / calls >= this.
    failure_rate_threshold: float = 0.5
    #: A success strictly slower than this is a slow call.
    slow_call_duration_s: float = 10.0
    #: Open when slow calls / calls >= this; 1.0 = only when every call is slow.
    slow_call_rate_threshold: float = 1.0
    open_duration_s: float = 30.0
    #: Actual open period = open_duration_s × (1 + ratio × (2u − 1)), u ~ U[0, 1).
    open_jitter_ratio: float = 0.1
    #: Probes handed out in total per half-open period (hence also the in-flight cap).
    half_open_max_probes: int = 5
    #: Close when ok probes / probes >= this (see the module docstring for the rule).
    half_open_success_threshold: float = 0.8
    #: Longest a half-open period may wait for its decision after its first probe
    #: was handed out; then back to OPEN (lost probes cannot wedge the breaker).
    half_open_max_wait_s: float = 120.0
    #: Bound on one-second buckets of the time window (memory bound).
    max_time_window_buckets: int = 600

    def __post_init__(self) -> None:
        if self.window_kind not in WINDOW_KINDS:
            raise ValueError(f"window_kind: must be one of {WINDOW_KINDS}, got {self.window_kind!r}")
        check_fields(self, check_int, "window_size", minimum=1)
        check_fields(self, check_positive, "window_s")
        check_fields(self, check_int, "min_calls", minimum=1)
        # A count window smaller than min_calls could never be judged: the breaker
        # would silently never open.
        if self.window_kind == "count" and self.min_calls > self.window_size:
            raise ValueError(
                f"min_calls: must be <= window_size ({self.window_size}) for a count window, got {self.min_calls}"
            )
        check_fields(self, check_ratio, "failure_rate_threshold")
        check_fields(self, check_positive, "slow_call_duration_s")
        check_fields(self, check_ratio, "slow_call_rate_threshold")
        check_fields(self, check_positive, "open_duration_s")
        if not is_number(self.open_jitter_ratio) or not 0 <= self.open_jitter_ratio < 1:
            raise ValueError(f"open_jitter_ratio: must be in [0, 1), got {self.open_jitter_ratio!r}")
        check_fields(self, check_int, "half_open_max_probes", minimum=1)
        check_fields(self, check_ratio, "half_open_success_threshold")
        check_fields(self, check_positive, "half_open_max_wait_s")
        check_fields(self, check_int, "max_time_window_buckets", minimum=1)
        if self.window_kind == "time" and math.ceil(self.window_s) > self.max_time_window_buckets:
            raise ValueError(
                f"window_s: needs {math.ceil(self.window_s)} one-second buckets, more than "
                f"max_time_window_buckets ({self.max_time_window_buckets})"
            )

    @property
    def half_open_required_ok(self) -> int:
        """Successful probes needed out of ``half_open_max_probes`` to close."""
        return math.ceil(self.half_open_success_threshold * self.half_open_max_probes - _EPSILON)


@dataclass(frozen=True)
class BreakerEvent:
    """One state change; exactly one is emitted per transition."""

    backend: str
    from_state: BreakerState
    to_state: BreakerState
    at_s: float
    reason: str


class Permit:
    """Leave to make one call, returned by ``CircuitBreaker.allow()``.

    Hand it back exactly once through ``record()`` (the call was made) or
    ``release()`` (it was not); further hand-backs are ignored.
    """

    __slots__ = ("_owner", "_epoch", "is_probe", "started_s", "_done")

    def __init__(self, owner: CircuitBreaker, epoch: int, is_probe: bool, started_s: float) -> None:
        self._owner = owner
        self._epoch = epoch
        self.is_probe = is_probe
        self.started_s = started_s
        self._done = False

    @property
    def done(self) -> bool:
        """True once recorded or released."""
        return self._done

    def __repr__(self) -> str:
        kind = "probe" if self.is_probe else "call"
        return f"Permit({kind}, started_s={self.started_s!r}, done={self._done})"


# --------------------------------------------------------------------------- breaker


class CircuitBreaker:
    """The breaker for one backend. See the module docstring for the rules."""

    def __init__(
        self,
        backend: str,
        cfg: BreakerConfig,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        on_event: Callable[[BreakerEvent], None] = lambda e: None,
    ) -> None:
        check_name("backend", backend)
        if not isinstance(cfg, BreakerConfig):
            raise ValueError(f"cfg: must be a BreakerConfig, got {cfg!r}")
        self._backend = backend
        self._cfg = cfg
        self._clock = clock
        # A private Random seeded from OS entropy: each router's breakers get their
        # own jitter (the point of it) without touching the global ``random`` state.
        self._rng = rng if rng is not None else random.Random()
        self._on_event = on_event

        # Each sample: (1 call, failed, slow); the totals are (calls, failures, slow calls).
        self._window: CountWindow[tuple[int, int, int]] | TimeWindow = (
            CountWindow(cfg.window_size, fields=3)
            if cfg.window_kind == "count"
            else TimeWindow(1.0, math.ceil(cfg.window_s), fields=3)
        )
        self._state = BreakerState.CLOSED
        # Bumped on every transition; permits from an older epoch are stale.
        self._epoch = 0
        self._opened_until_s: float | None = None
        self._open_period_s = 0.0
        # Half-open tallies, reset on every transition into HALF_OPEN.
        # Invariant: 0 <= probes_in_flight <= probes_admitted <= half_open_max_probes.
        self._probes_admitted = 0  # handed out minus released
        self._probes_in_flight = 0
        self._probes_ok = 0  # successes, slow ones included
        self._probes_failed = 0
        self._probes_slow = 0
        # When this half-open period handed out its first probe; None before one
        # (see "Half-open ends by itself").
        self._first_probe_s: float | None = None

    # ------------------------------------------------------------------ read side

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def config(self) -> BreakerConfig:
        return self._cfg

    @property
    def state(self) -> BreakerState:
        """Current state, after the lazy OPEN → HALF_OPEN check."""
        self._refresh(self._clock())
        return self._state

    def retry_after_s(self) -> float:
        """Seconds until the open period ends; 0 when not open."""
        now_s = self._clock()
        self._refresh(now_s)
        if self._state is BreakerState.OPEN and self._opened_until_s is not None:
            return max(0.0, self._opened_until_s - now_s)
        return 0.0

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready view for ``/v1/status`` and metrics."""
        now_s = self._clock()
        self._refresh(now_s)
        calls, failures, slow = self._window.totals(now_s)
        return {
            "backend": self._backend,
            "state": self._state.name.lower(),
            "state_value": int(self._state),
            "calls": calls,
            "failures": failures,
            "slow_calls": slow,
            "window_entries": len(self._window),  # calls (count window) or buckets (time window) held: bounded
            "failure_rate": failures / calls if calls else 0.0,
            "slow_rate": slow / calls if calls else 0.0,
            "opened_until_s": self._opened_until_s,
            "retry_after_s": (
                max(0.0, self._opened_until_s - now_s)
                if self._state is BreakerState.OPEN and self._opened_until_s is not None
                else 0.0
            ),
            "probes_admitted": self._probes_admitted,
            "probes_in_flight": self._probes_in_flight,
            "probes_ok": self._probes_ok,
            "probes_failed": self._probes_failed,
        }

    # ------------------------------------------------------------------ call side

    def allow(self) -> Permit | None:
        """A permit for one call, or None when the call must not go.

        None while OPEN, and while HALF_OPEN once all probes are handed out
        (made, in flight or reported). No await between the check and the
        increment below; see the concurrency note in the module docstring.
        """
        now_s = self._clock()
        self._refresh(now_s)
        if self._state is BreakerState.CLOSED:
            return Permit(self, self._epoch, False, now_s)
        if self._state is BreakerState.OPEN:
            return None
        if self._probes_admitted >= self._cfg.half_open_max_probes:
            return None
        self._probes_admitted += 1
        self._probes_in_flight += 1
        if self._first_probe_s is None:
            self._first_probe_s = now_s
        return Permit(self, self._epoch, True, now_s)

    def record(self, permit: Permit, success: bool, duration_s: float | None = None) -> None:
        """Report the outcome of a call made under ``permit``.

        ``duration_s`` defaults to the clock time since ``allow()``. Idempotent:
        a permit already recorded or released is ignored, and so is a permit
        issued before the breaker's last state change (a stale outcome).
        """
        self._check_owner(permit)
        if duration_s is not None and (not is_number(duration_s) or not 0 <= duration_s < math.inf):
            raise ValueError(f"duration_s: must be a finite number >= 0 or None, got {duration_s!r}")
        if permit._done:
            return
        permit._done = True
        now_s = self._clock()
        self._refresh(now_s)
        if permit._epoch != self._epoch:
            return
        if duration_s is None:
            duration_s = max(0.0, now_s - permit.started_s)
        failed = not success
        # Slow whatever the outcome (module docstring).
        slow = duration_s > self._cfg.slow_call_duration_s
        if permit.is_probe:
            # Same epoch as a probe permit means we are still in that HALF_OPEN period.
            self._probes_in_flight -= 1
            if failed:
                self._probes_failed += 1
            else:
                self._probes_ok += 1
            self._probes_slow += slow
            self._judge_half_open(now_s)
        else:
            self._window.add((1, int(failed), int(slow)), now_s)
            self._judge_closed(now_s)

    def release(self, permit: Permit) -> None:
        """The call was never made: free a half-open probe slot, count nothing.

        Idempotent like ``record()``; a stale permit frees nothing (its slot
        belonged to a period that is over).
        """
        self._check_owner(permit)
        if permit._done:
            return
        permit._done = True
        if permit._epoch != self._epoch or not permit.is_probe:
            return
        self._probes_admitted -= 1
        self._probes_in_flight -= 1
        if self._probes_admitted == 0:
            # Nothing handed out is outstanding or reported: the period starts over.
            self._first_probe_s = None

    # ------------------------------------------------------------------ transitions

    def _check_owner(self, permit: Permit) -> None:
        if not isinstance(permit, Permit) or permit._owner is not self:
            raise ValueError(f"permit: not issued by the breaker for {self._backend!r}, got {permit!r}")

    def _refresh(self, now_s: float) -> None:
        """The lazy OPEN → HALF_OPEN transition once the open period is over, and
        HALF_OPEN → OPEN once a half-open period has waited too long for its probes."""
        if (
            self._state is BreakerState.HALF_OPEN
            and self._first_probe_s is not None
            and now_s >= self._first_probe_s + self._cfg.half_open_max_wait_s
        ):
            self._open(
                now_s,
                f"half-open undecided {now_s - self._first_probe_s:.1f}s after the first probe"
                f" (>= half_open_max_wait_s {self._cfg.half_open_max_wait_s:g}), "
                f"{self._probes_in_flight} probe(s) never reported",
            )
            return
        if self._state is BreakerState.OPEN and self._opened_until_s is not None and now_s >= self._opened_until_s:
            self._opened_until_s = None
            self._reset_probes()
            self._transition(BreakerState.HALF_OPEN, now_s, f"open period over ({self._open_period_s:.1f}s)")

    def _judge_closed(self, now_s: float) -> None:
        calls, failures, slow = self._window.totals(now_s)
        if calls < self._cfg.min_calls:
            return
        # Failure rate first: it is the more direct signal and names the reason
        # when both thresholds are reached.
        if _reaches(failures, calls, self._cfg.failure_rate_threshold):
            self._open(
                now_s,
                f"failure_rate={failures / calls:.2f}>={self._cfg.failure_rate_threshold:.2f} over {calls} calls",
            )
        elif _reaches(slow, calls, self._cfg.slow_call_rate_threshold):
            self._open(
                now_s,
                f"slow_call_rate={slow / calls:.2f}>={self._cfg.slow_call_rate_threshold:.2f} over {calls} calls",
            )

    def _judge_half_open(self, now_s: float) -> None:
        n = self._cfg.half_open_max_probes
        required_ok = self._cfg.half_open_required_ok
        if self._probes_failed > n - required_ok:
            # The threshold is out of reach whatever the remaining probes do.
            self._open(now_s, f"probe failed: {self._probes_failed}/{n} failed, need {required_ok}/{n} ok")
            return
        if self._probes_ok + self._probes_failed < n:
            return  # wait for the remaining probes
        if _reaches(self._probes_slow, n, self._cfg.slow_call_rate_threshold):
            self._open(
                now_s,
                f"half-open probes slow: slow_call_rate={self._probes_slow / n:.2f}"
                f">={self._cfg.slow_call_rate_threshold:.2f}",
            )
            return
        self._window.clear()  # closing starts from an empty window
        self._transition(BreakerState.CLOSED, now_s, f"half-open probes {self._probes_ok}/{n} ok")

    def _open(self, now_s: float, reason: str) -> None:
        cfg = self._cfg
        u = self._rng.random()  # exactly one draw per opening
        self._open_period_s = cfg.open_duration_s * (1.0 + cfg.open_jitter_ratio * (2.0 * u - 1.0))
        self._opened_until_s = now_s + self._open_period_s
        self._window.clear()
        self._reset_probes()
        self._transition(BreakerState.OPEN, now_s, reason)

    def _reset_probes(self) -> None:
        self._probes_admitted = self._probes_in_flight = 0
        self._probes_ok = self._probes_failed = self._probes_slow = 0
        self._first_probe_s = None

    def _transition(self, to_state: BreakerState, now_s: float, reason: str) -> None:
        from_state = self._state
        self._state = to_state
        self._epoch += 1
        # Last: the hook sees a consistent breaker.
        self._on_event(BreakerEvent(self._backend, from_state, to_state, now_s, reason))
