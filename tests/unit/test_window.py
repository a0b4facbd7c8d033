"""ballast/policies/window.py: the count and time windows, walked tick by tick on a fake clock."""

import pytest

from ballast.policies.window import CountWindow, TimeWindow
from tests.unit.fakes import FakeClock

# --------------------------------------------------------------------------- CountWindow


def test_an_empty_count_window_holds_nothing_and_sums_to_zero() -> None:
    w: CountWindow[tuple[int, int]] = CountWindow(3, fields=2)
    assert (len(w), list(w), w.totals()) == (0, [], (0, 0))
    w.expire(100.0)  # nothing to drop
    assert (len(w), w.totals()) == (0, (0, 0))
    assert CountWindow(3).totals() == ()  # no fields: no sums


def test_the_count_window_keeps_the_last_size_samples_and_their_sums() -> None:
    clock = FakeClock(0)
    w: CountWindow[tuple[int, int]] = CountWindow(3, fields=2)
    # Each tick adds (1, failed) with a failure every other tick.
    expected = [
        # (tick, samples held, totals)
        (0, [(1, 1)], (1, 1)),
        (1, [(1, 1), (1, 0)], (2, 1)),
        (2, [(1, 1), (1, 0), (1, 1)], (3, 2)),
        (3, [(1, 0), (1, 1), (1, 0)], (3, 1)),  # full: the oldest leaves as the newest enters
        (4, [(1, 1), (1, 0), (1, 1)], (3, 2)),
        (5, [(1, 0), (1, 1), (1, 0)], (3, 1)),
    ]
    for tick, held, totals in expected:
        assert clock() == tick
        w.add((1, int(tick % 2 == 0)), clock())
        assert (list(w), w.totals(), len(w)) == (held, totals, len(held))
        clock.advance()


def test_the_count_window_never_holds_more_than_its_size() -> None:
    clock = FakeClock(0)
    w: CountWindow[int] = CountWindow(5, fields=0)
    for tick in range(50):
        w.add(tick, clock())
        assert len(w) == min(tick + 1, 5) <= w.size
        assert list(w) == list(range(max(0, tick - 4), tick + 1))
        clock.advance()


def test_expire_drops_the_samples_stamped_before_the_cutoff() -> None:
    """Samples no older than 3 s count (a sample exactly 3 s old still does)."""
    clock = FakeClock(0)
    w: CountWindow[tuple[int]] = CountWindow(100, fields=1)
    w.add((10,), clock())  # at 0
    clock.advance(2)
    w.add((5,), clock())  # at 2
    held = []
    for _ in range(5):  # ticks 2..6
        w.expire(clock() - 3)
        held.append((clock(), len(w), w.totals()))
        clock.advance()
    assert held == [(2, 2, (15,)), (3, 2, (15,)), (4, 1, (5,)), (5, 1, (5,)), (6, 0, (0,))]


def test_inclusive_expire_drops_a_sample_exactly_at_the_cutoff() -> None:
    """For entries that cover an interval ending at their stamp: one that ended 3 s ago is out."""
    clock = FakeClock(0)
    w: CountWindow[str] = CountWindow(100)
    w.add("a", clock())
    clock.advance()
    w.add("b", clock())
    held = []
    for _ in range(4):  # ticks 1..4
        w.expire(clock() - 3, inclusive=True)
        held.append((clock(), list(w)))
        clock.advance()
    assert held == [(1, ["a", "b"]), (2, ["a", "b"]), (3, ["b"]), (4, [])]


def test_expire_stops_at_the_first_sample_it_keeps() -> None:
    w: CountWindow[str] = CountWindow(10)
    w.add("old", 0.0)
    w.add("kept", 1.0)
    w.add("stepped back", -5.0)  # a clock that stepped back: kept while a newer one before it is
    w.expire(0.5)
    assert list(w) == ["kept", "stepped back"]
    w.expire(1.5)
    assert list(w) == []


def test_a_count_window_that_empties_sums_to_exactly_zero() -> None:
    w: CountWindow[tuple[float]] = CountWindow(10, fields=1)
    for i, v in enumerate((0.1, 0.2, 0.7)):
        w.add((v,), float(i))
    w.expire(10.0)
    assert w.totals() == (0,) and len(w) == 0  # not a rounding residue of 0.1 + 0.2 + 0.7 - ...


def test_clear_empties_the_count_window() -> None:
    w: CountWindow[tuple[int]] = CountWindow(3, fields=1)
    w.add((4,))
    w.add((5,))
    w.clear()
    assert (len(w), list(w), w.totals()) == (0, [], (0,))
    w.add((1,))
    assert w.totals() == (1,)


def test_a_count_window_reads_alike_at_any_time() -> None:
    w: CountWindow[tuple[int]] = CountWindow(2, fields=1)
    w.add((3,), 0.0)
    assert w.totals(0.0) == w.totals(1e9) == w.totals() == (3,)  # forgets by count, not by time


@pytest.mark.parametrize("kw", [{"size": 0}, {"size": 1.5}, {"size": 2, "fields": -1}])
def test_the_count_window_checks_its_config(kw) -> None:
    with pytest.raises(ValueError):
        CountWindow(**kw)


# --------------------------------------------------------------------------- TimeWindow


def test_an_empty_time_window_holds_nothing_and_sums_to_zero() -> None:
    w = TimeWindow(1.0, 3, fields=2)
    assert (len(w), w.totals(0.0), w.buckets(0.0), w.newest_start_s()) == (0, (0, 0), [], None)


def test_a_time_window_forgets_a_bucket_num_buckets_behind_walked_second_by_second() -> None:
    clock = FakeClock(0)
    w = TimeWindow(1.0, 3, fields=2)
    w.add((2, 1), clock())  # at 0
    clock.advance(2)
    w.add((1, 0), clock())  # at 2
    observed = []
    for _ in range(5):  # ticks 2..6
        observed.append((clock(), w.totals(clock()), w.buckets(clock()), len(w)))
        clock.advance()
    assert observed == [
        (2, (3, 1), [(2, 1), (1, 0)], 2),
        (3, (1, 0), [(1, 0)], 1),  # the bucket of 0 is 3 behind the bucket of 3: gone
        (4, (1, 0), [(1, 0)], 1),
        (5, (0, 0), [], 0),
        (6, (0, 0), [], 0),
    ]


def test_a_sample_counts_by_the_second_it_fell_in() -> None:
    """One-second resolution: with 60 buckets a sample at 40.9 counts at 99.99 and is gone at 100.0."""
    w = TimeWindow(1.0, 60, fields=1)
    w.add((1,), 40.9)
    assert w.totals(99.99) == (1,)
    assert w.totals(100.0) == (0,)


def test_samples_in_one_bucket_add_up_in_it() -> None:
    clock = FakeClock(0)
    w = TimeWindow(2.0, 2, fields=1)  # buckets [0, 2), [2, 4), ...
    for _tick in range(6):
        w.add((1,), clock())
        clock.advance()
    # Ticks 0..5 fell in buckets 0, 1, 2 (two each); at 5 the bucket of 0-1 is 2 behind.
    assert w.buckets(5.0) == [(2,), (2,)]
    assert w.totals(5.0) == (4,) and len(w) == 2
    assert w.newest_start_s() == 4.0


def test_the_time_window_never_holds_more_than_num_buckets() -> None:
    clock = FakeClock(0)
    w = TimeWindow(1.0, 4, fields=1)
    for tick in range(40):
        w.add((1,), clock())
        assert len(w) == min(tick + 1, 4) <= w.num_buckets
        assert w.totals(clock()) == (min(tick + 1, 4),)
        clock.advance()


def test_a_clock_that_steps_back_counts_into_the_newest_bucket() -> None:
    w = TimeWindow(1.0, 3, fields=1)
    w.add((1,), 10.0)
    w.add((1,), 11.0)
    w.add((5,), 9.5)  # stepped back
    assert w.buckets(11.0) == [(1,), (6,)]  # buckets stay in ascending order
    assert w.newest_start_s() == 11.0


def test_an_idle_time_window_empties_and_sums_to_exactly_zero() -> None:
    clock = FakeClock(0)
    w = TimeWindow(1.0, 3, fields=1)
    for v in (0.1, 0.2, 0.7):
        w.add((v,), clock())
        clock.advance()
    clock.advance(10)
    assert (w.totals(clock()), len(w)) == ((0,), 0)


def test_advance_forgets_without_adding() -> None:
    w = TimeWindow(1.0, 2, fields=1)
    w.add((1,), 0.0)
    w.add((1,), 1.0)
    w.advance(2.0)
    assert len(w) == 1
    w.advance(1.0)  # earlier than the last read: nothing comes back, nothing more goes
    assert len(w) == 1


def test_clear_empties_the_time_window() -> None:
    w = TimeWindow(1.0, 3, fields=2)
    w.add((1, 1), 0.0)
    w.clear()
    assert (len(w), w.totals(0.0), w.newest_start_s()) == (0, (0, 0), None)


@pytest.mark.parametrize(
    "kw",
    [
        {"bucket_s": 0, "num_buckets": 1, "fields": 1},
        {"bucket_s": 1.0, "num_buckets": 0, "fields": 1},
        {"bucket_s": 1.0, "num_buckets": 1, "fields": 0},
    ],
)
def test_the_time_window_checks_its_config(kw) -> None:
    with pytest.raises(ValueError):
        TimeWindow(**kw)
