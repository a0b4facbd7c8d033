"""ballast.policies.holdings: a replica's mirror of its adapter slots, its demand window,
and the report routers read (fail closed on anything malformed)."""

import pytest

from ballast.policies.holdings import MAX_REPORTED, AdapterHoldings, AdapterReport, fleet_demand


def test_the_mirror_is_the_lru_of_the_calls_as_many_as_the_slots_call_by_call() -> None:
    h = AdapterHoldings(slots=2, demand_window=4)
    steps = [
        ("sql", ("sql",), {"sql": 1}),
        ("chat", ("chat", "sql"), {"sql": 1, "chat": 1}),
        ("sql", ("sql", "chat"), {"sql": 2, "chat": 1}),  # used again: the most recent
        ("code", ("code", "sql"), {"sql": 2, "chat": 1, "code": 1}),  # chat, the LRU, out
        ("code", ("code", "sql"), {"sql": 1, "chat": 1, "code": 2}),  # the window: the first sql out
    ]
    for i, (adapter, held, demand) in enumerate(steps):
        h.ran(adapter)
        assert h.held == held, i
        assert h.report(0.0).demand == demand, i


def test_an_engine_without_slots_holds_nothing_but_counts_demand() -> None:
    h = AdapterHoldings(slots=0)
    h.ran("sql")
    assert h.held == () and h.report(0.0).demand == {"sql": 1}


def test_the_stamp_is_floored_so_an_unchanged_report_changes_once_per_stamp() -> None:
    h = AdapterHoldings(slots=2, stamp_s=5.0)
    h.ran("sql")
    assert [h.report(t).at_s for t in (100.0, 101.0, 104.9, 105.0, 109.0)] == [100.0, 100.0, 100.0, 105.0, 105.0]
    assert h.report(101.0) == h.report(104.0)  # equal: Serve rebroadcasts nothing
    r = h.report(105.0)
    assert r.is_fresh(105.0 + 15.0, max_age_s=15.0) and not r.is_fresh(105.0 + 15.5, max_age_s=15.0)


def test_a_report_round_trips_through_the_routing_stats() -> None:
    h = AdapterHoldings(slots=2)
    for a in ("sql", "chat", "sql"):
        h.ran(a)
    r = h.report(10.0)
    assert AdapterReport.of(r.as_stats()) == r
    assert r.as_stats() == {"held": ["sql", "chat"], "slots": 2, "demand": {"sql": 2, "chat": 1}, "at_s": 10.0}


@pytest.mark.parametrize(
    "stats",
    [
        None,
        "held",
        {},
        {"held": "sql", "slots": 2, "demand": {}, "at_s": 0.0},
        {"held": ["sql", 3], "slots": 2, "demand": {}, "at_s": 0.0},
        {"held": ["a", "b", "c"], "slots": 2, "demand": {}, "at_s": 0.0},  # more than its slots
        {"held": [], "slots": True, "demand": {}, "at_s": 0.0},
        {"held": [], "slots": MAX_REPORTED + 1, "demand": {}, "at_s": 0.0},
        {"held": [], "slots": 2, "demand": {"sql": -1}, "at_s": 0.0},
        {"held": [], "slots": 2, "demand": {"sql": 1.5}, "at_s": 0.0},
        {"held": [], "slots": 2, "demand": [], "at_s": 0.0},
        {"held": [], "slots": 2, "demand": {}, "at_s": float("nan")},
        {"held": [], "slots": 2, "demand": {}},
    ],
)
def test_a_malformed_report_reads_as_none(stats: object) -> None:
    assert AdapterReport.of(stats) is None


def test_the_fleet_demand_is_the_sum_of_the_reports() -> None:
    a = AdapterReport(("sql",), 2, {"sql": 3, "chat": 1})
    b = AdapterReport(("chat",), 2, {"chat": 4})
    assert fleet_demand({"a": a, "b": b}) == {"sql": 3, "chat": 5}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        AdapterHoldings(slots=-1)
    with pytest.raises(ValueError):
        AdapterHoldings(slots=2, stamp_s=0)
    with pytest.raises(ValueError):
        AdapterHoldings(slots=2, demand_window=0)
