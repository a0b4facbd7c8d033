"""ballast.policies.holdings: a replica's mirror of its adapter slots, its demand window,
and the report routers read (fail closed on anything malformed)."""

import pytest

from ballast.policies.catalog import MAX_NAME_CHARS
from ballast.policies.holdings import MAX_REPORTED, AdapterHoldings, AdapterReport, SeenStamps, fleet_demand


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
        {"held": [""], "slots": 2, "demand": {}, "at_s": 0.0},  # no name
        {"held": ["x" * (MAX_NAME_CHARS + 1)], "slots": 2, "demand": {}, "at_s": 0.0},
        {"held": [], "slots": 2, "demand": {"x" * (MAX_NAME_CHARS + 1): 1}, "at_s": 0.0},
        {"held": [], "slots": 2, "demand": {f"a{i}": 1 for i in range(MAX_REPORTED + 1)}, "at_s": 0.0},
    ],
)
def test_a_malformed_report_reads_as_none(stats: object) -> None:
    assert AdapterReport.of(stats) is None
    assert AdapterReport.problem(stats)  # and says why


def test_a_report_at_its_bounds_is_read_and_one_past_them_is_refused_naming_the_field() -> None:
    longest = "x" * MAX_NAME_CHARS
    at_bounds = {
        "held": [longest, "sql"],
        "slots": MAX_REPORTED,
        "demand": {f"a{i}": 1 for i in range(MAX_REPORTED - 1)} | {longest: 2},
        "at_s": 5.0,
    }
    report = AdapterReport.of(at_bounds)
    assert AdapterReport.problem(at_bounds) is None and report is not None
    assert report.held == (longest, "sql") and len(report.demand) == MAX_REPORTED
    past = [
        ({**at_bounds, "held": [longest + "x"]}, "held"),
        ({**at_bounds, "slots": 1}, "held"),  # two held in one slot
        ({**at_bounds, "demand": {**at_bounds["demand"], "one-more": 1}}, "demand"),
        ({**at_bounds, "demand": {**at_bounds["demand"], longest: -1}}, "demand"),
        ({**at_bounds, "slots": MAX_REPORTED + 1}, "slots"),
    ]
    for stats, field in past:
        problem = AdapterReport.problem(stats)
        assert AdapterReport.of(stats) is None and problem is not None and problem.startswith(f"{field}:"), field


def test_a_held_list_longer_than_its_slots_is_refused_before_its_names_are_read() -> None:
    class Unreadable(str):
        def __len__(self) -> int:
            raise AssertionError("a name was read")

    held = ["sql"] * 3 + [Unreadable("x")]
    assert AdapterReport.problem({"held": held, "slots": 2, "demand": {}, "at_s": 0.0}) is not None


def test_a_stamp_ahead_of_the_readers_clock_ages_from_when_it_was_first_seen() -> None:
    stamps = SeenStamps()
    far_ahead = AdapterReport(("sql",), 2, {}, at_s=10_000.0)  # a replica's clock (or stamp) far ahead
    # Read at the reader's 100, 105, ..., the same stamp each time: taken as 100, the first sight.
    fresh = []
    for now in range(100, 125, 5):
        taken = stamps.taken("a", far_ahead.at_s, float(now))
        assert taken == 100.0, now
        fresh.append(AdapterReport(far_ahead.held, far_ahead.slots, {}, taken).is_fresh(float(now), 15.0))
    assert fresh == [True, True, True, True, False]  # stale 15 s after it arrived
    # A new stamp (the replica still reporting) is clamped afresh: fresh again.
    assert stamps.taken("a", 10_005.0, 120.0) == 120.0
    # A stamp behind the reader's clock is taken as it is, and ages as before.
    assert stamps.taken("b", 95.0, 100.0) == 95.0 and stamps.taken("b", 95.0, 111.0) == 95.0


def test_the_seen_stamps_are_bounded_and_start_over_past_their_capacity() -> None:
    stamps = SeenStamps(capacity=2)
    assert stamps.taken("a", 200.0, 100.0) == 100.0
    assert stamps.taken("b", 200.0, 100.0) == 100.0
    assert len(stamps) == 2
    assert stamps.taken("a", 200.0, 101.0) == 100.0  # a key it holds: no room needed
    assert stamps.taken("c", 200.0, 102.0) == 102.0 and len(stamps) == 1  # past it: started over
    assert stamps.taken("a", 200.0, 103.0) == 103.0  # forgotten: clamped again, to a later now
    with pytest.raises(ValueError):
        SeenStamps(capacity=0)


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
