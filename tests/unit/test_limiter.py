"""The adaptive concurrency limit, window by window on an injected clock."""

import pytest

from ballast.policies.limiter import AimdLimit, LimiterConfig


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(**kw) -> tuple[AimdLimit, Clock]:
    clock = Clock()
    cfg = LimiterConfig(
        **{
            "initial": 10,
            "min_limit": 2,
            "max_limit": 12,
            "target_wait_ms": 100.0,
            "interval_s": 1.0,
            "decrease_factor": 0.8,
            **kw,
        }
    )
    return AimdLimit(cfg, clock), clock


def test_holds_within_a_window_and_decreases_when_p90_wait_is_over_target():
    lim, clock = make()
    for _ in range(9):
        lim.observe(50.0)
    lim.observe(500.0)  # one slow sample in ten: p90 is still 50... index 9 of 10 is the slow one
    assert lim.value == 10  # no verdict before the window ends
    clock.t = 1.0
    assert lim.value == 8  # p90 of 10 samples is the 10th: 500 > 100 -> x0.8
    assert lim.decreases == 1 and lim.decreases_by["wait"] == 1


def test_a_window_under_target_without_saturation_holds():
    lim, clock = make()
    for _ in range(20):
        lim.observe(10.0)
    clock.t = 1.0
    assert lim.value == 10
    assert (lim.increases, lim.decreases) == (0, 0)


def test_saturated_and_under_target_adds_one_up_to_max():
    lim, clock = make()
    for step in range(1, 5):
        lim.observe(10.0)
        lim.saturated()
        clock.t = float(step)
        _ = lim.value  # closes the window
    assert lim.value == 12  # 10 -> 11 -> 12, then held at max_limit
    assert lim.increases == 4  # counted even when held at max_limit


def test_decrease_floors_at_min_limit_and_overrides_saturation():
    lim, clock = make(initial=3)
    for step in range(1, 4):
        lim.observe(1000.0)
        lim.saturated()
        clock.t = float(step)
        _ = lim.value  # closes the window
    assert lim.value == 2


def test_idle_gap_is_one_window_not_many():
    lim, clock = make()
    lim.observe(1000.0)
    clock.t = 100.0  # a long silence: one decrease for the one slow sample, then nothing
    assert lim.value == 8
    clock.t = 101.0
    assert lim.value == 8


def test_samples_per_window_are_bounded():
    from ballast.policies.limiter import MAX_SAMPLES

    lim, _ = make()
    for _ in range(MAX_SAMPLES + 500):
        lim.observe(1.0)
    assert lim.snapshot()["window_samples"] == MAX_SAMPLES


@pytest.mark.parametrize(
    "kw",
    [
        {"initial": 1, "min_limit": 2},
        {"initial": 20},
        {"decrease_factor": 1.0},
        {"target_wait_ms": 0.0},
        {"interval_s": 0.0},
        {"target_service_ratio": 0.0},
        {"target_service_ratio": 1.5},
    ],
)
def test_bad_configs_are_refused(kw):
    with pytest.raises(ValueError):
        make(**kw)


@pytest.mark.parametrize(
    "field,value",
    [
        ("min_limit", True),  # a bool is not a count
        ("initial", 4.5),
        ("target_wait_ms", float("nan")),
        ("interval_s", float("inf")),
        ("decrease_factor", 0.0),
    ],
)
def test_a_bad_field_is_named_in_the_error(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        LimiterConfig(**{field: value})


def test_a_ceiling_caps_the_value_and_stops_growth_past_it():
    lim, clock = make(initial=10, max_limit=100)
    lim.set_ceiling(6)
    assert lim.value == 6  # capped at once
    for w in range(1, 5):  # saturated, fast windows: the AIMD value stays at the ceiling's level
        lim.saturated()
        clock.t = float(w)
        assert lim.value == 6
    lim.set_ceiling(8)
    for w in (5, 6):
        lim.saturated()
        clock.t = float(w)
        assert lim.value == 8
    lim.set_ceiling(None)
    assert lim.value == 10  # the AIMD value did not grow while at or above the ceiling
    lim.set_ceiling(0)
    assert lim.value == 1  # never zero: a caller must be able to reach the model


def test_the_ceiling_grows_only_below_it():
    lim, clock = make(initial=4, max_limit=100)
    lim.set_ceiling(6)
    for w in range(1, 6):
        lim.saturated()
        clock.t = float(w)
    assert lim.value == 6 and lim.increases == 2  # 4 -> 5 -> 6, then held


def test_a_deadline_missed_at_the_model_decreases_like_a_long_wait():
    lim, clock = make()
    for _ in range(20):
        lim.observe(10.0)  # waits well under target ...
        lim.saturated()
    lim.missed()  # ... but one admitted request ran out of time at the model
    clock.t = 1.0
    assert lim.value == 8 and lim.decreases == 1
    assert lim.snapshot()["decreases_by"] == {"missed": 1, "slow": 0, "wait": 0}
    lim.saturated()  # the next window has no miss: additive increase again
    clock.t = 2.0
    assert lim.value == 9


def test_service_near_the_requests_budgets_decreases_before_deadlines_are_missed():
    lim, clock = make(target_service_ratio=0.6)
    for _ in range(10):
        lim.saturated()
        lim.observe(10.0)
        lim.observe_service(0.4)  # answered in 40 % of their budgets: room to grow
    clock.t = 1.0
    assert lim.value == 11
    for _ in range(10):
        lim.saturated()
        lim.observe_service(0.75)  # the batch is slowing toward the deadlines
    clock.t = 2.0
    assert lim.value == 8 and lim.decreases == 1
    assert lim.decreases_by == {"missed": 0, "slow": 1, "wait": 0}
    off, clock2 = make(target_service_ratio=None)
    off.saturated()
    off.observe_service(0.99)
    clock2.t = 1.0
    assert off.value == 11  # disabled: service ratios are ignored


def window(lim, clock, t: float, ratio: float, per_token_s: float, n: int = 10, saturated: bool = True) -> int:
    """One window of ``n`` answers, each ``ratio`` of its budget and ``per_token_s`` a token;
    the limit after it closes at ``t``."""
    for _ in range(n):
        if saturated:
            lim.saturated()
        lim.observe(10.0)
        lim.observe_service(ratio, per_token_s)
    clock.t = t
    return lim.value


def test_a_slow_cut_that_does_not_speed_service_up_is_undone_and_the_slow_rule_rests():
    """An engine whose step time is the host's: fewer rows, the same time per token."""
    lim, clock = make(target_service_ratio=0.4)
    assert window(lim, clock, 1.0, 0.6, 0.020) == 8  # slow: cut from 10 on trial
    assert window(lim, clock, 2.0, 0.6, 0.020) == 8  # still mostly requests begun before the cut: no verdict
    assert window(lim, clock, 3.0, 0.6, 0.0175) == 10  # the verdict: 12.5 % faster, not 16 %: undone
    assert (lim.undone, lim.decreases_by["slow"]) == (1, 1)
    for t in range(4, 10):  # the slow rule rests while service per token is where the cut did not help
        assert window(lim, clock, float(t), 0.6, 0.021) == min(12, 10 + t - 3)
    assert lim.decreases == 1
    # Service 25 % slower than then: something changed, the slow rule cuts again (on trial).
    assert window(lim, clock, 10.0, 0.6, 0.026) == 9
    assert lim.decreases_by["slow"] == 2


def test_a_slow_cut_that_speeds_service_up_stands():
    """Past a batch's knee: 20 % fewer rows, each token 17 % sooner (>= 0.8 of 20 %)."""
    lim, clock = make(target_service_ratio=0.4)
    assert window(lim, clock, 1.0, 0.6, 0.020) == 8
    assert window(lim, clock, 2.0, 0.3, 0.018, saturated=False) == 8
    assert window(lim, clock, 3.0, 0.3, 0.0166, saturated=False) == 8  # 17 % faster: the cut stands
    assert lim.undone == 0
    # ... and the slow rule works on: slow again, cut again.
    assert window(lim, clock, 4.0, 0.6, 0.017) == 6


def test_a_burst_of_long_prompts_does_not_collapse_the_limit():
    """Long prefills make every answer slow whatever the rows: one trial cut, undone; the
    burst then meets a resting slow rule, and the limit stays where it was."""
    lim, clock = make(target_service_ratio=0.4)
    for t in range(1, 4):
        lim.saturated()
        window(lim, clock, float(t), 0.3, 0.010)
    assert lim.value == 12
    values = [window(lim, clock, float(t), 0.9, 0.030) for t in range(4, 20)]  # the burst
    assert min(values) >= 9 and values[-1] == 12
    assert lim.decreases_by["slow"] == 1 and lim.undone == 1


def test_without_the_trial_every_slow_cut_stands():
    lim, clock = make(target_service_ratio=0.4, slow_cut_min_gain=None)
    values = [window(lim, clock, float(t), 0.9, 0.030) for t in range(1, 6)]
    assert values == [8, 6, 4, 3, 2]


def curve_window(lim, clock, t: float, rows: int, a: float, b: float, held_s: float = 1.0) -> int:
    """One window (1 s) with ``rows`` requests at the model for ``held_s`` of it (none for the
    rest) and ten answers, each ``a + b x rows`` a token, every request held back (saturated);
    the limit after it closes at ``t``."""
    lim.rows_in_flight(rows)
    for _ in range(10):
        lim.saturated()
        lim.observe_service(0.9, a + b * rows)  # far past any slow threshold: the slow rule is off
    if held_s < 1.0:
        clock.t = t - 1.0 + held_s
        lim.rows_in_flight(0)
    clock.t = t
    value = lim.value
    lim.rows_in_flight(0)  # the next window starts empty
    return value


def curve_limit(**kw):
    return make(max_limit=64, initial=8, target_service_ratio=None, rows_curve_gain=0.8, **kw)


def test_the_rows_curve_caps_the_limit_at_the_knee_of_the_answers_service_per_token():
    """Service per token 4 ms + 1 ms a row: throughput reaches 0.8 of its asymptote at
    0.8 / 0.2 x 4 = 16 rows. The limit climbs while held back, then stops at the knee."""
    lim, clock = curve_limit()
    seen = [curve_window(lim, clock, float(t), 2 + t % 12, 0.004, 0.001) for t in range(1, 60)]
    assert lim.snapshot()["rows_curve"] == {"step_base_ms": 4.0, "step_per_row_ms": 1.0, "rows": 16}
    assert seen[:19] == list(range(9, 28))  # no cap before CURVE_MIN_WINDOWS (20) windows: one a window
    assert set(seen[20:]) == {16}


def test_the_rows_curve_knee_is_the_same_on_a_slower_host():
    knees = []
    for slower in (1.0, 2.5):
        lim, clock = curve_limit()
        for t in range(1, 40):
            curve_window(lim, clock, float(t), 2 + t % 12, 0.004 * slower, 0.001 * slower)
        knees.append(lim.snapshot()["rows_curve"]["rows"])
    assert knees == [16, 16]


def test_the_mean_rows_of_a_window_are_weighed_by_time():
    """Rows held for half of each window count as half as many."""
    lim, clock = curve_limit()
    for t in range(1, 40):
        curve_window(lim, clock, float(t), 2 * (2 + t % 12), 0.004, 0.001 / 2, held_s=0.5)
    assert lim.snapshot()["rows_curve"] == {"step_base_ms": 4.0, "step_per_row_ms": 1.0, "rows": 16}


def test_rows_that_cost_nothing_leave_the_limit_uncapped_and_a_steep_curve_stops_at_the_floor():
    free, clock = curve_limit()
    seen = [curve_window(free, clock, float(t), 2 + t % 12, 0.010, 0.0) for t in range(1, 60)]
    assert free.snapshot()["rows_curve"]["rows"] is None and seen[-1] == 64
    steep, clock = curve_limit()
    seen = [curve_window(steep, clock, float(t), 2 + t % 12, 0.0, 0.002) for t in range(1, 40)]
    assert seen[-1] == 2  # min_limit: a curve never closes the gate


def test_the_rows_curve_caps_nothing_unless_asked_but_is_fitted_for_batch_and_its_gain_is_checked():
    lim, clock = make(max_limit=64, target_service_ratio=None)
    assert lim.curve_fit() is None
    seen = [curve_window(lim, clock, float(t), 2 + t % 12, 0.004, 0.001) for t in range(1, 40)]
    assert lim.snapshot()["rows_curve"] == {"step_base_ms": 4.0, "step_per_row_ms": 1.0, "rows": None}
    assert seen[-1] == 10 + 39 and lim.curve_fit() == pytest.approx((0.004, 0.001))  # no knee: one up a window
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="rows_curve_gain"):
            make(rows_curve_gain=bad)


def test_a_self_scheduling_engine_takes_the_rows_curve_and_not_the_slow_rule():
    from ballast.config import GateSettings

    g = GateSettings()
    assert (g.limiter_config("vllm").target_service_ratio, g.limiter_config("vllm").rows_curve_gain) == (None, 0.85)
    assert (g.limiter_config("builtin").target_service_ratio, g.limiter_config("builtin").rows_curve_gain) == (
        0.4,
        None,
    )
    assert g.limiter_config("transformers").rows_curve_gain is None
    old = GateSettings(rows_curve_gain=None)
    assert (old.limiter_config("vllm").target_service_ratio, old.limiter_config("vllm").rows_curve_gain) == (0.4, None)


def test_batch_answers_are_points_of_the_curve_but_no_verdict_of_the_slow_rule():
    """A batch line's service per token (``observe_tokens``) fits the curve; it never cuts the
    limit, where the same answers judged by the slow rule (0.9 of their budget) would."""
    lim, clock = make(max_limit=64, initial=10)
    for t in range(1, 40):
        lim.rows_in_flight(2 + t % 12)
        for _ in range(10):
            lim.observe_tokens(0.004 + 0.001 * (2 + t % 12))
        clock.t = float(t)
        lim.rows_in_flight(0)
    assert lim.value == 10 and lim.decreases == 0
    assert lim.curve_fit() == pytest.approx((0.004, 0.001))


def test_a_fit_stands_while_rows_stop_varying():
    """Rows held at one value for longer than the curve remembers give no new fit (no
    spread): the last one stands rather than none."""
    lim, clock = make(max_limit=64, target_service_ratio=None)
    for t in range(1, 40):
        curve_window(lim, clock, float(t), 2 + t % 12, 0.004, 0.001)
    for t in range(40, 40 + 2000):
        curve_window(lim, clock, float(t), 6, 0.004, 0.001)
    assert lim.snapshot()["rows_curve"]["step_base_ms"] is None  # the curve itself has no fit now
    assert lim.curve_fit() == pytest.approx((0.004, 0.001))
