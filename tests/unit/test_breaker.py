"""Circuit breaker, walked tick by tick on a fake clock (integer seconds)."""

from __future__ import annotations

import random

import pytest
from fakes import FakeClock

from ballast.policies.breaker import (
    BreakerConfig,
    BreakerEvent,
    BreakerState,
    CircuitBreaker,
    Permit,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


class FixedRandom(random.Random):
    """rng whose random() is fixed: u = 0.5 makes the jitter factor exactly 1."""

    def __init__(self, u: float) -> None:
        super().__init__(0)
        self.u = u

    def random(self) -> float:
        return self.u


def make(
    cfg: BreakerConfig | None = None,
    *,
    clock: FakeClock | None = None,
    rng: random.Random | None = None,
) -> tuple[CircuitBreaker, FakeClock, list[BreakerEvent]]:
    clock = clock or FakeClock()
    events: list[BreakerEvent] = []
    breaker = CircuitBreaker(
        "model-a",
        cfg or BreakerConfig(),
        clock=clock,
        rng=FixedRandom(0.5) if rng is None else rng,
        on_event=events.append,
    )
    return breaker, clock, events


def call(breaker: CircuitBreaker, success: bool, duration_s: float = 0.1) -> Permit:
    permit = breaker.allow()
    assert permit is not None, "breaker refused a call the test expected to pass"
    breaker.record(permit, success, duration_s)
    return permit


def trip(breaker: CircuitBreaker, n: int = 10) -> None:
    for _ in range(n):
        call(breaker, False)
    assert breaker.state is OPEN


SMALL = BreakerConfig(window_size=10, min_calls=4, open_duration_s=10, open_jitter_ratio=0.0, half_open_max_probes=5)


# ----------------------------------------------------------------- config


def test_state_values_are_the_gauge_values() -> None:
    assert [int(s) for s in (CLOSED, OPEN, HALF_OPEN)] == [0, 1, 2]


def test_defaults() -> None:
    cfg = BreakerConfig()
    assert (cfg.failure_rate_threshold, cfg.window_size, cfg.window_s, cfg.min_calls) == (0.5, 100, 60.0, 10)
    assert (cfg.open_duration_s, cfg.half_open_max_probes) == (30.0, 5)
    assert cfg.half_open_required_ok == 4  # ceil(0.8 × 5)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_kind", "sliding"),
        ("window_size", 0),
        ("window_size", 2.5),
        ("window_s", 0),
        ("window_s", float("inf")),
        ("min_calls", 0),
        ("min_calls", 101),  # > window_size for a count window: could never open
        ("failure_rate_threshold", 0.0),
        ("failure_rate_threshold", 1.5),
        ("slow_call_duration_s", -1),
        ("slow_call_rate_threshold", 0),
        ("slow_call_rate_threshold", 1.01),
        ("open_duration_s", 0),
        ("open_jitter_ratio", -0.1),
        ("open_jitter_ratio", 1.0),
        ("half_open_max_probes", 0),
        ("half_open_max_probes", True),
        ("half_open_success_threshold", 0),
        ("max_time_window_buckets", 0),
        ("half_open_max_wait_s", 0),
        ("half_open_max_wait_s", float("inf")),
        ("half_open_max_wait_s", None),
    ],
)
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        BreakerConfig(**{field: value})


def test_time_window_must_fit_the_bucket_bound() -> None:
    with pytest.raises(ValueError, match="window_s"):
        BreakerConfig(window_kind="time", window_s=601, max_time_window_buckets=600)
    BreakerConfig(window_kind="time", window_s=600, max_time_window_buckets=600)
    # Irrelevant to a count window.
    BreakerConfig(window_kind="count", window_s=601, max_time_window_buckets=600)


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="backend"):
        CircuitBreaker("", BreakerConfig())
    with pytest.raises(ValueError, match="cfg"):
        CircuitBreaker("b", {"window_size": 10})  # type: ignore[arg-type]


# ----------------------------------------------------------------- closed, count window


def test_count_window_opens_exactly_at_threshold_and_not_before_min_calls() -> None:
    breaker, clock, events = make(BreakerConfig(window_size=100, min_calls=10, failure_rate_threshold=0.5))
    # Nine failures in a row: 100 % failures, but below min_calls → no judgement.
    for i in range(9):
        call(breaker, False)
        assert breaker.state is CLOSED, f"opened after {i + 1} calls, below min_calls"
    assert events == []
    # The tenth call reaches min_calls with 10/10 failures → open.
    call(breaker, False)
    assert breaker.state is OPEN
    assert [(e.from_state, e.to_state, e.reason) for e in events] == [
        (CLOSED, OPEN, "failure_rate=1.00>=0.50 over 10 calls")
    ]


def test_count_window_threshold_is_inclusive_and_one_below_stays_closed() -> None:
    breaker, _, events = make(BreakerConfig(window_size=10, min_calls=10, failure_rate_threshold=0.5))
    for _ in range(6):
        call(breaker, True)
    for _ in range(4):
        call(breaker, False)
    assert breaker.state is CLOSED  # 4/10 < 0.5
    assert breaker.snapshot()["failure_rate"] == pytest.approx(0.4)
    # The window is full: the next failure pushes out the oldest success → 5/10.
    call(breaker, False)
    assert breaker.state is OPEN
    assert events[-1].reason == "failure_rate=0.50>=0.50 over 10 calls"


def test_threshold_product_rounding_does_not_need_an_extra_failure() -> None:
    # 0.55 × 100 = 55.00000000000001 in floats; 55 failures of 100 must open.
    breaker, _, _ = make(BreakerConfig(window_size=100, min_calls=100, failure_rate_threshold=0.55))
    for _ in range(45):
        call(breaker, True)
    for _ in range(54):
        call(breaker, False)
    assert breaker.state is CLOSED
    call(breaker, False)
    assert breaker.state is OPEN


def test_count_window_is_bounded_and_forgets_the_oldest() -> None:
    breaker, _, _ = make(BreakerConfig(window_size=10, min_calls=10))
    for _ in range(4):
        call(breaker, False)
    for _ in range(1000):
        call(breaker, True)
    snap = breaker.snapshot()
    assert snap["calls"] == 10
    assert snap["failures"] == 0  # the early failures were pushed out
    assert snap["window_entries"] == 10


# ----------------------------------------------------------------- closed, time window


def test_time_window_forgets_calls_at_bucket_boundaries() -> None:
    cfg = BreakerConfig(window_kind="time", window_s=10, min_calls=4, failure_rate_threshold=0.5)
    breaker, clock, _ = make(cfg)
    # t=0: 3 failures (below min_calls).
    for _ in range(3):
        call(breaker, False)
    assert breaker.snapshot()["calls"] == 3
    # t=9: still inside the 10 one-second buckets 0..9.
    clock.advance(9)
    assert breaker.snapshot()["calls"] == 3
    # t=10: bucket 0 leaves the window.
    clock.advance(1)
    assert breaker.snapshot()["calls"] == 0
    # Fresh calls: 3 successes at t=10, then failures at t=11 and t=12.
    for _ in range(3):
        call(breaker, True)
    clock.advance(1)
    call(breaker, False)  # 1/4 failures
    assert breaker.state is CLOSED
    clock.advance(1)
    call(breaker, False)  # 2/5 failures
    assert breaker.state is CLOSED
    # t=20: bucket 10 (the successes) is gone; t=11 and t=12 remain (2 calls).
    clock.advance(8)
    snap = breaker.snapshot()
    assert (snap["calls"], snap["failures"]) == (2, 2)
    call(breaker, True)  # 2/3 failures, but only 3 calls < min_calls
    assert breaker.state is CLOSED
    call(breaker, False)  # 3/4 failures at min_calls → open
    assert breaker.state is OPEN


def test_time_window_failures_spread_wider_than_the_window_never_open() -> None:
    # The same four failures spread over more than the window never open it.
    cfg = BreakerConfig(window_kind="time", window_s=3, min_calls=4)
    breaker, clock, _ = make(cfg)
    for _ in range(8):
        call(breaker, False)
        assert breaker.state is CLOSED
        clock.advance(1)  # only 3 buckets (3 calls) are ever in the window


def test_time_window_is_bounded() -> None:
    cfg = BreakerConfig(window_kind="time", window_s=5, min_calls=10, max_time_window_buckets=5)
    breaker, clock, _ = make(cfg)
    for _ in range(100):
        call(breaker, True)
        call(breaker, True)
        clock.advance(1)
        assert breaker.snapshot()["window_entries"] <= 5
    assert breaker.snapshot()["calls"] == 8  # 4 buckets (t=96..99) × 2; t=100 is empty


# ----------------------------------------------------------------- slow calls


def test_slow_calls_trip_the_slow_rate() -> None:
    cfg = BreakerConfig(window_size=10, min_calls=4, slow_call_duration_s=2.0, slow_call_rate_threshold=0.75)
    breaker, _, events = make(cfg)
    call(breaker, True, duration_s=2.0)  # exactly at the limit: not slow
    call(breaker, True, duration_s=2.5)
    call(breaker, True, duration_s=3.0)
    call(breaker, False, duration_s=1.0)  # a fast failure: failed, not slow
    snap = breaker.snapshot()
    assert (snap["calls"], snap["failures"], snap["slow_calls"]) == (4, 1, 2)
    assert breaker.state is CLOSED  # slow 2/4 < 0.75, failures 1/4 < 0.5
    call(breaker, True, duration_s=2.1)
    call(breaker, True, duration_s=2.1)  # slow 4/6 < 0.75
    assert breaker.state is CLOSED
    call(breaker, True, duration_s=9.0)  # slow 5/7 = 0.71
    assert breaker.state is CLOSED
    call(breaker, True, duration_s=9.0)  # slow 6/8 = 0.75 → open
    assert breaker.state is OPEN
    assert events[-1].reason == "slow_call_rate=0.75>=0.75 over 8 calls"


def test_slow_failures_count_as_slow_so_a_12s_backend_with_10pct_failures_opens() -> None:
    # Defaults: slow above 10 s, slow-rate threshold 1.0, judged from 10 calls.
    # The backend answers every call after 12 s and fails one in ten. Counting
    # only slow successes gave 9/10 slow and 1/10 failed: closed forever. Every
    # call is slow whatever its outcome, so the tenth call opens the breaker.
    breaker, clock, events = make(BreakerConfig())
    for i in range(1, 11):
        permit = breaker.allow()
        assert permit is not None, i
        clock.advance(12)
        breaker.record(permit, success=i % 10 != 0)  # the 10th fails, after 12 s too
        snap = breaker.snapshot()
        if i < 10:
            assert breaker.state is CLOSED, i
            assert (snap["calls"], snap["failures"], snap["slow_calls"]) == (i, 0, i), i
    assert breaker.state is OPEN
    assert events[-1].reason == "slow_call_rate=1.00>=1.00 over 10 calls"
    assert breaker.allow() is None


def test_a_slow_failure_counts_once_as_failed_and_once_as_slow_in_both_windows() -> None:
    for kind in ("count", "time"):
        cfg = BreakerConfig(window_kind=kind, window_size=10, window_s=10, min_calls=10, slow_call_duration_s=2.0)
        breaker, clock, _ = make(cfg)
        call(breaker, False, duration_s=3.0)  # slow and failed
        call(breaker, False, duration_s=1.0)  # failed only
        call(breaker, True, duration_s=3.0)  # slow only
        snap = breaker.snapshot()
        assert (snap["calls"], snap["failures"], snap["slow_calls"]) == (3, 2, 2), kind
        # Forgetting works on both counts (count window: pushed out; time window: aged out).
        if kind == "count":
            for _ in range(10):
                call(breaker, True, duration_s=0.1)
        else:
            clock.advance(10)
        snap = breaker.snapshot()
        assert (snap["failures"], snap["slow_calls"]) == (0, 0), kind


def test_slow_failed_probes_count_as_slow_in_half_open() -> None:
    # Five probes: four slow successes and one slow failure. 4/5 ok is enough to
    # close, but 5/5 are slow, which reaches the slow-rate threshold 1.0: reopen.
    cfg = BreakerConfig(
        window_size=10, min_calls=4, open_duration_s=10, open_jitter_ratio=0.0, slow_call_duration_s=1.0
    )
    breaker, _, events = open_then_half_open(cfg)
    probes = [breaker.allow() for _ in range(5)]
    for p in probes[:4]:
        breaker.record(p, True, duration_s=5.0)
    assert breaker.state is HALF_OPEN
    breaker.record(probes[4], False, duration_s=5.0)
    assert breaker.state is OPEN
    assert events[-1].reason == "half-open probes slow: slow_call_rate=1.00>=1.00"


def test_default_slow_rate_needs_every_call_slow() -> None:
    breaker, _, _ = make(BreakerConfig(window_size=10, min_calls=10))
    for _ in range(9):
        call(breaker, True, duration_s=11.0)
    call(breaker, True, duration_s=0.1)
    assert breaker.state is CLOSED  # 9/10 slow < 1.0
    call(breaker, True, duration_s=11.0)  # window: 9 slow of 10 (first slow pushed out)
    assert breaker.state is CLOSED
    for _ in range(9):
        call(breaker, True, duration_s=11.0)
    assert breaker.state is OPEN


def test_duration_defaults_to_clock_time_since_allow() -> None:
    cfg = BreakerConfig(window_size=4, min_calls=4, slow_call_duration_s=2.0, slow_call_rate_threshold=0.5)
    breaker, clock, events = make(cfg)
    permits = [breaker.allow() for _ in range(4)]
    clock.advance(3)
    for p in permits[:2]:
        breaker.record(p, True)  # no duration given: 3 s since allow() > 2 s → slow
    assert breaker.snapshot()["slow_calls"] == 2
    for p in permits[2:]:
        breaker.record(p, True, duration_s=0.5)
    assert breaker.state is OPEN
    assert events[-1].reason == "slow_call_rate=0.50>=0.50 over 4 calls"


# ----------------------------------------------------------------- open + jitter


def test_open_rejects_until_the_jittered_period_ends() -> None:
    cfg = BreakerConfig(window_size=10, min_calls=10, open_duration_s=30, open_jitter_ratio=0.1)
    breaker, clock, events = make(cfg, rng=random.Random(42))
    u = random.Random(42).random()
    expected_s = 30 * (1 + 0.1 * (2 * u - 1))
    assert 27 <= expected_s <= 33 and expected_s != 30
    clock.advance(100)
    trip(breaker)
    snap = breaker.snapshot()
    assert snap["opened_until_s"] == pytest.approx(100 + expected_s)
    assert snap["calls"] == 0  # window reset on opening
    last_closed_tick = 100 + int(expected_s)  # expected_s is not an integer
    while clock.now_s <= last_closed_tick:
        assert breaker.allow() is None, f"admitted at t={clock.now_s}"
        assert breaker.retry_after_s() == pytest.approx(100 + expected_s - clock.now_s)
        assert breaker.state is OPEN
        clock.advance(1)
    assert breaker.retry_after_s() == 0.0
    assert breaker.state is HALF_OPEN
    assert events[-1].from_state is OPEN and events[-1].to_state is HALF_OPEN
    assert events[-1].at_s == last_closed_tick + 1
    assert events[-1].reason == f"open period over ({expected_s:.1f}s)"


def test_retry_after_counts_down_each_tick() -> None:
    breaker, clock, _ = make(SMALL)  # open 10 s, no jitter
    trip(breaker, 4)
    seen = []
    for _ in range(12):
        seen.append(breaker.retry_after_s())
        clock.advance(1)
    assert seen == [10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0]


def test_jitter_bounds_are_the_configured_ratio() -> None:
    cfg = BreakerConfig(window_size=10, min_calls=10, open_duration_s=30, open_jitter_ratio=0.1)
    for u, expected in ((0.0, 27.0), (0.5, 30.0), (0.999999, 32.999994)):
        breaker, _, _ = make(cfg, rng=FixedRandom(u))
        trip(breaker)
        assert breaker.retry_after_s() == pytest.approx(expected)


def test_breakers_with_different_seeds_open_for_different_durations() -> None:
    cfg = BreakerConfig(window_size=10, min_calls=10, open_duration_s=30, open_jitter_ratio=0.1)
    durations = []
    for seed in (1, 2):
        breaker, _, _ = make(cfg, rng=random.Random(seed))
        trip(breaker)
        durations.append(breaker.retry_after_s())
    assert durations[0] != durations[1]
    assert all(27 <= d <= 33 for d in durations)
    assert durations == [pytest.approx(30 * (1 + 0.1 * (2 * random.Random(s).random() - 1))) for s in (1, 2)]


def test_default_rng_is_private_not_the_global_random() -> None:
    random.seed(123)
    before = random.random()
    random.seed(123)
    breaker = CircuitBreaker("b", BreakerConfig(window_size=10, min_calls=10), clock=FakeClock())
    trip(breaker)
    assert random.random() == before  # the breaker drew nothing from the global rng


# ----------------------------------------------------------------- half-open


def open_then_half_open(cfg: BreakerConfig = SMALL) -> tuple[CircuitBreaker, FakeClock, list[BreakerEvent]]:
    breaker, clock, events = make(cfg)
    trip(breaker, cfg.min_calls)
    clock.advance(int(cfg.open_duration_s))
    assert breaker.state is HALF_OPEN
    return breaker, clock, events


def test_half_open_admits_exactly_max_probes_in_total() -> None:
    breaker, clock, _ = open_then_half_open()
    probes = [breaker.allow() for _ in range(5)]
    assert all(p is not None and p.is_probe for p in probes)
    assert breaker.snapshot()["probes_in_flight"] == 5
    assert breaker.allow() is None  # a sixth is refused while five are out
    # Reporting successes does not free slots: 5 in total per half-open period.
    for p in probes[:3]:
        breaker.record(p, True)
    assert breaker.state is HALF_OPEN
    assert breaker.snapshot()["probes_in_flight"] == 2
    clock.advance(100)
    assert breaker.allow() is None


def test_half_open_closes_when_all_probes_succeed() -> None:
    breaker, clock, events = open_then_half_open()
    probes = [breaker.allow() for _ in range(5)]
    for i, p in enumerate(probes):
        assert breaker.state is HALF_OPEN, f"decided after {i} probes"
        breaker.record(p, True)
    assert breaker.state is CLOSED
    assert (events[-1].from_state, events[-1].to_state, events[-1].reason) == (
        HALF_OPEN,
        CLOSED,
        "half-open probes 5/5 ok",
    )
    snap = breaker.snapshot()
    assert snap["calls"] == 0 and snap["opened_until_s"] is None  # window starts empty
    assert breaker.allow() is not None


def test_half_open_tolerates_one_failure_of_five_at_080() -> None:
    breaker, _, events = open_then_half_open()
    probes = [breaker.allow() for _ in range(5)]
    breaker.record(probes[0], False)
    assert breaker.state is HALF_OPEN  # 4/5 = 0.8 is still reachable
    for p in probes[1:]:
        breaker.record(p, True)
    assert breaker.state is CLOSED
    assert events[-1].reason == "half-open probes 4/5 ok"


def test_half_open_reopens_as_soon_as_the_threshold_is_out_of_reach() -> None:
    breaker, clock, events = open_then_half_open()
    probes = [breaker.allow() for _ in range(5)]
    breaker.record(probes[0], True)
    breaker.record(probes[1], False)
    assert breaker.state is HALF_OPEN
    breaker.record(probes[2], False)  # 2 failed: at most 3/5 ok < 0.8 → reopen now
    assert breaker.state is OPEN
    assert (events[-1].from_state, events[-1].to_state, events[-1].reason) == (
        HALF_OPEN,
        OPEN,
        "probe failed: 2/5 failed, need 4/5 ok",
    )
    assert breaker.retry_after_s() == 10
    # The two probes still in flight are stale now: their outcomes change nothing.
    n_events = len(events)
    breaker.record(probes[3], True)
    breaker.record(probes[4], False)
    assert breaker.state is OPEN and len(events) == n_events
    # And the next half-open period starts with a full set of probes.
    clock.advance(10)
    assert breaker.state is HALF_OPEN
    assert sum(breaker.allow() is not None for _ in range(7)) == 5


def test_single_probe_breaker_reopens_on_the_first_failure() -> None:
    cfg = BreakerConfig(window_size=10, min_calls=4, open_duration_s=10, open_jitter_ratio=0.0, half_open_max_probes=1)
    breaker, _, events = open_then_half_open(cfg)
    p = breaker.allow()
    assert p is not None and breaker.allow() is None
    breaker.record(p, False)
    assert breaker.state is OPEN
    assert events[-1].reason == "probe failed: 1/1 failed, need 1/1 ok"


def test_half_open_reopens_when_every_probe_is_slow() -> None:
    cfg = BreakerConfig(
        window_size=10, min_calls=4, open_duration_s=10, open_jitter_ratio=0.0, slow_call_duration_s=1.0
    )
    breaker, _, events = open_then_half_open(cfg)
    probes = [breaker.allow() for _ in range(5)]
    for p in probes[:4]:
        breaker.record(p, True, duration_s=5.0)
    assert breaker.state is HALF_OPEN
    breaker.record(probes[4], True, duration_s=5.0)
    assert breaker.state is OPEN
    assert events[-1].reason == "half-open probes slow: slow_call_rate=1.00>=1.00"


WAIT = BreakerConfig(
    window_size=10,
    min_calls=4,
    open_duration_s=10,
    open_jitter_ratio=0.0,
    half_open_max_probes=5,
    half_open_max_wait_s=20,
)


def test_lost_probes_send_half_open_back_to_open_after_max_wait() -> None:
    breaker, clock, events = open_then_half_open(WAIT)  # half-open at t=10
    # Nobody calls for 5 s: nothing is wedged, the wait has not started.
    clock.advance(5)
    assert breaker.state is HALF_OPEN
    lost = [breaker.allow() for _ in range(5)]  # t=15: handed out, never reported
    assert all(p is not None for p in lost)
    for t in range(16, 35):
        clock.advance()
        assert breaker.allow() is None, t
        assert breaker.state is HALF_OPEN, t
    clock.advance()  # t=35: 20 s after the first probe
    assert breaker.state is OPEN
    assert events[-1].from_state is HALF_OPEN and events[-1].to_state is OPEN
    assert events[-1].reason.startswith("half-open undecided 20.0s after the first probe")
    assert breaker.retry_after_s() == 10
    for t in range(36, 45):
        clock.advance()
        assert breaker.allow() is None, t
    clock.advance()  # t=45: a fresh half-open with fresh probes
    fresh = [breaker.allow() for _ in range(5)]
    assert all(p is not None and p.is_probe for p in fresh)
    # A lost probe that answers after all is stale: it neither closes nor reopens.
    breaker.record(lost[0], False)  # type: ignore[arg-type]
    assert breaker.state is HALF_OPEN
    for p in fresh:
        breaker.record(p, True)  # type: ignore[arg-type]
    assert breaker.state is CLOSED


def test_half_open_wait_counts_from_the_first_probe_and_restarts_when_all_are_released() -> None:
    breaker, clock, _ = open_then_half_open(WAIT)  # t=10
    first = breaker.allow()  # t=10: the wait starts
    assert first is not None
    clock.advance(5)
    breaker.release(first)  # t=15: nothing outstanding, the period starts over
    clock.advance(10)
    assert breaker.state is HALF_OPEN  # t=25
    second = breaker.allow()  # t=25: the wait starts again
    assert second is not None
    clock.advance(19)
    assert breaker.state is HALF_OPEN  # t=44: 19 s < 20 s
    clock.advance()
    assert breaker.state is OPEN  # t=45


def test_half_open_decided_in_time_is_not_cut_by_the_wait() -> None:
    breaker, clock, events = open_then_half_open(WAIT)  # t=10
    probes = [breaker.allow() for _ in range(5)]
    clock.advance(19)
    for p in probes:
        breaker.record(p, True, duration_s=0.5)  # type: ignore[arg-type]
    assert breaker.state is CLOSED
    clock.advance(100)
    assert breaker.state is CLOSED
    assert [e.to_state for e in events] == [OPEN, HALF_OPEN, CLOSED]


def test_release_frees_a_probe_slot_without_counting() -> None:
    breaker, _, _ = open_then_half_open()
    probes = [breaker.allow() for _ in range(5)]
    assert breaker.allow() is None
    breaker.release(probes[0])  # e.g. the bulkhead refused it after allow()
    snap = breaker.snapshot()
    assert (snap["probes_admitted"], snap["probes_in_flight"], snap["probes_ok"], snap["probes_failed"]) == (
        4,
        4,
        0,
        0,
    )
    replacement = breaker.allow()
    assert replacement is not None and replacement.is_probe
    assert breaker.allow() is None
    breaker.release(probes[0])  # idempotent: frees nothing more
    assert breaker.allow() is None
    for p in [*probes[1:], replacement]:
        breaker.record(p, True)
    assert breaker.state is CLOSED


def test_release_after_record_and_record_after_release_are_ignored() -> None:
    breaker, _, _ = open_then_half_open()
    a, b = breaker.allow(), breaker.allow()
    breaker.record(a, True)
    breaker.release(a)  # already recorded: must not free a second slot
    breaker.release(b)
    breaker.record(b, False)  # already released: must not count a failure
    snap = breaker.snapshot()
    assert (snap["probes_admitted"], snap["probes_ok"], snap["probes_failed"]) == (1, 1, 0)
    assert a.done and b.done


def test_double_record_is_ignored() -> None:
    breaker, _, events = make(BreakerConfig(window_size=10, min_calls=2))
    p = breaker.allow()
    breaker.record(p, False)
    breaker.record(p, False)  # would make 2/2 failures and open if counted
    breaker.record(p, True)
    assert breaker.snapshot()["calls"] == 1
    assert breaker.state is CLOSED and events == []


def test_release_in_closed_state_counts_nothing() -> None:
    breaker, _, _ = make(BreakerConfig(window_size=10, min_calls=2))
    for _ in range(5):
        breaker.release(breaker.allow())
    assert breaker.snapshot()["calls"] == 0


def test_outcomes_from_before_opening_are_stale() -> None:
    breaker, _, events = make(BreakerConfig(window_size=10, min_calls=4, open_jitter_ratio=0.0))
    slow_permit = breaker.allow()  # admitted while CLOSED, finishes after the breaker opened
    trip(breaker, 4)
    breaker.record(slow_permit, False)
    assert breaker.snapshot()["calls"] == 0
    assert len(events) == 1


def test_foreign_permit_is_rejected() -> None:
    a, _, _ = make()
    b, _, _ = make()
    with pytest.raises(ValueError, match="permit"):
        b.record(a.allow(), True)
    with pytest.raises(ValueError, match="permit"):
        b.release(object())  # type: ignore[arg-type]


def test_bad_duration_is_rejected() -> None:
    breaker, _, _ = make()
    p = breaker.allow()
    with pytest.raises(ValueError, match="duration_s"):
        breaker.record(p, True, duration_s=-1)
    assert not p.done  # a rejected call did not consume the permit
    breaker.record(p, True, duration_s=0.0)
    assert p.done


# ----------------------------------------------------------------- events


def test_every_transition_emits_exactly_one_event() -> None:
    breaker, clock, events = make(SMALL)
    trip(breaker, 4)  # CLOSED → OPEN at t=0
    clock.advance(10)
    for _ in range(3):  # repeated reads of the lazy transition: still one event
        assert breaker.state is HALF_OPEN
    breaker.snapshot()
    breaker.retry_after_s()
    probes = [breaker.allow() for _ in range(5)]
    breaker.record(probes[0], False)
    breaker.record(probes[1], False)  # HALF_OPEN → OPEN at t=10
    clock.advance(10)
    first = breaker.allow()  # OPEN → HALF_OPEN lazily inside allow(), at t=20
    assert first is not None and first.is_probe
    rest = [breaker.allow() for _ in range(4)]
    clock.advance(1)
    for p in [first, *rest]:
        breaker.record(p, True)  # HALF_OPEN → CLOSED at t=21
    assert [(e.from_state, e.to_state, e.at_s) for e in events] == [
        (CLOSED, OPEN, 0),
        (OPEN, HALF_OPEN, 10),
        (HALF_OPEN, OPEN, 10),
        (OPEN, HALF_OPEN, 20),
        (HALF_OPEN, CLOSED, 21),
    ]
    assert [e.reason for e in events] == [
        "failure_rate=1.00>=0.50 over 4 calls",
        "open period over (10.0s)",
        "probe failed: 2/5 failed, need 4/5 ok",
        "open period over (10.0s)",
        "half-open probes 5/5 ok",
    ]
    assert all(e.backend == "model-a" for e in events)


def test_event_hook_sees_a_consistent_breaker() -> None:
    seen: list[tuple[BreakerState, dict]] = []
    clock = FakeClock()

    def hook(event: BreakerEvent) -> None:
        seen.append((event.to_state, breaker.snapshot()))

    breaker = CircuitBreaker("m", SMALL, clock=clock, rng=FixedRandom(0.5), on_event=hook)
    trip(breaker, 4)
    assert seen[0][0] is OPEN and seen[0][1]["state"] == "open" and seen[0][1]["retry_after_s"] == 10
    assert len(seen) == 1  # snapshot() inside the hook did not emit anything


def test_snapshot_fields() -> None:
    breaker, _, _ = make(BreakerConfig(window_size=10, min_calls=10))
    call(breaker, True)
    call(breaker, False)
    call(breaker, True, duration_s=20.0)
    snap = breaker.snapshot()
    assert snap == {
        "backend": "model-a",
        "state": "closed",
        "state_value": 0,
        "calls": 3,
        "failures": 1,
        "slow_calls": 1,
        "window_entries": 3,
        "failure_rate": pytest.approx(1 / 3),
        "slow_rate": pytest.approx(1 / 3),
        "opened_until_s": None,
        "retry_after_s": 0.0,
        "probes_admitted": 0,
        "probes_in_flight": 0,
        "probes_ok": 0,
        "probes_failed": 0,
    }
