"""The class a request claims: the header or the body's field, else the default."""

from __future__ import annotations

import pytest

from ballast.policies.criticality import ClaimError, Criticality, claimed, lower_criticality


@pytest.mark.parametrize(
    "header, body, expected",
    [
        (None, None, Criticality.CRITICAL),
        (None, Criticality.SHEDDABLE, Criticality.SHEDDABLE),
        (" critical_plus ", None, Criticality.CRITICAL_PLUS),
        ("sheddable", Criticality.SHEDDABLE, Criticality.SHEDDABLE),
    ],
)
def test_a_claim_is_the_header_or_the_body_else_the_default(header, body, expected) -> None:
    assert claimed(header, body) is expected


@pytest.mark.parametrize(
    "header, body, field",
    [("urgent", None, "X-Ballast-Criticality"), ("critical", Criticality.SHEDDABLE, "criticality")],
)
def test_a_claim_that_cannot_stand_names_its_field(header, body, field) -> None:
    with pytest.raises(ClaimError) as info:
        claimed(header, body)
    assert info.value.field == field and field in str(info.value)


def test_a_claim_above_the_tenants_cap_is_lowered_to_it():
    assert lower_criticality(Criticality.CRITICAL_PLUS, Criticality.CRITICAL) == (Criticality.CRITICAL, True)
    assert lower_criticality(Criticality.CRITICAL, Criticality.SHEDDABLE) == (Criticality.SHEDDABLE, True)


def test_a_claim_at_or_below_the_cap_stands():
    assert lower_criticality(Criticality.CRITICAL, Criticality.CRITICAL) == (Criticality.CRITICAL, False)
    assert lower_criticality(Criticality.SHEDDABLE, Criticality.CRITICAL_PLUS) == (Criticality.SHEDDABLE, False)
