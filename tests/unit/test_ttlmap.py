"""ballast/policies/ttlmap.py: the bounded TTL map, walked tick by tick."""

from __future__ import annotations

import pytest

from ballast.policies.ttlmap import TTLMap


def by_tenant(key: tuple[str, str]) -> str:
    return key[0]


def test_a_finished_entry_lives_ttl_s_the_boundary_included() -> None:
    m: TTLMap[str, str] = TTLMap(ttl_s=3, max_entries=10)
    m.put("k", "v", 0, done=True)
    for now in (0, 1, 2, 3):
        assert m.get("k", now) == "v", now
    assert m.get("k", 4) is None
    assert len(m) == 0  # dropped when looked up


def test_a_pending_entry_lives_until_it_finishes_then_ttl_s() -> None:
    m: TTLMap[str, str] = TTLMap(ttl_s=2, max_entries=10)
    held = m.put("k", "v", 0)
    assert m.get("k", 1000) == "v"  # no lease: pending never expires by age
    assert m.finish("k", held, 1000)
    assert m.get("k", 1002) == "v"
    assert m.get("k", 1003) is None


def test_a_pending_entry_with_a_lease_is_gone_at_the_lease() -> None:
    m: TTLMap[str, str] = TTLMap(ttl_s=60, max_entries=10)
    m.put("k", "v", 0, lease_until_s=3)
    for now in (0, 1, 2):
        assert m.get("k", now) == "v", now
    assert m.get("k", 3) is None


def test_a_full_map_drops_the_oldest_and_touch_refreshes_recency() -> None:
    m: TTLMap[str, int] = TTLMap(ttl_s=100, max_entries=2)
    m.put("a", 1, 0, done=True)
    m.put("b", 2, 0, done=True)
    assert m.get("a", 1, touch=True) == 1  # a is now the newest
    m.put("c", 3, 1, done=True)
    assert len(m) == 2 and m.get("b", 1) is None and m.get("a", 1) == 1
    m.put("a", 10, 2, done=True)  # replacing does not grow nor evict
    assert len(m) == 2 and m.get("c", 2) == 3


def test_a_pending_entry_is_never_evicted_a_new_key_is_refused_instead() -> None:
    m: TTLMap[str, int] = TTLMap(ttl_s=100, max_entries=2)
    m.put("pending", 1, 0)
    m.put("done", 2, 0, done=True)
    assert m.put("new", 3, 0) is not None  # the finished one makes room
    assert m.get("done", 0) is None and m.get("pending", 0) == 1
    assert m.put("newer", 4, 0) is None  # nothing finished left: refused, none evicted
    assert len(m) == 2 and m.get("pending", 0) == 1 and m.get("new", 0) == 3


def test_touch_moves_recency_not_age() -> None:
    m: TTLMap[str, int] = TTLMap(ttl_s=5, max_entries=10)
    m.put("a", 1, 0, done=True)
    m.put("b", 2, 1, done=True)
    assert m.get("a", 4, touch=True) == 1
    m.expire(6)  # a (done at 0) is past its TTL though it was used last
    assert m.get("a", 6) is None and m.get("b", 6) == 2


def test_expire_drops_every_expired_entry_at_once() -> None:
    m: TTLMap[str, int] = TTLMap(ttl_s=5, max_entries=10)
    for i in range(3):
        m.put(f"old{i}", i, 0, done=True)
    m.put("running", 9, 0)
    m.expire(5)
    assert len(m) == 4
    m.expire(6)
    assert len(m) == 1 and m.get("running", 6) == 9


def test_expire_drops_pending_entries_whose_lease_ran_out_in_lease_order() -> None:
    m: TTLMap[str, int] = TTLMap(ttl_s=60, max_entries=10)
    m.put("long", 1, 0, lease_until_s=9)
    m.put("short", 2, 0, lease_until_s=3)
    m.put("mid", 3, 0, lease_until_s=5)
    for now, left in ((2, 3), (3, 2), (4, 2), (5, 1), (8, 1), (9, 0)):
        m.expire(now)
        assert len(m) == left, now


def test_remove_only_the_entry_still_held() -> None:
    m: TTLMap[str, int] = TTLMap(ttl_s=5, max_entries=10)
    first = m.put("k", 1, 0)
    m.put("k", 2, 0)
    m.remove("k", first)  # replaced since: kept
    assert m.get("k", 0) == 2
    m.remove("k")
    assert len(m) == 0


# -- groups (tenants) -------------------------------------------------------------------


def test_a_group_at_its_bound_loses_its_own_oldest_never_another_groups() -> None:
    m: TTLMap[tuple[str, str], int] = TTLMap(ttl_s=600, max_entries=100, max_entries_per_group=3, group=by_tenant)
    m.put(("quiet", "q"), 0, 0, done=True)
    for i in range(1000):  # one tenant's flood of new keys
        assert m.put(("loud", f"k{i}"), i, 1, done=True) is not None
        assert m.group_len("loud") == min(i + 1, 3)
    assert m.get(("quiet", "q"), 1) == 0  # untouched
    assert [m.get(("loud", f"k{i}"), 1) for i in (997, 998, 999)] == [997, 998, 999]
    assert len(m) == 4


def test_a_group_whose_entries_all_run_is_refused_a_new_key_others_are_not() -> None:
    m: TTLMap[tuple[str, str], int] = TTLMap(ttl_s=600, max_entries=100, max_entries_per_group=2, group=by_tenant)
    m.put(("loud", "a"), 1, 0)
    m.put(("loud", "b"), 2, 0)
    assert m.put(("loud", "c"), 3, 0) is None
    assert m.put(("quiet", "c"), 3, 0) is not None
    assert m.group_len("loud") == 2 and m.get(("loud", "a"), 0) == 1


def test_a_groups_bytes_are_bounded_its_oldest_answers_go_first() -> None:
    m: TTLMap[tuple[str, str], str] = TTLMap(ttl_s=600, max_entries=100, max_bytes_per_group=10, group=by_tenant)
    m.put(("quiet", "q"), "x", 0, done=True, size_bytes=9)
    m.put(("loud", "a"), "a", 1, done=True, size_bytes=4)
    m.put(("loud", "b"), "b", 2, done=True, size_bytes=4)
    assert m.group_bytes("loud") == 8
    m.put(("loud", "c"), "c", 3, done=True, size_bytes=4)  # 12 > 10: a goes
    assert m.get(("loud", "a"), 3) is None and m.group_bytes("loud") == 8
    pending = m.put(("loud", "d"), "d", 4)  # pending entries weigh nothing until they finish
    assert m.finish(("loud", "d"), pending, 5, size_bytes=7)  # 15: b and c go
    assert m.group_bytes("loud") == 7 and m.group_len("loud") == 1
    big = m.put(("loud", "e"), "e", 6)
    assert not m.finish(("loud", "e"), big, 6, size_bytes=11)  # alone over the bound: not kept
    assert m.get(("loud", "e"), 6) is None and m.get(("loud", "d"), 6) is None
    assert m.get(("quiet", "q"), 6) == "x" and m.group_bytes("quiet") == 9


def test_the_global_bound_stays_a_backstop_across_groups() -> None:
    m: TTLMap[tuple[str, str], int] = TTLMap(ttl_s=600, max_entries=3, max_entries_per_group=3, group=by_tenant)
    m.put(("a", "1"), 1, 0, done=True)
    m.put(("b", "1"), 2, 1, done=True)
    m.put(("c", "1"), 3, 2, done=True)
    m.put(("d", "1"), 4, 3, done=True)  # the oldest finished overall goes
    assert len(m) == 3 and m.get(("a", "1"), 3) is None


# -- the work a new key costs -------------------------------------------------------------


def test_a_new_key_into_a_full_map_visits_a_bounded_number_of_entries() -> None:
    """10,000 live entries (half running), then each new key: the sweep looks at the
    oldest finished one and the head of the lease heap, the bound evicts one. The count
    of entries visited stays the same whatever the map's size (the old map walked all of
    them, per new key, when full)."""
    n = 10_000
    m: TTLMap[tuple[str, str], int] = TTLMap(ttl_s=600, max_entries=n, max_entries_per_group=n, group=by_tenant)
    for i in range(n // 2):
        m.put(("t", f"run{i}"), i, 0, lease_until_s=10_000)
        m.put(("t", f"done{i}"), i, 0, done=True)
    assert len(m) == n
    costs = []
    for i in range(100):
        before = m.visited
        assert m.put(("t", f"new{i}"), i, 1, done=True) is not None
        costs.append(m.visited - before)
    assert len(m) == n and max(costs) <= 2  # the head looked at, one evicted


def test_expiry_visits_each_entry_once_over_a_run() -> None:
    m: TTLMap[tuple[str, str], int] = TTLMap(ttl_s=5, max_entries=100_000)
    for t in range(1000):
        m.put(("t", f"k{t}"), t, t, done=True)  # each put sweeps the expired head
        held = m.put(("t", f"lease{t}"), t, t, lease_until_s=t + 3)
        if t % 2:
            m.finish(("t", f"lease{t}"), held, t)  # its lease record is left stale in the heap
    # Each of the 2000 entries is looked at about once when it goes, plus one live head a
    # sweep per put: linear in the operations, not in operations x size.
    assert m.visited <= 3 * 2000


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"ttl_s": 0, "max_entries": 1}, "ttl_s"),
        ({"ttl_s": 1, "max_entries": 0}, "max_entries"),
        ({"ttl_s": 1, "max_entries": 1, "max_entries_per_group": 0}, "max_entries_per_group"),
        ({"ttl_s": 1, "max_entries": 1, "max_bytes_per_group": 0}, "max_bytes_per_group"),
    ],
)
def test_bad_settings_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TTLMap(**kw)
