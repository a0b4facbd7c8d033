"""ballast.policies.outcome: why an answer is less than asked, and which outcomes count as the
model's errors for the level."""

import pytest

from ballast.policies.outcome import counts_as_error, degraded_reasons


def reasons(**kw):
    base = dict(
        requested_max_tokens=64,
        level_max_tokens=256,
        model_max_tokens=255,
        lowered=False,
        stream_requested=False,
        streaming_allowed=True,
    )
    return degraded_reasons(**{**base, **kw})


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
    assert counts_as_error(code, status) is expected
