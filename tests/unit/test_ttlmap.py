"""ballast/policies/ttlmap.py: the bounded TTL map, walked tick by tick."""

from __future__ import annotations

import pytest

from ballast.policies.ttlmap import TTLMap


def test_a_finished_entry_lives_ttl_s_the_boundary_included() -> None:
    m: TTLMap[str, str] = TTLMap(ttl_s=3, max_entries=10)
    m.put("k", "v", done_at_s=0)
    for now in (0, 1, 2, 3):
        assert m.get("k", now) == "v", now
    assert m.get("k", 4) is None
    assert len(m) == 0  # dropped when looked up


def test_a_pending_entry_lives_until_it_finishes_then_ttl_s() -> None:
    m: TTLMap[str, str] = TTLMap(ttl_s=2, max_entries=10)
    held = m.put("k", "v")
    assert m.get("k", 1000) == "v"  # no lease: pending never expires by age
    held.finish(1000)
    assert m.get("k", 1002) == "v"
    assert m.get("k", 1003) is None


def test_a_pending_entry_with_a_lease_is_gone_at_the_lease() -> None:
    m: TTLMap[str, str] = TTLMap(ttl_s=60, max_entries=10)
    m.put("k", "v", lease_until_s=3)
    for now in (0, 1, 2):
        assert m.get("k", now) == "v", now
    assert m.get("k", 3) is None


def test_a_full_map_drops_the_oldest_and_touch_refreshes_recency() -> None:
    m: TTLMap[str, int] = TTLMap(ttl_s=100, max_entries=2)
    m.put("a", 1, done_at_s=0)
    m.put("b", 2, done_at_s=0)
    assert m.get("a", 1, touch=True) == 1  # a is now the newest
    m.put("c", 3, done_at_s=1)
    assert len(m) == 2 and m.get("b", 1) is None and m.get("a", 1) == 1
    m.put("a", 10, done_at_s=2)  # replacing does not grow nor evict
    assert len(m) == 2 and m.get("c", 2) == 3


def test_keep_pending_drops_finished_entries_before_older_pending_ones() -> None:
    m: TTLMap[str, int] = TTLMap(ttl_s=100, max_entries=2, keep_pending=True)
    m.put("pending", 1)
    m.put("done", 2, done_at_s=0)
    m.put("new", 3)
    assert m.get("done", 0) is None and m.get("pending", 0) == 1
    m.put("newer", 4)  # nothing finished left: the oldest pending one goes
    assert m.get("pending", 0) is None and len(m) == 2


def test_expire_drops_every_expired_entry_at_once() -> None:
    m: TTLMap[str, int] = TTLMap(ttl_s=5, max_entries=10)
    for i in range(3):
        m.put(f"old{i}", i, done_at_s=0)
    m.put("running", 9)
    m.expire(5)
    assert len(m) == 4
    m.expire(6)
    assert len(m) == 1 and m.get("running", 6) == 9


def test_remove_only_the_entry_still_held() -> None:
    m: TTLMap[str, int] = TTLMap(ttl_s=5, max_entries=10)
    first = m.put("k", 1)
    m.put("k", 2)
    m.remove("k", first)  # replaced since: kept
    assert m.get("k", 0) == 2
    m.remove("k")
    assert len(m) == 0


@pytest.mark.parametrize(("kw", "field"), [({"ttl_s": 0, "max_entries": 1}, "ttl_s"), ({"ttl_s": 1, "max_entries": 0}, "max_entries")])
def test_bad_settings_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TTLMap(**kw)
