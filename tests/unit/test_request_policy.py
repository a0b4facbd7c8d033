"""ballast/policies/request.py: the router's per-request decisions."""

import pytest

from ballast.policies import request as rp
from ballast.policies.criticality import Criticality


def test_a_claim_above_the_tenants_cap_is_lowered_to_it():
    assert rp.lower_criticality(Criticality.CRITICAL_PLUS, Criticality.CRITICAL) == (Criticality.CRITICAL, True)
    assert rp.lower_criticality(Criticality.CRITICAL, Criticality.SHEDDABLE) == (Criticality.SHEDDABLE, True)


def test_a_claim_at_or_below_the_cap_stands():
    assert rp.lower_criticality(Criticality.CRITICAL, Criticality.CRITICAL) == (Criticality.CRITICAL, False)
    assert rp.lower_criticality(Criticality.SHEDDABLE, Criticality.CRITICAL_PLUS) == (Criticality.SHEDDABLE, False)


def test_the_token_cost_is_prompt_bytes_capped_by_the_context_plus_max_tokens():
    assert rp.prompt_tokens("hello", 100) == 5
    assert rp.prompt_tokens("é", 100) == 2  # UTF-8 bytes, not characters
    assert rp.prompt_tokens("x" * 500, 100) == 100
    assert rp.token_cost(rp.prompt_tokens("hello", 100), 64) == 69


def reasons(**kw):
    base = dict(
        requested_max_tokens=64,
        level_max_tokens=256,
        model_max_tokens=255,
        lowered=False,
        stream_requested=False,
        streaming_allowed=True,
    )
    return rp.degraded_reasons(**{**base, **kw})


def test_degraded_reasons():
    assert reasons() == []
    assert reasons(level_max_tokens=32) == ["max_tokens_clamped"]
    # Clamped by the model's context only: not degradation.
    assert reasons(requested_max_tokens=1000, level_max_tokens=1000, model_max_tokens=255) == []
    assert reasons(requested_max_tokens=1000, level_max_tokens=100, model_max_tokens=255) == ["max_tokens_clamped"]
    assert reasons(lowered=True) == ["criticality_lowered"]
    assert reasons(stream_requested=True, streaming_allowed=False) == ["streaming_disabled"]
    assert reasons(stream_requested=False, streaming_allowed=False) == []
    assert reasons(level_max_tokens=8, lowered=True, stream_requested=True, streaming_allowed=False) == [
        "max_tokens_clamped",
        "criticality_lowered",
        "streaming_disabled",
    ]


def test_the_quota_retry_after_is_floored_and_capped():
    assert rp.quota_retry_after_s(0.0) == rp.QUOTA_RETRY_AFTER_FLOOR_S == 0.01
    assert rp.quota_retry_after_s(-5.0) == 0.01
    assert rp.quota_retry_after_s(2.5) == 2.5
    assert rp.quota_retry_after_s(1e9) == rp.QUOTA_RETRY_AFTER_CAP_S == 3600.0


@pytest.mark.parametrize(
    "code,status,expected",
    [
        ("MODEL_UNAVAILABLE", 503, True),
        ("INTERNAL", 500, True),
        ("DEADLINE_EXCEEDED", 504, False),
        ("KILL_SWITCH", 503, False),
        ("OVERLOADED", 503, True),
        ("QUOTA_EXCEEDED", 429, False),
        ("INVALID_REQUEST", 422, False),
    ],
)
def test_which_outcomes_count_as_errors_for_the_level(code, status, expected):
    assert rp.counts_as_error(code, status) is expected
