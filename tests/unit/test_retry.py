"""Retry policy: backoff bounds, budget math and accounting, which failures retry."""

from __future__ import annotations

import math
import random

import pytest

from ballast.policies.retry import (
    FAILURE_KINDS,
    NO_SLOT,
    NON_RETRYABLE_KINDS,
    RETRYABLE_KINDS,
    RetryBudget,
    RetryConfig,
    backoff_cap_s,
    backoff_s,
    retry_allowed,
    retry_limit,
    should_retry,
)

CFG = RetryConfig()  # 3 attempts, 0.05 s base, 1.0 s cap, 20 % budget, min 3
ALMOST_ONE = 1.0 - 1e-12


# ----------------------------------------------------------------- config


def test_defaults() -> None:
    assert (CFG.max_attempts, CFG.base_backoff_s, CFG.max_backoff_s) == (3, 0.05, 1.0)
    assert (CFG.budget_ratio, CFG.budget_min_concurrent) == (0.2, 3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_attempts", 0),
        ("max_attempts", 2.0),
        ("max_attempts", True),
        ("base_backoff_s", -0.1),
        ("base_backoff_s", float("nan")),
        ("max_backoff_s", float("inf")),
        ("max_backoff_s", 0.01),  # below base_backoff_s
        ("budget_ratio", -0.1),
        ("budget_ratio", 1.5),
        ("budget_min_concurrent", -1),
    ],
)
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RetryConfig(**{field: value})


# ----------------------------------------------------------------- backoff


@pytest.mark.parametrize(
    ("attempt", "cap_s"),
    [(1, 0.05), (2, 0.1), (3, 0.2), (4, 0.4), (5, 0.8), (6, 1.0), (7, 1.0), (100, 1.0), (10_000, 1.0)],
)
def test_backoff_bounds_per_attempt(attempt: int, cap_s: float) -> None:
    assert backoff_cap_s(attempt, CFG) == pytest.approx(cap_s)
    assert backoff_s(attempt, CFG, lambda: 0.0) == 0.0  # full jitter reaches zero
    assert backoff_s(attempt, CFG, lambda: ALMOST_ONE) == pytest.approx(cap_s)
    assert backoff_s(attempt, CFG, lambda: ALMOST_ONE) <= cap_s
    assert backoff_s(attempt, CFG, lambda: 0.5) == pytest.approx(cap_s / 2)


def test_backoff_with_a_seeded_rng_stays_within_the_cap() -> None:
    rng = random.Random(7)
    expected_rng = random.Random(7)
    for attempt in range(1, 9):
        value = backoff_s(attempt, CFG, rng.random)
        assert value == pytest.approx(expected_rng.random() * min(1.0, 0.05 * 2 ** (attempt - 1)))
        assert 0 <= value <= 1.0


def test_backoff_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="attempt"):
        backoff_s(0, CFG, lambda: 0.5)
    with pytest.raises(ValueError, match="rand"):
        backoff_s(1, CFG, lambda: 1.5)
    with pytest.raises(ValueError, match="rand"):
        backoff_s(1, CFG, lambda: -0.1)


# ----------------------------------------------------------------- budget math


@pytest.mark.parametrize(
    ("active", "limit"),
    [(0, 3), (5, 3), (10, 3), (15, 3), (20, 4), (100, 20)],
)
def test_retry_limit_table(active: int, limit: int) -> None:
    assert retry_limit(active, CFG) == limit
    assert retry_allowed(active, limit - 1, CFG) is True
    assert retry_allowed(active, limit, CFG) is False
    assert retry_allowed(active, limit + 5, CFG) is False


def test_retry_limit_floor_is_not_lost_to_float_rounding() -> None:
    # 0.29 × 100 = 28.999999999999996 in floats; the limit is 29.
    assert retry_limit(100, RetryConfig(budget_ratio=0.29, budget_min_concurrent=0)) == 29


def test_zero_budget_allows_no_retries() -> None:
    cfg = RetryConfig(budget_ratio=0.0, budget_min_concurrent=0)
    assert retry_allowed(1000, 0, cfg) is False


def test_budget_math_rejects_negative_counts() -> None:
    with pytest.raises(ValueError, match="active"):
        retry_allowed(-1, 0, CFG)
    with pytest.raises(ValueError, match="retries_in_flight"):
        retry_allowed(0, -1, CFG)


# ----------------------------------------------------------------- budget accounting


def test_budget_acquire_release_and_counters() -> None:
    budget = RetryBudget(CFG)
    for _ in range(20):
        budget.on_request_start()
    assert budget.limit() == 4
    assert [budget.try_acquire_retry() for _ in range(6)] == [True, True, True, True, False, False]
    assert (budget.retries_in_flight, budget.retries_granted, budget.retries_denied) == (4, 4, 2)
    budget.release_retry()
    assert budget.retries_in_flight == 3
    assert budget.try_acquire_retry() is True
    assert (budget.retries_granted, budget.retries_denied) == (5, 2)
    # Fewer active requests shrink the limit to the floor of 3: four in flight → denied.
    for _ in range(10):
        budget.on_request_end()
    assert budget.active == 10 and budget.limit() == 3
    assert budget.try_acquire_retry() is False
    assert budget.retries_denied == 3
    for _ in range(4):
        budget.release_retry()
    assert budget.retries_in_flight == 0
    assert budget.try_acquire_retry() is True
    assert budget.snapshot() == {
        "active": 10,
        "retries_in_flight": 1,
        "retry_limit": 3,
        "retries_granted": 6,
        "retries_denied": 3,
    }


def test_budget_counts_never_go_negative() -> None:
    budget = RetryBudget(RetryConfig(budget_min_concurrent=1, budget_ratio=0.0))
    budget.on_request_end()
    budget.release_retry()
    assert (budget.active, budget.retries_in_flight) == (0, 0)
    # A negative in-flight count would have let two retries through.
    assert budget.try_acquire_retry() is True
    assert budget.try_acquire_retry() is False


def test_budget_rejects_a_bad_config() -> None:
    with pytest.raises(ValueError, match="cfg"):
        RetryBudget({"max_attempts": 3})  # type: ignore[arg-type]


# ----------------------------------------------------------------- should_retry


def test_kind_sets_are_the_documented_ones() -> None:
    assert RETRYABLE_KINDS == {"replica_died", "backpressure", "attempt_timeout"}
    assert set(NON_RETRYABLE_KINDS) == {"deadline_exceeded", "client_error", "model_error", "breaker_open", "cancelled"}
    assert FAILURE_KINDS == RETRYABLE_KINDS | set(NON_RETRYABLE_KINDS)


@pytest.mark.parametrize("kind", sorted(RETRYABLE_KINDS))
def test_retryable_kinds_retry_with_room(kind: str) -> None:
    ok, reason = should_retry(kind, 1, deadline_left_s=5.0, next_backoff_s=0.05, min_attempt_s=0.5, cfg=CFG)
    assert ok is True
    assert reason == f"{kind}: retry 2/3 after 0.050s"


@pytest.mark.parametrize("kind", sorted(NON_RETRYABLE_KINDS))
def test_non_retryable_kinds_never_retry(kind: str) -> None:
    ok, reason = should_retry(kind, 1, deadline_left_s=100.0, next_backoff_s=0.0, min_attempt_s=0.0, cfg=CFG)
    assert ok is False
    assert reason.startswith(f"{kind}: not retryable")


def test_attempt_limit() -> None:
    decisions = [should_retry("replica_died", attempt, 100.0, 0.1, 0.1, CFG)[0] for attempt in (1, 2, 3, 4)]
    assert decisions == [True, True, False, False]
    assert should_retry("replica_died", 3, 100.0, 0.1, 0.1, CFG)[1] == "replica_died: attempts exhausted (3/3)"
    assert should_retry("backpressure", 1, 100.0, 0.1, 0.1, RetryConfig(max_attempts=1))[0] is False


def test_deadline_room_is_strict() -> None:
    # Needs deadline_left_s > backoff + min attempt: 0.5 + 1.5 = 2.0.
    assert should_retry("attempt_timeout", 1, 2.5, 0.5, 1.5, CFG)[0] is True
    ok, reason = should_retry("attempt_timeout", 1, 2.0, 0.5, 1.5, CFG)
    assert ok is False
    assert reason == (
        "attempt_timeout: no room before the deadline (2.000s left <= backoff 0.500s + min attempt 1.500s)"
    )
    assert should_retry("attempt_timeout", 1, -1.0, 0.0, 0.0, CFG)[0] is False  # already past the deadline
    assert should_retry("attempt_timeout", 1, math.inf, 0.5, 1.5, CFG)[0] is True  # no deadline


def test_should_retry_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="kind"):
        should_retry("timeout", 1, 1.0, 0.0, 0.0, CFG)
    with pytest.raises(ValueError, match="attempt"):
        should_retry("replica_died", 0, 1.0, 0.0, 0.0, CFG)
    with pytest.raises(ValueError, match="next_backoff_s"):
        should_retry("replica_died", 1, 1.0, -0.1, 0.0, CFG)
    with pytest.raises(ValueError, match="min_attempt_s"):
        should_retry("replica_died", 1, 1.0, 0.0, -1.0, CFG)
    with pytest.raises(ValueError, match="deadline_left_s"):
        should_retry("replica_died", 1, float("nan"), 0.0, 0.0, CFG)


def test_a_retry_loop_walked_attempt_by_attempt() -> None:
    """The router's sequence: decide, take budget, back off, attempt, release."""
    budget = RetryBudget(CFG)
    budget.on_request_start()
    rng = random.Random(3)
    deadline_left_s = 1.0
    attempts, kind = 1, "replica_died"
    log = []
    while True:
        wait_s = backoff_s(attempts, CFG, rng.random)
        ok, reason = should_retry(kind, attempts, deadline_left_s, wait_s, 0.1, CFG)
        log.append(ok)
        if not ok:
            break
        assert budget.try_acquire_retry()
        deadline_left_s -= wait_s + 0.1
        attempts += 1
        budget.release_retry()
    budget.on_request_end()
    assert log == [True, True, False]
    assert reason == "replica_died: attempts exhausted (3/3)"
    assert (budget.active, budget.retries_in_flight, budget.retries_granted) == (0, 0, 2)


def test_a_retry_slot_releases_itself_once() -> None:
    budget = RetryBudget(RetryConfig(budget_ratio=0.1, budget_min_concurrent=1))
    budget.on_request_start()
    slot = budget.retry_slot()
    assert slot is not None and slot.held and budget.retries_in_flight == 1
    assert budget.retry_slot() is None  # the budget allows one: a second is refused, nothing held
    slot.release()
    assert not slot.held and budget.retries_in_flight == 0
    slot.release()  # a second release gives back nothing more (no phantom slot)
    other = budget.retry_slot()
    assert other is not None and budget.retries_in_flight == 1
    slot.release()
    assert budget.retries_in_flight == 1  # the spent slot cannot release the other's
    NO_SLOT.release()
    assert budget.retries_in_flight == 1 and not NO_SLOT.held
