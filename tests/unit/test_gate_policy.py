"""ballast/policies/gate.py: the gate's rules on numbers and a fake clock, no event loop."""

import pytest

from ballast.policies import gate as rules
from ballast.policies.gate import CriticalReserve, DemandWindow, ServiceTime
from tests.unit.fakes import FakeClock

CRITICAL = 1  # Criticality.CRITICAL.rank: ranks 0 and 1 are critical, 2 and 3 sheddable


def test_service_time_starts_at_the_first_sample_then_moves_by_a_fifth():
    s = ServiceTime()
    assert (s.mean_s, s.p90_s, s.served) == (0.0, 0.0, 0)
    s.add(1.0)
    assert s.mean_s == 1.0 and s.p90_s == 1.0
    s.add(2.0)
    assert s.mean_s == pytest.approx(1.2) and s.p90_s == 2.0 and s.served == 2


def test_service_time_p90_is_over_the_last_samples_only():
    s = ServiceTime(max_samples=10)
    for v in [0.1] * 8 + [0.6] * 2:
        s.add(v)
    assert s.p90_s == 0.6
    assert s.needed_s(0, CRITICAL) == s.mean_s < 0.4  # critical: the mean
    assert s.needed_s(3, CRITICAL) == 0.6  # sheddable: the p90
    for _ in range(10):
        s.add(0.1)
    assert s.p90_s == 0.1  # the slow samples left the window


def test_reserved_slots_round_up_and_always_leave_one():
    assert rules.reserved_slots(8, 0.25) == 2
    assert rules.reserved_slots(8, 0.2) == 2  # 1.6 rounds up
    assert rules.reserved_slots(8, 0.0) == 0
    assert rules.reserved_slots(1, 0.9) == 0
    assert rules.reserved_slots(4, 0.99) == 3


def test_the_reserve_holds_for_reserve_hold_s_after_the_last_press_tick_by_tick():
    clock = FakeClock(0)
    r = CriticalReserve(reserve_ratio=0.25, reserve_hold_s=2, clock=clock)
    assert not r.active() and r.room(3, CRITICAL, 8) == 8
    r.note_arrival(3, CRITICAL, in_flight=7, limit=8, waiting_ahead=0)  # sheddable: never presses
    assert not r.active()
    r.note_arrival(1, CRITICAL, in_flight=5, limit=8, waiting_ahead=0)  # below the top quarter
    assert not r.active()
    r.note_arrival(1, CRITICAL, in_flight=6, limit=8, waiting_ahead=0)  # into the top quarter
    assert r.active() and r.room(3, CRITICAL, 8) == 6 and r.room(1, CRITICAL, 8) == 8
    clock.advance(1)
    assert r.active()
    r.note_arrival(0, CRITICAL, in_flight=0, limit=8, waiting_ahead=1)  # had to wait: presses again
    clock.advance(2)
    assert r.active()  # 2 s after the second press: still held
    clock.advance(1)
    assert not r.active() and r.room(3, CRITICAL, 8) == 8


def test_a_reserve_of_zero_is_never_active_and_bad_ones_are_refused():
    clock = FakeClock(0)
    r = CriticalReserve(0.0, 1, clock)
    r.note_arrival(0, CRITICAL, in_flight=8, limit=8, waiting_ahead=3)
    assert not r.active() and r.room(3, CRITICAL, 8) == 8
    for ratio, hold in ((-0.1, 1), (1.0, 1), (0.2, -1)):
        with pytest.raises(ValueError):
            CriticalReserve(ratio, hold, clock)


def test_drain_estimate():
    assert rules.drain_s(0, 0.2, 2) == 0.0  # nobody ahead
    assert rules.drain_s(6, 0.0, 2) == 0.0  # no service estimate yet
    assert rules.drain_s(6, 0.2, 2) == pytest.approx(0.7)  # 7 turns at 10 per second
    assert rules.drain_s(1, 1.0, 0) == 2.0  # no room counts as one slot


def test_wait_budget_leaves_the_service_time_and_is_capped():
    assert rules.wait_budget_s(10.0, 9.0, 0.5, 2.0) == 0.5
    assert rules.wait_budget_s(100.0, 9.0, 0.5, 2.0) == 2.0
    assert rules.wait_budget_s(9.4, 9.0, 0.5, 2.0) < 0


def test_line_decision_refusals_in_order():
    assert rules.line_decision(0.0, 0.0, 0, 8) == "no_time"
    assert rules.line_decision(-1.0, 5.0, 8, 8) == "no_time"  # no time beats every other reason
    assert rules.line_decision(0.6, 0.7, 8, 8) == "drain"
    assert rules.line_decision(1.0, 0.7, 8, 8) == rules.DISPLACE
    assert rules.line_decision(1.0, 0.7, 7, 8) == rules.WAIT
    assert set(rules.REFUSALS) >= {"no_time", "drain", "expired", "queue_full", "displaced"}


def test_displacement_takes_the_least_critical_youngest_and_never_an_equal():
    waiters = [(3, 1), (3, 2), (1, 3)]
    assert rules.displaced(waiters, 1) == (3, 2)
    assert rules.displaced(waiters, 3) is None
    assert rules.displaced([(1, 5), (2, 4)], 0) == (2, 4)
    assert rules.displaced([], 0) is None


def test_a_miss_cuts_the_limit_only_past_the_factor_times_the_p90():
    assert rules.miss_is_congestion(250.0, 1.5, served=10, service_p90_s=0.2) is False
    assert rules.miss_is_congestion(301.0, 1.5, served=10, service_p90_s=0.2) is True
    assert rules.miss_is_congestion(1.0, None, served=10, service_p90_s=0.2) is True  # no factor
    assert rules.miss_is_congestion(1.0, 1.5, served=0, service_p90_s=0.0) is True  # nothing answered yet


def test_the_demand_window_rates_offers_per_criticality_and_knows_when_the_gate_was_full():
    clock = FakeClock(0)
    w = DemandWindow(window_s=10, clock=clock, max_entries=100)
    empty = {"demand_rps": {}, "served_rps": 0.0, "gate_full": False}
    assert w.rates() == {**empty, "demand_sustained_rps": {}, "demand_recent_max_rps": {}}
    for i in range(10):  # ten 1-s reports: 4 critical and 10 sheddable offered, 5 answered each
        clock.advance(1)
        w.add({"critical": 4, "sheddable": 10}, served=5, saturated=i >= 3)
    r = w.rates()
    assert r["demand_rps"] == {"critical": 4.0, "sheddable": 10.0}
    assert r["served_rps"] == 5.0 and r["gate_full"] is True  # full in 7 of 10 s
    # Old reports leave the window; a gate full in too little of it gives no capacity figure.
    for _ in range(10):
        clock.advance(1)
        w.add({"critical": 2}, served=2, saturated=False)
    w.add({}, served=0, saturated=True)
    r = w.rates()
    assert r["demand_rps"] == {"critical": 2.0} and r["gate_full"] is False


def test_the_demand_window_is_bounded_and_checks_its_config():
    clock = FakeClock(0)
    w = DemandWindow(window_s=1000, clock=clock, max_entries=5)
    for _ in range(20):
        clock.advance(1)
        w.add({"critical": 1}, served=1, saturated=False)
    assert len(w) == 5
    for bad in ({"window_s": 0}, {"window_s": 1, "max_entries": 0}):
        with pytest.raises(ValueError):
            DemandWindow(clock=clock, **bad)


def test_the_last_two_reports_give_the_lower_and_the_higher_rate_per_class():
    clock = FakeClock(0)
    w = DemandWindow(window_s=5, clock=clock)
    clock.advance(0.5)
    w.add({"critical": 5, "sheddable": 10}, served=5, saturated=False)
    r = w.rates()
    assert r["demand_sustained_rps"] == {} and r["demand_recent_max_rps"] == {}  # one report: no pair yet
    clock.advance(0.5)
    w.add({"critical": 50}, served=5, saturated=False)  # a crowd of critical; sheddable stopped
    r = w.rates()
    assert r["demand_sustained_rps"] == {"critical": 10.0, "sheddable": 0.0}
    assert r["demand_recent_max_rps"] == {"critical": 100.0, "sheddable": 20.0}
    clock.advance(2.0)  # a long report interval (a stall): its rate is over its own span
    w.add({"critical": 100}, served=5, saturated=False)
    assert w.rates()["demand_sustained_rps"] == {"critical": 50.0}
    assert rules.last_two_rates([]) == ({}, {})


def test_a_span_without_answers_while_requests_are_held_is_a_stall_and_is_taken_out():
    s = rules.StallSpans(factor=3.0, min_s=0.5)
    s.busy(100.0)
    for t in (100.1, 100.2, 100.3):  # answers every 0.1 s: p90 0.1, nothing stalls
        s.answered(t, held=4, p90_s=0.1)
    s.answered(103.4, held=4, p90_s=0.1)  # 3.1 s without an answer while four were held
    assert s.stalled_s == pytest.approx(3.0)  # less the p90 the model had to answer in
    assert s.overlap_s(100.0, 104.0) == pytest.approx(3.0)
    assert s.not_stalled_s(100.2, 103.4) == pytest.approx(0.2)  # a request across it: 3.2 s, 0.2 of service
    assert s.not_stalled_s(103.4, 103.6) == pytest.approx(0.2)  # after it: untouched


def test_an_idle_model_a_steady_slow_one_and_an_unknown_p90_are_no_stall():
    s = rules.StallSpans(factor=3.0, min_s=0.5)
    s.busy(0.0)
    s.answered(0.1, held=1, p90_s=0.1)
    s.busy(10.0)  # nothing held from 0.1 to 10: idle, not stalled
    s.answered(10.1, held=1, p90_s=0.1)
    t = 10.1
    for _ in range(20):  # slower (0.3 s apart) but steady: under 3 x a p90 that follows it
        t += 0.3
        s.answered(t, held=4, p90_s=0.3)
    s.answered(t + 5.0, held=2, p90_s=0.0)  # no p90 known yet: not judged
    assert s.stalled_s == 0.0 and s.overlap_s(0.0, 100.0) == 0.0


def test_stall_spans_are_bounded():
    s = rules.StallSpans(max_spans=3)
    s.busy(0.0)
    for i in range(1, 11):
        s.answered(i * 10.0, held=1, p90_s=0.1)
    assert len(s) == 3 and s.stalled_s == pytest.approx(100.0 - 10 * 0.1)
    with pytest.raises(ValueError):
        rules.StallSpans(factor=0)
