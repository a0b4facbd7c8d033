"""Batch in the capacity interactive traffic leaves: rows tick by tick, full-jitter backoff,
and the spare tokens batch used."""

from __future__ import annotations

import random

import pytest
from fakes import FakeClock

from ballast.policies.retry import RetryConfig, backoff_s
from ballast.policies.spare import (
    REFERENCE_QUANTILE,
    RowsReference,
    SpareMeter,
    batch_rows,
    expected_arrivals,
    full_jitter_s,
    rows_alone,
    spare_tokens,
    step_cap,
)

ALMOST_ONE = 1.0 - 1e-12

# ----------------------------------------------------------------- rows


def test_rows_are_what_the_limit_leaves_beyond_interactive_and_the_reserve() -> None:
    # limit 20, 3 interactive in flight, 4/s x 1.5 s = 6 expected, reserve 2: room 9, 4 held
    assert batch_rows(0, 20, 3, 4.0, 1.5, 2, 4) == 5
    assert batch_rows(0, 20, 3, 4.0, 1.5, 2, 9) == 0
    assert batch_rows(0, 20, 3, 4.0, 1.5, 2, 15) == 0  # more held than the room: none more, never negative
    assert batch_rows(0, 20, 0, 0.0, 1.5, 0, 0) == 20  # an idle model: the whole limit
    assert batch_rows(0, 5, 9, 0.0, 1.0, 0, 0) == 0  # interactive past the limit already


def test_the_rows_cap_bounds_batch_beside_the_interactive_rows_in_flight() -> None:
    # room by the limit 9 (as above); by the cap 8 - 3 = 5; 4 held: 1 more
    assert batch_rows(0, 20, 3, 4.0, 1.5, 2, 4, rows_cap=8) == 1
    assert batch_rows(0, 20, 3, 4.0, 1.5, 2, 0, rows_cap=30) == 9  # the limit's room is the lower
    assert batch_rows(0, 20, 3, 0.0, 1.5, 0, 0, rows_cap=2) == 0  # interactive past the cap: none, never negative
    with pytest.raises(ValueError, match="^rows_cap:"):
        batch_rows(0, 20, 3, 0.0, 1.5, 0, 0, rows_cap=-1)


# a step of 4 ms + 1 ms a row: a / b = 4 rows
FIT = (0.004, 0.001)


def step_ms(rows: int) -> float:
    return 4.0 + 1.0 * rows


def test_the_step_cap_keeps_an_interactive_step_within_the_slack() -> None:
    # at the peak (interactive 6 >= the reference 4): 6 + 0.1 x (4 + 6) = 7 rows
    assert step_cap(FIT, 6, 4, 0.1, 64) == 7
    assert step_ms(7) <= 1.1 * step_ms(6) < step_ms(8)
    # in the valley (interactive 0): up to the step the reference's rows made, and its slack
    assert step_cap(FIT, 0, 4, 0.1, 64) == 4  # 4 + 0.8
    assert step_cap(FIT, 0, 6, 0.5, 64) == 11  # 6 + 0.5 x 10
    assert step_ms(11) <= 1.5 * step_ms(6) < step_ms(12)
    assert step_cap(FIT, 0, 0, 0.0, 64) == 1  # no slack: only the row of an interactive arrival
    assert step_cap(FIT, 0, 0, 0.1, 64) == 1  # 1 + 0.1 x 5: light traffic leaves batch one row
    assert step_cap(FIT, 0, 0, 0.2, 64) == 2  # 1 + 0.2 x 5
    assert step_cap(FIT, 30, 40, 1.0, 64) == 64  # never past the limit


def test_the_step_cap_on_a_slower_host_is_the_same_rows() -> None:
    assert step_cap((0.010, 0.0025), 6, 4, 0.1, 64) == step_cap(FIT, 6, 4, 0.1, 64)


def test_the_step_cap_without_a_fit_or_without_interactive_traffic() -> None:
    assert step_cap(None, 3, 5, 0.1, 64) == 4  # no fit yet: one batch row beside the interactive ones
    assert step_cap(None, 64, 5, 0.1, 64) == 64
    assert step_cap(FIT, 0, None, 0.1, 32) == 32  # no interactive row in the window: the limit
    assert step_cap((0.004, 0.0), 3, 5, 0.1, 32) == 32  # rows cost nothing: the limit
    assert step_cap((0.004, -0.001), 3, 5, 0.1, 32) == 32
    assert step_cap((-0.001, 0.001), 2, 2, 0.5, 32) == 3  # a negative base counts as 0: 2 + 0.5 x 2


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((FIT, -1, 4, 0.1, 8), "interactive_rows"),
        ((FIT, 1, -4, 0.1, 8), "reference_rows"),
        ((FIT, 1, 4, float("nan"), 8), "slack"),
        ((FIT, 1, 4, 0.1, 1.5), "limit"),
    ],
)
def test_the_step_cap_refuses_bad_inputs(args: tuple[object, ...], name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}:"):
        step_cap(*args)  # type: ignore[arg-type]


def test_rows_alone_is_littles_law_on_the_step_curve() -> None:
    # 20 answers/s of 25 tokens: 500 tokens/s; r = 500 x (0.004 + 0.001 r) -> r = 2 / 0.5 = 4
    assert rows_alone(20.0, 25.0, FIT, 64) == 4
    r = 4
    assert r == pytest.approx(20.0 * 25.0 * (0.004 + 0.001 * r))
    assert rows_alone(10.0, 25.0, FIT, 64) == 2  # 1 / 0.75 = 1.33, rounded up
    assert rows_alone(0.0, 25.0, FIT, 64) == 0  # no traffic: no rows
    assert rows_alone(40.0, 25.0, FIT, 64) == 64  # 1000 tokens/s x 1 ms a row >= 1: it cannot keep up
    assert rows_alone(38.0, 25.0, FIT, 64) == 64  # 950 x 0.004 / 0.05 = 76: past the limit
    assert rows_alone(20.0, 25.0, (0.008, 0.002), 64) == 64  # a host twice as slow: at its end
    assert rows_alone(10.0, 25.0, (0.008, 0.002), 64) == 4  # ... and half the rate: the same 4 rows
    with pytest.raises(ValueError, match="^rate_per_s:"):
        rows_alone(-1.0, 25.0, FIT, 64)


def test_the_reference_is_a_high_quantile_of_the_samples() -> None:
    clock = FakeClock()
    ref = RowsReference(86400.0, clock)
    assert ref.value() is None
    for _ in range(100):
        ref.sample(0)
    assert ref.value() is None  # no interactive row in the window: nothing to keep room for
    for i in range(100):  # a day: half the samples idle, the rest 1..5 rows, 8 in a few
        clock.advance(1)
        ref.sample(8 if i < 3 else 1 + i % 5)
    assert REFERENCE_QUANTILE == 0.95
    assert ref.value() == 5  # 195 of 200 samples at 5 or below; the few 8s are past the quantile
    for _ in range(20):
        ref.sample(8)
    assert ref.value() == 8


def test_the_reference_forgets_an_old_peak() -> None:
    clock = FakeClock()
    ref = RowsReference(60.0, clock)
    for _ in range(100):
        ref.sample(12)
    assert ref.value() == 12
    for _ in range(600):  # ten minutes at 2 rows: the peak, ten horizons old, weighs e^-10 of what it did
        clock.advance(1)
        ref.sample(2)
    assert ref.value() == 2
    for _ in range(2000):  # a quiet model: the interactive rows decay out of the window
        clock.advance(1)
        ref.sample(0)
    assert ref.value() is None


def test_the_reference_is_bounded() -> None:
    ref = RowsReference(60.0, FakeClock())
    ref.sample(10**9)
    assert ref.value() == 1024  # the last bin
    with pytest.raises(ValueError, match="^rows:"):
        ref.sample(-1)
    with pytest.raises(ValueError, match="^horizon_s:"):
        RowsReference(0.0, FakeClock())


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_any_level_above_0_stops_batch(level: int) -> None:
    assert batch_rows(level, 100, 0, 0.0, 1.0, 0, 0) == 0


def test_expected_arrivals_round_up_but_not_for_a_floats_last_bit() -> None:
    assert expected_arrivals(0.3, 1.5) == 1  # 0.45 of a request still needs a slot
    assert expected_arrivals(2.0, 1.5) == 3
    assert 1.1 * 100 > 110  # 110.00000000000001
    assert expected_arrivals(1.1, 100.0) == 110
    assert expected_arrivals(0.29, 100.0) == 29  # 28.999999999999996
    assert expected_arrivals(0.0, 5.0) == expected_arrivals(5.0, 0.0) == 0


def test_a_rising_interactive_rate_takes_batch_to_0_before_any_interactive_request_waits() -> None:
    """One tick is one second; a row holds its slot for two (service_s 2.0): rows started at
    tick t are in flight at t + 1 and gone by t + 2. At each tick the dispatcher decides with
    the rows in flight (those started at t - 1) and the rate now; then that tick's
    interactive arrivals take slots. Limit 20, reserve 2."""
    limit, reserve, service_s = 20, 2, 2.0
    rates = [2, 2, 4, 6, 8, 10, 11]
    started_interactive = started_batch = 0  # at the tick before
    decided, batch_slots, in_use = [], [], []
    for rate in rates:
        rows = batch_rows(0, limit, started_interactive, float(rate), service_s, reserve, started_batch)
        decided.append(rows)
        batch_slots.append(started_batch + rows)
        in_use.append(started_interactive + started_batch + rows + rate)  # the slots taken during this tick
        started_interactive, started_batch = rate, rows
    # t0: 20 - 0 - ceil(2 x 2) - 2 = 14; t1: 12 of room, 14 held; t2: 20 - 2 - 8 - 2 = 8; t3: 2 of
    # room, 8 held; t4 on: the expected arrivals alone fill the limit
    assert decided == [14, 0, 8, 0, 0, 0, 0]
    assert batch_slots == [14, 14, 8, 8, 0, 0, 0]
    assert in_use == [16, 18, 14, 18, 14, 18, 21]
    # interactive alone outgrows the limit at 11/s (tick 6); batch has held no slot since tick 4
    assert [t for t, used in enumerate(in_use) if used > limit] == [6]
    assert batch_slots[4:] == [0, 0, 0]


def test_a_level_rise_mid_run_stops_batch_at_once_and_it_resumes_at_0() -> None:
    levels = [0, 0, 1, 1, 0]
    held = 0
    decided = []
    for level in levels:
        rows = batch_rows(level, 10, 2, 1.0, 1.0, 1, held)
        decided.append(rows)
        held = rows  # one tick per service time: last tick's rows are what is held
    assert decided == [6, 0, 0, 0, 6]


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((-1, 10, 0, 0.0, 1.0, 0, 0), "level"),
        ((0, -1, 0, 0.0, 1.0, 0, 0), "limit"),
        ((0, 10, 1.5, 0.0, 1.0, 0, 0), "in_flight_interactive"),
        ((0, 10, 0, float("nan"), 1.0, 0, 0), "interactive_rate_per_s"),
        ((0, 10, 0, 0.0, -1.0, 0, 0), "service_s"),
        ((0, 10, 0, 0.0, 1.0, True, 0), "reserve_rows"),
        ((0, 10, 0, 0.0, 1.0, 0, -2), "held_batch"),
    ],
)
def test_bad_inputs_are_refused_naming_them(args: tuple[object, ...], name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}:"):
        batch_rows(*args)  # type: ignore[arg-type]


# ----------------------------------------------------------------- backoff


def test_full_jitter_bounds_double_per_attempt_up_to_the_cap() -> None:
    caps = [full_jitter_s(attempt, 1.0, 60.0, lambda: 1.0) for attempt in range(9)]
    assert caps == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert full_jitter_s(3, 1.0, 60.0, lambda: 0.0) == 0.0
    assert full_jitter_s(3, 1.0, 60.0, lambda: 0.25) == 2.0
    assert full_jitter_s(10_000, 1.0, 60.0, lambda: ALMOST_ONE) < 60.0  # a huge attempt does not overflow


def test_full_jitter_is_the_routers_backoff_with_the_batch_base_and_cap() -> None:
    a, b = random.Random(7), random.Random(7)
    cfg = RetryConfig(base_backoff_s=0.5, max_backoff_s=30.0)
    assert [full_jitter_s(n, 0.5, 30.0, a.random) for n in range(8)] == [
        backoff_s(n + 1, cfg, b.random) for n in range(8)
    ]


def test_full_jitter_spreads_a_herd() -> None:
    rng = random.Random(1)
    waits = [full_jitter_s(4, 1.0, 60.0, rng.random) for _ in range(1000)]
    assert all(0.0 <= w < 16.0 for w in waits)
    assert min(waits) < 1.0 and max(waits) > 15.0  # the whole window, not one moment


def test_full_jitter_refuses_bad_inputs() -> None:
    with pytest.raises(ValueError, match="^attempt:"):
        full_jitter_s(-1, 1.0, 60.0, lambda: 0.5)
    with pytest.raises(ValueError, match="max_backoff_s"):
        full_jitter_s(0, 2.0, 1.0, lambda: 0.5)  # a cap under the base
    with pytest.raises(ValueError, match="^rand:"):
        full_jitter_s(0, 1.0, 60.0, lambda: 1.5)


# ----------------------------------------------------------------- spare used


def test_spare_tokens_are_capacity_less_interactive_never_negative() -> None:
    assert spare_tokens(100.0, 2.0, 150) == 50.0
    assert spare_tokens(100.0, 2.0, 250) == 0.0  # interactive above the measured capacity leaves nothing
    assert spare_tokens(100.0, 0.0, 0) == 0.0


def test_the_meter_walks_interval_by_interval() -> None:
    clock = FakeClock(100)
    meter = SpareMeter(clock)
    assert meter.spare_used() is None  # no spare yet
    clock.advance(2)
    assert meter.record(100.0, 150, 40) == 50.0  # 200 could be served, 150 were interactive
    assert meter.spare_used() == 40 / 50
    clock.advance(1)
    assert meter.record(100.0, 120, 0) == 0.0  # a busy second: no spare, nothing of batch
    assert meter.spare_used() == 40 / 50
    clock.advance(3)
    assert meter.record(50.0, 0, 150) == 150.0  # the capacity measured lower now
    assert meter.spare_used() == 190 / 200
    clock.advance(1)
    assert meter.record(10.0, 0, 30) == 10.0  # batch beyond the measured capacity is not clipped
    assert meter.spare_used() == 220 / 210
    assert meter.snapshot() == {
        "intervals": 4,
        "spare_tokens": 210.0,
        "batch_tokens": 220,
        "interactive_tokens": 270,
        "spare_used": 220 / 210,
    }


def test_a_record_at_the_same_moment_adds_no_spare() -> None:
    clock = FakeClock()
    meter = SpareMeter(clock)
    assert meter.record(100.0, 0, 0) == 0.0
    assert meter.spare_used() is None


def test_the_meter_refuses_bad_counts() -> None:
    meter = SpareMeter(FakeClock())
    with pytest.raises(ValueError, match="^batch_tokens:"):
        meter.record(10.0, 0, -1)
    with pytest.raises(ValueError, match="^interactive_tokens:"):
        meter.record(10.0, 1.5, 0)  # type: ignore[arg-type]
