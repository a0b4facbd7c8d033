"""Kill switch entries (ballast/policies/killswitch.py): validation, expiry and matching.

Wall times are integers here, so every boundary is exact: ``expired`` flips at
``expires_at_s`` itself, never a float's width before or after.
"""

from __future__ import annotations

from typing import Any

import pytest

from ballast.policies import killswitch
from ballast.policies.killswitch import (
    MAX_EXPIRES_IN_S,
    MAX_REASON_CHARS,
    SCOPES,
    KillSwitchEntry,
    active,
    blocking,
    model_blocked,
)

NOW_S = 1_700_000_000  # an integer wall time


def entry(
    scope: str = "global",
    value: str | None = None,
    *,
    id: str = "ks-1",
    reason: str = "incident 42",
    now_s: float = NOW_S,
    expires_in_s: float = 60,
) -> KillSwitchEntry:
    return KillSwitchEntry.create(id, scope, value, reason, "alice", now_s, expires_in_s)


def raw(**overrides: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": "ks-1",
        "scope": "tenant",
        "value": "acme",
        "reason": "abuse",
        "set_by": "alice",
        "created_at_s": NOW_S,
        "expires_at_s": NOW_S + 60,
    }
    d.update(overrides)
    return d


# -- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "scope,value", [("global", None), ("tenant", "acme"), ("model", "llama"), ("criticality", "sheddable")]
)
def test_each_scope_is_accepted_with_its_value(scope: str, value: str | None) -> None:
    e = entry(scope, value)
    assert (e.scope, e.value) == (scope, value)


def test_scopes_are_exactly_the_four_documented_ones() -> None:
    assert SCOPES == ("global", "tenant", "model", "criticality")


@pytest.mark.parametrize("scope", ["", "Global", "region", "tenants"])
def test_unknown_scope_is_rejected_naming_the_field(scope: str) -> None:
    with pytest.raises(ValueError, match=r"^scope: "):
        entry(scope, "x")


@pytest.mark.parametrize("value", ["acme", "", " "])
def test_global_scope_requires_a_null_value(value: str) -> None:
    with pytest.raises(ValueError, match=r"^value: must be null for the global scope"):
        entry("global", value)


@pytest.mark.parametrize("scope", ["tenant", "model", "criticality"])
@pytest.mark.parametrize("value", [None, "", "   ", "\t\n"])
def test_non_global_scope_requires_a_non_blank_value(scope: str, value: str | None) -> None:
    with pytest.raises(ValueError, match=rf"^value: the {scope} scope needs a value"):
        entry(scope, value)


@pytest.mark.parametrize("scope", ["tenant", "model", "criticality"])
def test_non_global_value_must_be_a_string(scope: str) -> None:
    with pytest.raises(ValueError, match=r"^value: "):
        KillSwitchEntry("ks-1", scope, 7, "r", "alice", NOW_S, NOW_S + 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("reason", ["", " ", "\n\t "])
def test_blank_reason_is_rejected_naming_the_field(reason: str) -> None:
    with pytest.raises(ValueError, match=r"^reason: required"):
        entry(reason=reason)


def test_reason_length_limit_is_inclusive() -> None:
    assert entry(reason="x" * MAX_REASON_CHARS).reason == "x" * MAX_REASON_CHARS
    with pytest.raises(ValueError, match=rf"^reason: required, at most {MAX_REASON_CHARS} characters"):
        entry(reason="x" * (MAX_REASON_CHARS + 1))


def test_expires_in_s_bounds_walked_at_the_edges() -> None:
    # (0, MAX]: 0 out, 1 in, MAX in, MAX + 1 out
    with pytest.raises(ValueError, match=r"^expires_in_s: must be in \(0, "):
        entry(expires_in_s=0)
    assert entry(expires_in_s=1).expires_at_s == NOW_S + 1
    assert entry(expires_in_s=MAX_EXPIRES_IN_S).expires_at_s == NOW_S + MAX_EXPIRES_IN_S
    with pytest.raises(ValueError, match=rf"^expires_in_s: must be in \(0, {MAX_EXPIRES_IN_S}\]"):
        entry(expires_in_s=MAX_EXPIRES_IN_S + 1)


@pytest.mark.parametrize("expires_in_s", [-1, -MAX_EXPIRES_IN_S, float("nan"), float("inf")])
def test_expires_in_s_rejects_negative_nan_and_infinite(expires_in_s: float) -> None:
    with pytest.raises(ValueError, match=r"^expires_in_s: "):
        entry(expires_in_s=expires_in_s)


def test_max_expires_is_a_week() -> None:
    assert MAX_EXPIRES_IN_S == 7 * 24 * 3600


def test_max_expiry_holds_at_a_fractional_wall_time() -> None:
    # The controller passes time.time() (fractional): the sum must not drift past MAX.
    e = entry(now_s=1_700_000_000.123, expires_in_s=MAX_EXPIRES_IN_S)
    assert e.expires_at_s - e.created_at_s == MAX_EXPIRES_IN_S


def test_validation_reports_scope_before_other_fields() -> None:
    # Several fields wrong at once: the first check (scope) names itself.
    with pytest.raises(ValueError, match=r"^scope: "):
        KillSwitchEntry("ks-1", "nope", None, "", "alice", NOW_S, NOW_S)


def test_non_string_reason_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^reason: "):
        KillSwitchEntry.from_dict(raw(reason=None))


# -- create / expired ----------------------------------------------------------------


def test_create_fills_in_times_and_fields() -> None:
    e = KillSwitchEntry.create("ks-9", "tenant", "acme", "abuse", "bob", NOW_S, 300)
    assert e == KillSwitchEntry("ks-9", "tenant", "acme", "abuse", "bob", NOW_S, NOW_S + 300)


def test_entries_are_frozen() -> None:
    e = entry()
    with pytest.raises(AttributeError):
        e.reason = "changed"  # type: ignore[misc]


def test_expired_walked_second_by_second_up_to_the_boundary() -> None:
    e = entry(expires_in_s=3)
    # created at NOW_S, expires at NOW_S + 3: live for 0, 1, 2; expired at 3 exactly
    assert [e.expired(NOW_S + t) for t in range(5)] == [False, False, False, True, True]


def test_expired_before_creation_is_false() -> None:
    assert entry(expires_in_s=3).expired(NOW_S - 10) is False


# -- matches -------------------------------------------------------------------------


def test_global_matches_everything() -> None:
    e = entry("global")
    assert e.matches("acme", "llama", "critical")
    assert e.matches("", "", "")


def test_tenant_scope_matches_only_its_tenant() -> None:
    e = entry("tenant", "acme")
    assert e.matches("acme", "llama", "critical")
    assert not e.matches("globex", "llama", "critical")
    # the value is compared to the tenant only, not to the other fields
    assert not e.matches("globex", "acme", "acme")


def test_model_scope_matches_only_its_model() -> None:
    e = entry("model", "llama")
    assert e.matches("acme", "llama", "critical")
    assert not e.matches("acme", "mistral", "critical")
    assert not e.matches("llama", "mistral", "llama")


def test_criticality_scope_matches_only_its_criticality() -> None:
    e = entry("criticality", "sheddable")
    assert e.matches("acme", "llama", "sheddable")
    assert not e.matches("acme", "llama", "critical")
    assert not e.matches("sheddable", "sheddable", "critical")


def test_matching_is_exact_not_case_folded() -> None:
    assert not entry("tenant", "acme").matches("ACME", "m", "c")


# -- to_dict / from_dict -------------------------------------------------------------


@pytest.mark.parametrize(
    "scope,value", [("global", None), ("tenant", "acme"), ("model", "llama"), ("criticality", "sheddable")]
)
def test_to_dict_from_dict_round_trip(scope: str, value: str | None) -> None:
    e = entry(scope, value, id=f"ks-{scope}")
    d = e.to_dict()
    assert d == {
        "id": f"ks-{scope}",
        "scope": scope,
        "value": value,
        "reason": "incident 42",
        "set_by": "alice",
        "created_at_s": NOW_S,
        "expires_at_s": NOW_S + 60,
    }
    assert KillSwitchEntry.from_dict(d) == e


def test_from_dict_validates() -> None:
    with pytest.raises(ValueError, match=r"^value: "):
        KillSwitchEntry.from_dict(raw(value=None))
    with pytest.raises(ValueError, match=r"^expires_in_s: "):
        KillSwitchEntry.from_dict(raw(expires_at_s=NOW_S))


def test_from_dict_rejects_unknown_and_missing_keys_with_type_error() -> None:
    # the router skips entries that raise TypeError or ValueError
    with pytest.raises(TypeError):
        KillSwitchEntry.from_dict(raw(extra=1))
    d = raw()
    del d["reason"]
    with pytest.raises(TypeError):
        KillSwitchEntry.from_dict(d)


# -- active / blocking / model_blocked ----------------------------------------------


def test_active_drops_expired_entries_and_keeps_order() -> None:
    a = entry("tenant", "a", id="a", expires_in_s=1)
    b = entry("tenant", "b", id="b", expires_in_s=3)
    c = entry("global", id="c", expires_in_s=2)
    entries = [a, b, c]
    assert active(entries, NOW_S) == [a, b, c]
    assert active(entries, NOW_S + 1) == [b, c]
    assert active(entries, NOW_S + 2) == [b]
    assert active(entries, NOW_S + 3) == []
    assert active([], NOW_S) == []


def test_blocking_by_tenant() -> None:
    e = entry("tenant", "acme")
    assert blocking([e], NOW_S, "acme", "critical") is e
    assert blocking([e], NOW_S, "globex", "critical") is None


def test_blocking_by_criticality() -> None:
    e = entry("criticality", "sheddable")
    assert blocking([e], NOW_S, "acme", "sheddable") is e
    assert blocking([e], NOW_S, "acme", "critical") is None


def test_blocking_global_blocks_everyone() -> None:
    e = entry("global")
    assert blocking([e], NOW_S, "acme", "critical") is e
    assert blocking([e], NOW_S, "globex", "sheddable") is e


def test_blocking_ignores_model_scope() -> None:
    # a model switch takes a model out of the chain; it never refuses a request outright
    e = entry("model", "llama")
    assert blocking([e], NOW_S, "llama", "llama") is None
    assert blocking([e], NOW_S, "acme", "critical") is None


def test_blocking_ignores_expired_entries_from_the_boundary_on() -> None:
    e = entry("tenant", "acme", expires_in_s=2)
    assert blocking([e], NOW_S + 1, "acme", "critical") is e
    assert blocking([e], NOW_S + 2, "acme", "critical") is None


def test_blocking_skips_expired_and_model_entries_to_find_a_live_one() -> None:
    expired = entry("global", id="old", expires_in_s=1)
    model = entry("model", "llama", id="m")
    live = entry("tenant", "acme", id="t", expires_in_s=10)
    assert blocking([expired, model, live], NOW_S + 1, "acme", "critical") is live
    assert blocking([expired, model, live], NOW_S + 1, "globex", "critical") is None


def test_blocking_with_no_entries() -> None:
    assert blocking([], NOW_S, "acme", "critical") is None


def test_blocking_accepts_any_iterable() -> None:
    e = entry("global")
    assert blocking(iter([e]), NOW_S, "acme", "critical") is e


def test_model_blocked_only_by_a_live_model_entry_for_that_model() -> None:
    m = entry("model", "llama", id="m", expires_in_s=2)
    others = [entry("global", id="g"), entry("tenant", "llama", id="t"), entry("criticality", "llama", id="c")]
    entries = others + [m]
    assert model_blocked(entries, NOW_S, "llama") is m
    assert model_blocked(entries, NOW_S, "mistral") is None
    assert model_blocked(entries, NOW_S + 1, "llama") is m
    assert model_blocked(entries, NOW_S + 2, "llama") is None  # expired at the boundary
    # global, tenant and criticality entries never take a model out
    assert model_blocked(others, NOW_S, "llama") is None


def test_module_exports_the_limits() -> None:
    assert killswitch.MAX_REASON_CHARS == 500


# --------------------------------------------------------------------------- values that name nothing

NAMES = {
    "tenant": ["gold", "free"],
    "model": ["m", "m-small"],
    "criticality": ["critical_plus", "critical", "sheddable_plus", "sheddable"],
}


@pytest.mark.parametrize(
    "scope,value",
    [
        ("criticality", "sheddable "),  # a trailing space: blocked nothing, answered 201
        ("criticality", "SHEDDABLE"),
        ("criticality", "low"),
        ("tenant", "ghost"),
        ("tenant", " gold"),
        ("model", "gpt-4"),
    ],
)
def test_a_value_that_names_nothing_is_refused_with_the_allowed_values(scope, value):
    with pytest.raises(ValueError) as e:
        killswitch.check_value(scope, value, NAMES)
    msg = str(e.value)
    assert msg.startswith("value: ")
    assert all(name in msg for name in NAMES[scope])


@pytest.mark.parametrize(
    "scope,value",
    [
        ("global", None),
        ("tenant", "free"),
        ("model", "m-small"),
        ("criticality", "sheddable"),
    ],
)
def test_a_value_that_names_something_is_taken(scope, value):
    killswitch.check_value(scope, value, NAMES)  # no error


def test_an_unknown_scope_is_refused_before_its_value():
    with pytest.raises(ValueError, match="^scope: "):
        killswitch.check_value("galaxy", "free", NAMES)
