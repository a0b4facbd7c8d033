"""ballast/policies/edge.py: the share of an admitted class the edge refuses, second by second."""

import pytest

from ballast.policies.edge import ALL, EdgeCeiling, EdgeThrottle, EdgeThrottleConfig


def test_nothing_is_dropped_while_the_gate_accepts_what_arrives():
    t = EdgeThrottle()
    for s in range(10):
        t.record(s + 0.5, "critical", 50, 50)
        assert t.drop_per_mille(s + 0.5, "critical") == 0


def test_the_drop_settles_where_k_times_the_accepts_get_through():
    """Arrivals 150/s, the model takes 50/s of the class: the edge should refuse what
    the gate would (2/3), less the K margin that keeps the gate's line full."""
    t = EdgeThrottle(EdgeThrottleConfig(window_s=10, k=1.1))
    drop = 0
    for s in range(30):
        through = round(150 * (1 - drop / ALL))  # what the edge lets reach the router
        accepts = min(50, through)
        t.record(s, "critical", 150, accepts)  # requests count the edge's refusals too
        drop = t.drop_per_mille(s, "critical")
    # (requests - K accepts) / (requests + 1) over the window's ten seconds: 632 per mille.
    assert drop == int((1500 - 1.1 * 500) / 1501 * ALL)
    assert 150 * (1 - drop / ALL) == pytest.approx(1.1 * 50, rel=0.02)


def test_the_window_forgets_and_a_recovered_model_gets_the_class_back():
    t = EdgeThrottle(EdgeThrottleConfig(window_s=10))
    for s in range(10):
        t.record(s, "sheddable_plus", 100, 10)
    assert t.drop_per_mille(9, "sheddable_plus") == int((1000 - 1.1 * 100) / 1001 * ALL)
    for s in range(10, 20):
        t.record(s, "sheddable_plus", 100, 100)
    assert t.drop_per_mille(19, "sheddable_plus") == 0  # ten seconds later nothing of the old window is left
    assert t.window(19, "sheddable_plus") == (1000, 1000)


def test_never_all_of_an_admitted_class_never_critical_plus_and_not_on_a_few_requests():
    t = EdgeThrottle(EdgeThrottleConfig(max_drop=0.95, min_requests=20))
    t.record(0, "sheddable", 1000, 0)  # the model takes none of it
    assert t.drop_per_mille(0, "sheddable") == 950  # some still reach the router, so accepts can grow back
    t.record(0, "critical_plus", 1000, 0)
    assert t.drop_per_mille(0, "critical_plus") == 0
    t.record(0, "critical", 19, 0)
    assert t.drop_per_mille(0, "critical") == 0
    t.forget("sheddable")
    assert t.drop_per_mille(0, "sheddable") == 0 and t.window(0, "sheddable") == (0, 0)
    t.record(0, "gold", 1000, 0)  # not a class: ignored (the windows stay four)
    assert t.window(0, "gold") == (0, 0)


def test_the_config_is_checked():
    with pytest.raises(ValueError, match="k"):
        EdgeThrottleConfig(k=0.9)
    with pytest.raises(ValueError, match="max_drop"):
        EdgeThrottleConfig(max_drop=1.0)


def test_a_class_the_model_can_take_again_is_let_through_within_a_second_or_two():
    """Closed loop, tick by tick (two records a second, as the router reports): arrivals
    100/s, the model takes 10/s, then 200/s. Once it takes more, the gate takes all that
    reaches it with room to spare, and the edge stops refusing the class at once."""
    t = EdgeThrottle(EdgeThrottleConfig(window_s=10, k=1.1, min_requests=20))
    drop, capacity = 0, 10.0
    refused_after: list[int] = []
    for tick in range(80):
        now = tick * 0.5
        if tick == 40:
            capacity = 200.0
        arrived = 50
        reached = round(arrived * (1 - drop / ALL))
        through = min(reached, round(capacity * 0.5))
        room = reached > 0 and through >= reached and capacity * 0.5 > reached
        t.record(now, "critical", arrived, through, room)
        drop = t.drop_per_mille(now, "critical")
        if tick == 39:
            assert drop > 800  # the model took a tenth: the edge refused most of the class
        if tick >= 40:
            refused_after.append(drop)
    assert max(refused_after) == 0, refused_after[:6]


def test_without_room_the_window_is_kept():
    t = EdgeThrottle(EdgeThrottleConfig(window_s=10, min_requests=20))
    for s in range(10):
        t.record(s, "critical", 100, 10)
    before = t.drop_per_mille(9, "critical")
    t.record(9.5, "critical", 100, 10, room=False)
    assert t.drop_per_mille(9.5, "critical") >= before > 0
    t.record(9.6, "critical", 5, 5, room=True)
    assert t.window(9.6, "critical") == (5, 5) and t.drop_per_mille(9.6, "critical") == 0


def test_a_class_the_model_took_whole_is_throttled_within_two_seconds_of_the_load_rising():
    """Tick by tick, closed loop: 33/s of sheddable_plus all taken (the gate full, so no
    room to forget the window), then 68/s of which the model takes 11/s. With the
    default window most of the excess is refused at the edge two seconds later; a 10 s
    window still remembers the accepted seconds and lets about half reach the router."""

    def drop_after_rise(cfg: EdgeThrottleConfig) -> int:
        t = EdgeThrottle(cfg)
        drop = 0
        for tick in range(40):
            now = tick * 0.5
            arrived, takes = (16, 16) if tick < 20 else (34, 5)
            reached = round(arrived * (1 - drop / ALL))
            t.record(now, "sheddable_plus", arrived, min(takes, reached))
            drop = t.drop_per_mille(now, "sheddable_plus")
            if tick == 23:  # a second and a half after the rise
                return drop
        raise AssertionError("unreachable")

    steady = int((68 - 1.1 * 11) / 69 * ALL)
    assert drop_after_rise(EdgeThrottleConfig()) >= 0.75 * steady
    assert drop_after_rise(EdgeThrottleConfig(window_s=10)) < 0.6 * steady


def test_the_ceiling_is_the_measured_capacity_per_replica_times_those_serving_now():
    ceiling = EdgeCeiling(1.5, memory_s=60.0)
    # Never measured full: no ceiling, whatever is answered.
    assert ceiling.observe(0.0, None, 30.0, 1) is None
    assert ceiling.observe(1.0, 40.0, 40.0, 1) == 60.0  # measured: 1.5 x 40
    # The gates are not full any more: the measurement holds.
    assert ceiling.observe(2.0, None, 5.0, 1) == 60.0
    # A lower measurement (a stall, a slow window) does not lower it within memory_s ...
    assert ceiling.observe(30.0, 20.0, 20.0, 1) == 60.0
    # ... a second replica serving doubles it at once ...
    assert ceiling.observe(31.0, None, 20.0, 2) == 120.0
    # ... and a model answering more than it was measured at moves it along.
    assert ceiling.observe(32.0, None, 100.0, 2) == 150.0
    # Past memory_s the next measurement replaces the peak, lower or not.
    assert ceiling.observe(61.5, None, 10.0, 2) == 120.0
    assert ceiling.observe(62.0, 60.0, 60.0, 2) == 90.0  # 30 a replica now
    # Kept across a redeploy; no ratio: no ceiling.
    assert EdgeCeiling(2.0, 60.0, kept=ceiling).observe(63.0, None, 0.0, 2) == 120.0
    assert EdgeCeiling(None, 60.0).observe(0.0, 40.0, 40.0, 1) is None
    # No serving replica reported: counted as one (a model measured once is not unbounded).
    assert ceiling.observe(64.0, None, 0.0, 0) == 45.0
