"""ballast/policies/deadline.py: one deadline, the offsets each layer takes from it."""

import pytest

from ballast.policies.deadline import (
    ATTEMPT_MARGIN_S,
    MIN_ATTEMPT_S,
    REPLICA_LEAD_S,
    Deadline,
    attempt_timeout_s,
    replica_deadline_s,
)


def test_the_layers_answer_in_order_before_the_deadline() -> None:
    d = Deadline.starting(100.0, 1.5)
    assert (d.started_s, d.at_s, d.budget_s) == (100.0, 101.5, 1.5)
    assert d.left_s(101.0) == pytest.approx(0.5)
    # The replica's deadline (the gate's horizon) comes first, then the attempt's timeout.
    assert d.gate_until_s == pytest.approx(101.5 - REPLICA_LEAD_S)
    assert d.gate_budget_s == pytest.approx(1.5 - REPLICA_LEAD_S)
    left = d.left_s(100.0)
    attempt_ends = 100.0 + attempt_timeout_s(left, cap_s=10.0)
    replica_ends = replica_deadline_s(100.0, left)
    assert replica_ends < attempt_ends < d.at_s
    assert attempt_ends == pytest.approx(d.at_s - ATTEMPT_MARGIN_S)
    assert MIN_ATTEMPT_S < REPLICA_LEAD_S


def test_an_attempt_is_capped_and_never_zero() -> None:
    assert attempt_timeout_s(30.0, cap_s=4.0) == 4.0
    assert attempt_timeout_s(0.01, cap_s=4.0) == 0.001
    assert replica_deadline_s(5.0, 0.05) == 5.0  # less than the lead: due at once


def test_bad_deadlines_are_refused() -> None:
    with pytest.raises(ValueError, match="budget_s"):
        Deadline.starting(0.0, 0.0)
    with pytest.raises(ValueError, match="at_s"):
        Deadline(10.0, 9.0)
    with pytest.raises(ValueError, match="started_s"):
        Deadline(float("nan"), 1.0)
