"""Retries only where they help: which failures, how long to wait, how many at once.

Three separate pieces, so the router's retry loop stays a thin adapter:

* ``should_retry`` — is this failure worth another attempt at all? Only failures
  that a *different* attempt can plausibly fix are retried: a replica that died,
  backpressure from a full replica queue, one attempt that timed out. A client
  error, a model error, an open breaker, a cancelled request or a spent deadline
  would fail the same way again and only add load. A retry also needs room:
  the deadline left must cover the backoff plus a minimum useful attempt, or
  the retry would be cut off by the deadline and be pure waste.
* ``backoff_s`` — exponential backoff with *full* jitter (uniform between 0 and
  the exponential cap): callers that failed together spread out instead of
  returning together (thundering herd).
* ``RetryBudget`` — retries in flight are capped to a fraction of the active
  requests (with a small floor so a quiet service can still retry). Without it
  a sick backend sees its traffic multiplied by ``max_attempts`` exactly when it
  can least take it; with nested layers that compounds (3 × 3 × 3 = 27).
  The limit math is the pure ``retry_allowed``; ``RetryBudget`` only counts
  (STYLE 4).

The router's order per failed attempt: ``should_retry`` (pure, cheap) →
``budget.try_acquire_retry()`` (so ``retries_denied`` counts only retries that
were wanted) → sleep ``backoff_s`` → attempt → ``budget.release_retry()``.

Written by hand rather than with tenacity: tenacity drives a retry loop, but its
jittered waits use the global ``random`` module (no injected rng, so not
reproducible per router or in tests), it has no retry budget shared across
requests and no deadline-room check. The router may still run its loop with
tenacity and call these functions from its ``retry``/``wait``/``stop`` hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ballast.policies.validation import check_fields, check_fraction, check_int, check_non_negative, is_number

# floor(ratio × active) where the product lands a hair below an integer
# (0.29 × 100 = 28.999999999999996) would lose a whole retry slot.
_EPSILON = 1e-9
# 2 ** 63 × any sane base is already far past any max_backoff_s; bounding the
# exponent keeps huge attempt numbers from overflowing the float conversion.
_MAX_EXPONENT = 63

#: Failures another attempt can plausibly fix.
RETRYABLE_KINDS = frozenset({"replica_died", "backpressure", "attempt_timeout"})

#: Failures that would fail the same way again, and why we do not retry them.
NON_RETRYABLE_KINDS: dict[str, str] = {
    "deadline_exceeded": "no time left for another attempt",
    "client_error": "the same request fails the same way",
    "model_error": "the model rejects this request deterministically",
    "breaker_open": "the breaker decides when the backend is tried again",
    "cancelled": "the client is gone",
}

FAILURE_KINDS = RETRYABLE_KINDS | frozenset(NON_RETRYABLE_KINDS)


@dataclass(frozen=True)
class RetryConfig:
    #: Total attempts per request, the first included (3 = at most 2 retries).
    max_attempts: int = 3
    #: Backoff cap before the first retry; doubles per retry.
    base_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    #: Retries in flight at most this fraction of active requests …
    budget_ratio: float = 0.2
    #: … but this many concurrent retries are always allowed.
    budget_min_concurrent: int = 3

    def __post_init__(self) -> None:
        check_fields(self, check_int, "max_attempts", minimum=1)
        check_fields(self, check_non_negative, "base_backoff_s", "max_backoff_s")
        if self.max_backoff_s < self.base_backoff_s:
            raise ValueError(
                f"max_backoff_s: must be >= base_backoff_s ({self.base_backoff_s}), got {self.max_backoff_s!r}"
            )
        check_fields(self, check_fraction, "budget_ratio")
        check_fields(self, check_int, "budget_min_concurrent", minimum=0)


# --------------------------------------------------------------------------- backoff


def backoff_cap_s(attempt: int, cfg: RetryConfig) -> float:
    """The upper bound of the wait before retry number ``attempt`` (1 = first retry)."""
    check_int("attempt", attempt, minimum=1)
    return min(cfg.max_backoff_s, cfg.base_backoff_s * 2.0 ** min(attempt - 1, _MAX_EXPONENT))


def backoff_s(attempt: int, cfg: RetryConfig, rand: Callable[[], float]) -> float:
    """Full-jitter backoff: uniform(0, min(max_backoff_s, base_backoff_s × 2**(attempt−1))).

    ``attempt`` is 1 for the first retry. ``rand`` returns u in [0, 1) — pass
    ``rng.random`` of an injected ``random.Random``; 1.0 is tolerated (some
    uniform generators can return it) and gives exactly the cap.
    """
    cap_s = backoff_cap_s(attempt, cfg)
    u = rand()
    if not is_number(u) or not 0 <= u <= 1:
        raise ValueError(f"rand: must return a number in [0, 1), got {u!r}")
    return u * cap_s


# --------------------------------------------------------------------------- budget


def retry_limit(active: int, cfg: RetryConfig) -> int:
    """Concurrent retries allowed with ``active`` requests in flight."""
    check_int("active", active, minimum=0)
    return max(cfg.budget_min_concurrent, math.floor(cfg.budget_ratio * active + _EPSILON))


def retry_allowed(active: int, retries_in_flight: int, cfg: RetryConfig) -> bool:
    """The budget math: one more retry fits while in-flight retries are below the limit.

    ``active`` counts client requests in flight (a request being retried is
    still one active request); ``retries_in_flight`` counts retry attempts
    currently running or waiting out their backoff.
    """
    check_int("retries_in_flight", retries_in_flight, minimum=0)
    return retries_in_flight < retry_limit(active, cfg)


class RetryBudget:
    """Counts active requests and retries in flight around ``retry_allowed``.

    One per router replica, used from its single event-loop thread; no method
    awaits, so check-and-increment in ``try_acquire_retry`` cannot interleave.
    Counters never go below zero: an end/release without its start/acquire is a
    caller bug, and clamping keeps one such bug from handing every later request
    a phantom slot (a negative count would loosen the limit for good).
    """

    def __init__(self, cfg: RetryConfig) -> None:
        if not isinstance(cfg, RetryConfig):
            raise ValueError(f"cfg: must be a RetryConfig, got {cfg!r}")
        self._cfg = cfg
        self.active = 0
        self.retries_in_flight = 0
        #: Monotonic counters for metrics (export as deltas or counters).
        self.retries_granted = 0
        self.retries_denied = 0

    @property
    def config(self) -> RetryConfig:
        return self._cfg

    def on_request_start(self) -> None:
        self.active += 1

    def on_request_end(self) -> None:
        self.active = max(0, self.active - 1)

    def try_acquire_retry(self) -> bool:
        """Take a retry slot if the budget allows; pair a True with ``release_retry()``."""
        if retry_allowed(self.active, self.retries_in_flight, self._cfg):
            self.retries_in_flight += 1
            self.retries_granted += 1
            return True
        self.retries_denied += 1
        return False

    def release_retry(self) -> None:
        self.retries_in_flight = max(0, self.retries_in_flight - 1)

    def retry_slot(self) -> RetrySlot | None:
        """A retry slot that releases itself once (``RetrySlot.release``), or None when the
        budget says no."""
        return RetrySlot(self) if self.try_acquire_retry() else None

    def limit(self) -> int:
        """Concurrent retries allowed right now."""
        return retry_limit(self.active, self._cfg)

    def snapshot(self) -> dict[str, int]:
        return {
            "active": self.active,
            "retries_in_flight": self.retries_in_flight,
            "retry_limit": self.limit(),
            "retries_granted": self.retries_granted,
            "retries_denied": self.retries_denied,
        }


# --------------------------------------------------------------------------- decision


def should_retry(
    kind: str,
    attempt: int,
    deadline_left_s: float,
    next_backoff_s: float,
    min_attempt_s: float,
    cfg: RetryConfig,
) -> tuple[bool, str]:
    """Whether to retry after attempt number ``attempt`` failed with ``kind``.

    ``attempt`` counts attempts made so far (1 after the first failure) — the
    same number to pass to ``backoff_s`` for the wait before the next one.
    Retry only if the kind is retryable, ``attempt < max_attempts`` and
    ``deadline_left_s > next_backoff_s + min_attempt_s`` (room for the wait and
    one real attempt; an infinite ``deadline_left_s`` means no deadline).
    Returns ``(decision, reason)``; an unknown kind raises ValueError (a caller
    bug, not a failure to guess about).
    """
    if kind not in FAILURE_KINDS:
        raise ValueError(f"kind: must be one of {sorted(FAILURE_KINDS)}, got {kind!r}")
    check_int("attempt", attempt, minimum=1)
    check_non_negative("next_backoff_s", next_backoff_s)
    check_non_negative("min_attempt_s", min_attempt_s)
    if not is_number(deadline_left_s) or math.isnan(deadline_left_s):
        raise ValueError(f"deadline_left_s: must be a number, got {deadline_left_s!r}")

    if kind in NON_RETRYABLE_KINDS:
        return False, f"{kind}: not retryable ({NON_RETRYABLE_KINDS[kind]})"
    if attempt >= cfg.max_attempts:
        return False, f"{kind}: attempts exhausted ({attempt}/{cfg.max_attempts})"
    needed_s = next_backoff_s + min_attempt_s
    if not deadline_left_s > needed_s:
        return False, (
            f"{kind}: no room before the deadline ({deadline_left_s:.3f}s left <= "
            f"backoff {next_backoff_s:.3f}s + min attempt {min_attempt_s:.3f}s)"
        )
    return True, f"{kind}: retry {attempt + 1}/{cfg.max_attempts} after {next_backoff_s:.3f}s"


class RetrySlot:
    """One retry slot held from a ``RetryBudget`` (``NO_SLOT``: none held). ``release``
    gives it back the first time and does nothing after, so every way out of an attempt
    loop can call it."""

    def __init__(self, budget: RetryBudget | None) -> None:
        self._budget = budget

    @property
    def held(self) -> bool:
        return self._budget is not None

    def release(self) -> None:
        if self._budget is not None:
            self._budget.release_retry()
            self._budget = None


NO_SLOT = RetrySlot(None)
