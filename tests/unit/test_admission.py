"""Admission by level × criticality, Retry-After, and the max_tokens clamp."""

from __future__ import annotations

import pytest

from ballast.policies.admission import (
    OVERLOADED,
    RETRY_AFTER_CAP_S,
    AdmissionDecision,
    admit,
    clamp_max_tokens,
    retry_after_s,
)
from ballast.policies.criticality import Criticality
from ballast.policies.degradation import DEFAULT_CONSTRAINTS, LevelConstraints

CP, C, SP, S = (
    Criticality.CRITICAL_PLUS,
    Criticality.CRITICAL,
    Criticality.SHEDDABLE_PLUS,
    Criticality.SHEDDABLE,
)

# (level, criticality, admitted?) for every cell of the default table.
TABLE = [
    (0, CP, True), (0, C, True), (0, SP, True), (0, S, True),
    (1, CP, True), (1, C, True), (1, SP, True), (1, S, False),
    (2, CP, True), (2, C, True), (2, SP, False), (2, S, False),
    (3, CP, True), (3, C, False), (3, SP, False), (3, S, False),
    (4, CP, False), (4, C, False), (4, SP, False), (4, S, False),
]  # fmt: skip


@pytest.mark.parametrize(("level", "crit", "admitted"), TABLE)
def test_admission_table(level: int, crit: Criticality, admitted: bool) -> None:
    d = admit(crit, level, DEFAULT_CONSTRAINTS[level])
    assert d.admitted is admitted
    if admitted:
        assert d.code is None and d.retry_after_s is None
    else:
        assert d.code == OVERLOADED == "OVERLOADED"
        assert d.retry_after_s is not None and d.retry_after_s > 0
        assert f"level {level}" in d.reason


def test_refusal_reasons_name_what_is_admitted() -> None:
    assert admit(S, 2, DEFAULT_CONSTRAINTS[2]).reason == "level 2 admits only critical_plus,critical; sheddable shed"
    assert admit(CP, 4, DEFAULT_CONSTRAINTS[4]).reason == "level 4 admits no new requests"


def test_string_criticality_is_parsed() -> None:
    assert admit("critical", 2, DEFAULT_CONSTRAINTS[2]).admitted  # type: ignore[arg-type]
    assert not admit("sheddable", 1, DEFAULT_CONSTRAINTS[1]).admitted  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="criticality"):
        admit("urgent", 0, DEFAULT_CONSTRAINTS[0])  # type: ignore[arg-type]


def test_retry_after_grows_with_level_and_is_capped() -> None:
    refused = [admit(S, level, DEFAULT_CONSTRAINTS[level]).retry_after_s for level in (1, 2, 3, 4)]
    assert refused == [1.0, 2.0, 4.0, 8.0]
    assert [retry_after_s(level, base_s=5.0) for level in (0, 1, 2, 3, 4)] == [5.0, 5.0, 10.0, 20.0, 30.0]
    assert admit(CP, 4, DEFAULT_CONSTRAINTS[4], retry_after_base_s=10.0).retry_after_s == RETRY_AFTER_CAP_S == 30.0
    assert admit(CP, 4, DEFAULT_CONSTRAINTS[4], retry_after_base_s=1.0, retry_after_cap_s=3.0).retry_after_s == 3.0


def test_retry_after_validation() -> None:
    with pytest.raises(ValueError, match="level"):
        retry_after_s(5)
    with pytest.raises(ValueError, match="retry_after_base_s"):
        retry_after_s(1, base_s=0.0)
    with pytest.raises(ValueError, match="retry_after_cap_s"):
        retry_after_s(1, base_s=2.0, cap_s=1.0)


def test_custom_level_zero_refusal_uses_the_base() -> None:
    strict = LevelConstraints(max_tokens=10, max_batch_size=1, streaming=False, admitted={CP})
    d = admit(C, 0, strict, retry_after_base_s=2.0)
    assert (d.admitted, d.retry_after_s) == (False, 2.0)


@pytest.mark.parametrize(
    ("requested", "level", "model_max", "expected"),
    [
        (100, 0, 4096, (100, False)),  # well under every limit
        (8192, 0, 10_000, (8192, False)),  # exactly at the level limit is not clamped
        (9000, 0, 10_000, (8192, True)),  # level limit
        (3000, 2, 10_000, (2048, True)),
        (3000, 0, 1000, (1000, True)),  # model limit below level limit
        (600, 4, 1000, (512, True)),
        (512, 4, 512, (512, False)),
        (0, 4, 512, (0, False)),  # no token asked (echo alone): none granted, nothing clamped
    ],
)
def test_clamp_max_tokens(requested: int, level: int, model_max: int, expected: tuple[int, bool]) -> None:
    assert clamp_max_tokens(requested, DEFAULT_CONSTRAINTS[level], model_max) == expected


def test_clamp_validation() -> None:
    with pytest.raises(ValueError, match="requested"):
        clamp_max_tokens(-1, DEFAULT_CONSTRAINTS[0], 100)
    with pytest.raises(ValueError, match="model_max_tokens"):
        clamp_max_tokens(10, DEFAULT_CONSTRAINTS[0], 0)


def test_decision_invariants() -> None:
    with pytest.raises(ValueError, match="code"):
        AdmissionDecision(admitted=False, code=None, retry_after_s=1.0, reason="x")
    with pytest.raises(ValueError, match="code"):
        AdmissionDecision(admitted=True, code=OVERLOADED, retry_after_s=None, reason="x")
