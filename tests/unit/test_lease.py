"""Leases (ballast/policies/lease.py): heartbeat grace, hard TTL, health, ownership, persistence.

Wall times are integers advanced by a FakeClock, so every boundary is exact: a
lease with a 2 s interval and 3 missed heartbeats allowed is still held at
exactly 6 s without a heartbeat and expired at 7 s (and at 6 s + a hair).
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
from fakes import FakeClock

from ballast.policies.lease import MAX_DATA_ITEMS, Health, Lease, LeaseLost, LeaseTable

NOW_S = 1_700_000_000  # an integer wall time
RES = "recycle/BallastModel"


def lease(**overrides: Any) -> Lease:
    kw: dict[str, Any] = dict(
        id="lease-1",
        resource=RES,
        holder="controller-1",
        acquired_at_s=NOW_S,
        last_heartbeat_s=NOW_S,
        ttl_s=1800,
        heartbeat_interval_s=2,
    )
    kw.update(overrides)
    return Lease(**kw)


def acquire(table: LeaseTable, clock: FakeClock, **overrides: Any) -> Lease | None:
    kw: dict[str, Any] = dict(
        resource=RES,
        holder="controller-1",
        now_s=clock(),
        ttl_s=1800,
        heartbeat_interval_s=2,
        lease_id="lease-1",
    )
    kw.update(overrides)
    return table.acquire(**kw)


# -- a single lease, tick by tick ---------------------------------------------------


def test_expires_exactly_after_three_missed_heartbeats_and_health_walks_through_levels() -> None:
    clock = FakeClock(NOW_S)
    ls = lease()
    # (seconds since the last heartbeat, health, expired)
    expected = [
        (0, Health.HEALTHY, False),
        (1, Health.HEALTHY, False),
        (2, Health.HEALTHY, False),  # one interval: still healthy
        (3, Health.WARNING, False),
        (4, Health.WARNING, False),
        (5, Health.WARNING, False),
        (6, Health.WARNING, False),  # exactly 3 intervals: still held (strict >)
        (7, Health.CRITICAL, True),
        (8, Health.CRITICAL, True),
    ]
    for age_s, health, expired in expected:
        assert clock() - NOW_S == age_s
        assert ls.heartbeat_age(clock()) == age_s
        assert ls.health(clock()) is health, age_s
        assert ls.expired(clock()) is expired, age_s
        clock.advance()
    assert ls.expired(NOW_S + 6 + 1e-6)
    assert ls.expires_at_s() == NOW_S + 6


def test_health_values_are_the_seed_strings() -> None:
    assert [h.value for h in Health] == ["healthy", "warning", "critical"]
    assert Health("warning") is Health.WARNING


def test_missed_allowed_sets_the_grace() -> None:
    ls = lease(missed_allowed=1, heartbeat_interval_s=5)
    assert not ls.expired(NOW_S + 5) and ls.health(NOW_S + 5) is Health.HEALTHY
    assert ls.expired(NOW_S + 6) and ls.health(NOW_S + 6) is Health.CRITICAL


def test_hard_ttl_expires_even_with_faithful_heartbeats() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable()
    ls = acquire(table, clock, ttl_s=10)
    assert ls is not None
    while clock() < NOW_S + 10:
        assert not table.get(RES).expired(clock())  # type: ignore[union-attr]
        clock.advance(2)
        if clock() < NOW_S + 10:
            ls = table.heartbeat("lease-1", "controller-1", clock())
            assert ls.health(clock()) is Health.HEALTHY
    # t = 10: heartbeats were never late, yet the TTL is reached (>=).
    assert clock() == NOW_S + 10
    assert table.get(RES).expired(clock())  # type: ignore[union-attr]
    assert ls.expires_at_s() == NOW_S + 10
    with pytest.raises(LeaseLost) as err:
        table.heartbeat("lease-1", "controller-1", clock())
    assert err.value.reason == "expired"


def test_expires_at_is_the_earlier_of_ttl_and_heartbeat_grace() -> None:
    assert lease(ttl_s=100).expires_at_s() == NOW_S + 6
    assert lease(ttl_s=100, last_heartbeat_s=NOW_S + 96).expires_at_s() == NOW_S + 100
    assert lease(ttl_s=4).expires_at_s() == NOW_S + 4


def test_a_heartbeat_on_the_last_held_instant_renews() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable()
    acquire(table, clock)
    clock.advance(6)  # exactly 3 intervals
    renewed = table.heartbeat("lease-1", "controller-1", clock())
    assert renewed.last_heartbeat_s == NOW_S + 6
    assert renewed.acquired_at_s == NOW_S  # the TTL is not extended
    clock.advance(6)
    assert not renewed.expired(clock())
    clock.advance(1)
    assert renewed.expired(clock())


def test_a_clock_stepping_back_neither_ages_negatively_nor_rewinds_the_heartbeat() -> None:
    clock = FakeClock(NOW_S + 4)
    table = LeaseTable()
    acquire(table, clock)
    assert table.get(RES).heartbeat_age(NOW_S) == 0.0  # type: ignore[union-attr]
    renewed = table.heartbeat("lease-1", "controller-1", NOW_S)
    assert renewed.last_heartbeat_s == NOW_S + 4


# -- ownership ----------------------------------------------------------------------


def test_heartbeat_by_a_non_holder_or_unknown_id_raises_lease_lost() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable()
    acquire(table, clock)
    with pytest.raises(LeaseLost) as err:
        table.heartbeat("lease-1", "controller-2", clock())
    assert (err.value.lease_id, err.value.holder, err.value.reason) == ("lease-1", "controller-2", "holder")
    with pytest.raises(LeaseLost) as err:
        table.heartbeat("nope", "controller-1", clock())
    assert err.value.reason == "unknown"
    # The holder's own lease is untouched by the failed attempts.
    assert table.get(RES).holder == "controller-1"  # type: ignore[union-attr]


def test_heartbeat_after_missed_heartbeats_raises_lease_lost() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable()
    acquire(table, clock)
    clock.advance(7)
    with pytest.raises(LeaseLost) as err:
        table.heartbeat("lease-1", "controller-1", clock())
    assert err.value.reason == "expired"


def test_lease_lost_pickles_with_its_fields() -> None:
    err = pickle.loads(pickle.dumps(LeaseLost("lease-1", "controller-2", "holder")))
    assert isinstance(err, LeaseLost)
    assert (err.lease_id, err.holder, err.reason) == ("lease-1", "controller-2", "holder")
    assert "controller-2" in str(err)


def test_acquire_while_held_returns_none_even_for_the_same_holder() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable()
    first = acquire(table, clock)
    assert first is not None
    for tick in range(7):  # held through the whole grace, no heartbeat needed
        assert acquire(table, clock, holder="controller-2", lease_id=f"l2-{tick}") is None
        assert acquire(table, clock, lease_id=f"l1-{tick}") is None
        clock.advance()
    assert table.get(RES) == first
    assert len(table) == 1


def test_a_new_controller_carries_on_after_the_old_one_dies() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable()
    acquire(table, clock, data=(("replica_id", "abc"), ("reason", "max_age")))
    for _ in range(3):  # the old controller heartbeats for a while, then crashes
        clock.advance(2)
        table.heartbeat("lease-1", "controller-1", clock())
    crashed_at_s = clock()
    clock.advance(6)
    assert acquire(table, clock, holder="controller-2", lease_id="lease-2") is None  # 3 intervals: still held
    clock.advance(1)
    # The new controller reads what the old one was doing, then takes over.
    old = table.get(RES)
    assert old is not None and old.expired(clock()) and old.value_of("replica_id") == "abc"
    new = acquire(table, clock, holder="controller-2", lease_id="lease-2", data=old.data)
    assert new is not None
    assert (new.holder, new.acquired_at_s, new.value_of("reason")) == ("controller-2", crashed_at_s + 7, "max_age")
    assert table.leases() == [new]
    # The old holder, back from a long pause, has lost its lease.
    with pytest.raises(LeaseLost) as err:
        table.heartbeat("lease-1", "controller-1", clock())
    assert err.value.reason == "unknown"
    assert table.release("lease-1", "controller-1") is False
    assert table.get(RES) == new


def test_release_is_idempotent_and_refuses_a_non_holder() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable()
    acquire(table, clock)
    with pytest.raises(LeaseLost) as err:
        table.release("lease-1", "controller-2")
    assert err.value.reason == "holder"
    assert table.release("lease-1", "controller-1") is True
    assert table.release("lease-1", "controller-1") is False
    assert table.get(RES) is None
    assert acquire(table, clock, holder="controller-2", lease_id="lease-2") is not None


def test_expire_removes_and_returns_only_expired_leases() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable()
    acquire(table, clock, resource="a", lease_id="la")
    acquire(table, clock, resource="b", lease_id="lb", ttl_s=5)
    acquire(table, clock, resource="c", lease_id="lc")  # never heartbeated
    for _ in range(2):  # t = 2, 4: nothing expired; a and b heartbeat
        clock.advance(2)
        assert table.expire(clock()) == []
        table.heartbeat("la", "controller-1", clock())
        table.heartbeat("lb", "controller-1", clock())
    clock.advance(2)  # t = 6: b reached its TTL; c is at exactly 3 intervals, still held
    assert [ls.id for ls in table.expire(clock())] == ["lb"]
    assert [ls.resource for ls in table.leases()] == ["a", "c"]
    clock.advance(1)  # t = 7: c 7 s without a heartbeat; a 3 s
    assert [ls.id for ls in table.expire(clock())] == ["lc"]
    assert [ls.resource for ls in table.leases()] == ["a"]
    assert table.expire(clock()) == []


def test_a_lease_id_naming_another_live_lease_is_refused() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable()
    acquire(table, clock, resource="a", lease_id="same")
    with pytest.raises(ValueError, match="^lease_id:"):
        acquire(table, clock, resource="b", lease_id="same")
    clock.advance(7)  # once "a" has expired, its id may be reused
    assert acquire(table, clock, resource="b", lease_id="same") is not None
    assert [ls.resource for ls in table.leases()] == ["b"]


# -- bound --------------------------------------------------------------------------


def test_table_bound_refuses_when_full_of_live_leases_and_reuses_expired_room() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable(max_leases=3)
    for i in range(3):
        got = acquire(table, clock, resource=f"r{i}", lease_id=f"l{i}", ttl_s=10 + i, heartbeat_interval_s=100)
        assert got is not None
    with pytest.raises(ValueError, match="^resource:"):
        acquire(table, clock, resource="r3", lease_id="l3")
    assert len(table) == 3
    clock.advance(10)  # r0 reached its TTL; r1 and r2 are live
    assert acquire(table, clock, resource="r3", lease_id="l3") is not None
    assert len(table) == 3
    assert [ls.resource for ls in table.leases()] == ["r1", "r2", "r3"]
    with pytest.raises(ValueError, match="^resource:"):
        acquire(table, clock, resource="r4", lease_id="l4")
    # Replacing an expired lease on the same resource needs no extra room.
    clock.advance(1)  # r1 reached its TTL
    assert acquire(table, clock, resource="r1", lease_id="l1b") is not None
    assert len(table) == 3


def test_max_leases_is_validated() -> None:
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="^max_leases:"):
            LeaseTable(max_leases=bad)  # type: ignore[arg-type]


# -- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("id", ""),
        ("resource", None),
        ("holder", 3),
        ("acquired_at_s", float("nan")),
        ("acquired_at_s", "now"),
        ("last_heartbeat_s", NOW_S - 1),
        ("ttl_s", 0),
        ("ttl_s", float("inf")),
        ("heartbeat_interval_s", -2),
        ("missed_allowed", 0),
        ("missed_allowed", True),
        ("data", [("a", "b")]),
        ("data", (("a", 1),)),
        ("data", (("a", "b"), ("a", "c"))),
        ("data", tuple((f"k{i}", "v") for i in range(MAX_DATA_ITEMS + 1))),
        ("data", (("k", "v" * 1000),)),
    ],
)
def test_invalid_lease_fields_raise_value_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        lease(**{field: value})


# -- persistence --------------------------------------------------------------------


def test_lease_round_trips_through_json() -> None:
    ls = lease(missed_allowed=4, data=(("replica_id", "abc"), ("reason", "max_age")), last_heartbeat_s=NOW_S + 2.5)
    back = Lease.from_dict(json.loads(json.dumps(ls.to_dict())))
    assert back == ls
    assert isinstance(back.data, tuple) and all(isinstance(p, tuple) for p in back.data)


def test_table_round_trips_through_json() -> None:
    clock = FakeClock(NOW_S)
    table = LeaseTable()
    acquire(table, clock, resource="b", lease_id="lb", data=(("replica_id", "x"),))
    acquire(table, clock, resource="a", lease_id="la")
    clock.advance(2)
    table.heartbeat("lb", "controller-1", clock())
    back = LeaseTable.from_dict(json.loads(json.dumps(table.to_dict())))
    assert back.leases() == table.leases()
    # The restored table behaves like the original: ownership and liveness included.
    assert acquire(back, clock, resource="a", holder="controller-2", lease_id="l2") is None
    assert back.heartbeat("lb", "controller-1", clock()).value_of("replica_id") == "x"
    with pytest.raises(LeaseLost):
        back.heartbeat("la", "controller-2", clock())


def _good() -> dict[str, Any]:
    return lease(data=(("k", "v"),)).to_dict()


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda d: d.pop("ttl_s"), "ttl_s"),
        (lambda d: d.pop("id"), "id"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d.update(ttl_s="1800"), "ttl_s"),
        (lambda d: d.update(missed_allowed=2.0), "missed_allowed"),
        (lambda d: d.update(data="k=v"), "data"),
        (lambda d: d.update(data=[["k"]]), "data"),
        (lambda d: d.update(data=[["k", 1]]), "data"),
        (lambda d: d.update(holder=None), "holder"),
    ],
)
def test_malformed_lease_dict_raises_value_error(mutate: Any, field: str) -> None:
    d = _good()
    mutate(d)
    with pytest.raises(ValueError, match=f"^{field}:"):
        Lease.from_dict(d)


def test_non_mapping_lease_raises_value_error() -> None:
    for bad in (None, [], "lease"):
        with pytest.raises(ValueError):
            Lease.from_dict(bad)  # type: ignore[arg-type]


def test_malformed_table_dict_raises_value_error() -> None:
    one = lease().to_dict()
    other_resource = lease(id="lease-2", resource="other").to_dict()
    other_id = lease(id="lease-2").to_dict()
    with pytest.raises(ValueError, match="^leases:"):
        LeaseTable.from_dict({})
    with pytest.raises(ValueError, match="^leases:"):
        LeaseTable.from_dict({"leases": {"a": one}})
    with pytest.raises(ValueError, match="^resource:"):
        LeaseTable.from_dict({"leases": [one, other_id]})
    with pytest.raises(ValueError, match="^id:"):
        LeaseTable.from_dict({"leases": [one, lease(resource="other").to_dict()]})
    with pytest.raises(ValueError, match="^leases:"):
        LeaseTable.from_dict({"leases": [one, other_resource]}, max_leases=1)
    with pytest.raises(ValueError, match="^ttl_s:"):
        LeaseTable.from_dict({"leases": [{**one, "ttl_s": -1}]})
