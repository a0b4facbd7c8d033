"""Autoscale policy (stable/panic windows), walked tick by tick with integer ``t_s``.

``current`` is fed back from the previous decision, as if Serve applied each
target at once, unless a test says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ballast.policies.autoscale import (
    AutoscaleConfig,
    AutoscaleDecision,
    AutoscaleSample,
    AutoscaleState,
    decide,
    queue_length_fallback,
)

# Concurrency only, windows as the defaults.
CFG = AutoscaleConfig(min_replicas=1, max_replicas=20, target_gpu_util_pct=None)
# One-second windows: each tick's desired is that tick's load alone, which makes
# scale-down streaks easy to read. Panic needs 2x current, as by default.
INSTANT = AutoscaleConfig(
    min_replicas=1,
    max_replicas=20,
    target_gpu_util_pct=None,
    stable_window_s=1.0,
    panic_window_s=1.0,
    scale_down_delay_s=30.0,
)


def tick(
    t: int,
    ongoing: float,
    current: int,
    state: AutoscaleState,
    cfg: AutoscaleConfig,
    util: float | None = None,
) -> tuple[AutoscaleDecision, AutoscaleState]:
    return decide(AutoscaleSample(t_s=t, ongoing_requests=ongoing, gpu_util_pct=util), current, state, cfg)


def walk(
    cfg: AutoscaleConfig,
    load: Callable[[int], float],
    ticks: range,
    current: int,
    state: AutoscaleState | None = None,
) -> tuple[list[AutoscaleDecision], AutoscaleState]:
    state = state or AutoscaleState()
    out = []
    for t in ticks:
        d, state = tick(t, load(t), current, state, cfg)
        current = d.desired_replicas
        out.append(d)
    return out, state


# ----------------------------------------------------------------- steady state


def test_steady_load_holds_in_stable_mode() -> None:
    decisions, state = walk(CFG, lambda t: 16.0, range(0, 100), current=2)
    assert all(d.desired_replicas == 2 and d.mode == "stable" for d in decisions)
    assert all(d.stable_desired == 2 and d.panic_desired == 2 for d in decisions)
    assert state.below_since_s is None and state.panic_until_s is None
    assert state.last_desired == 2


def test_scale_up_at_once_in_stable_mode() -> None:
    # 24 ongoing with 2 replicas: 3 wanted; 3 < 2 * 2 so no panic, still immediate.
    d, state = tick(0, 24.0, 2, AutoscaleState(), INSTANT)
    assert (d.desired_replicas, d.mode) == (3, "stable")
    # Float noise in the average must not add a replica.
    d, _ = tick(0, 24.000000000000004, 2, AutoscaleState(), INSTANT)
    assert d.desired_replicas == 3


def test_panic_threshold_boundary() -> None:
    # current 2, ratio 2: panic when the panic window wants >= 4.
    d, state = tick(0, 24.0, 2, AutoscaleState(), INSTANT)
    assert d.mode == "stable" and state.panic_until_s is None
    d, state = tick(0, 25.0, 2, AutoscaleState(), INSTANT)  # ceil(25 / 8) = 4
    assert (d.mode, d.desired_replicas, d.panic_desired) == ("panic", 4, 4)
    assert state.panic_until_s == 0 + INSTANT.stable_window_s


# ----------------------------------------------------------------- burst and panic


def test_burst_enters_panic_and_scales_up_within_one_tick() -> None:
    decisions, state = walk(CFG, lambda t: 8.0, range(0, 60), current=1)
    assert all(d.desired_replicas == 1 and d.mode == "stable" for d in decisions)
    # Burst at t=60. Panic window (54, 60] = five 8s and one 200: avg 40 -> 5.
    # Stable window (0, 60] = fifty-nine 8s and one 200: avg 11.2 -> 2.
    d, state = tick(60, 200.0, 1, state, CFG)
    assert (d.mode, d.panic_desired, d.stable_desired, d.desired_replicas) == ("panic", 5, 2, 5)
    assert state.panic_until_s == 120


def test_no_scale_down_during_panic_then_one_step_per_delay() -> None:
    def load(t: int) -> float:
        if t < 60:
            return 8.0
        if t < 66:
            return 200.0  # six seconds of burst
        return 0.0

    decisions, state = walk(CFG, load, range(0, 300), current=1)
    by_t = dict(zip(range(0, 300), decisions, strict=True))

    # Panic from the burst tick; the panic window fills up within the burst.
    assert by_t[60].mode == "panic" and by_t[60].desired_replicas == 5
    peak = by_t[65].desired_replicas
    assert peak == 20  # ceil(200 / 8) = 25, clamped to max_replicas
    # Last trigger: the last tick whose panic window wanted >= 2x current.
    triggers = [
        t for t in range(60, 300)
        if by_t[t].panic_desired >= 2 * (by_t[t - 1].desired_replicas)
    ]  # fmt: skip
    last_trigger = max(triggers)
    panic_end = last_trigger + 60
    # While in panic the target never goes down, even though load is 0 from t=66.
    previous = 1
    for t in range(60, panic_end):
        assert by_t[t].mode == "panic", t
        assert by_t[t].desired_replicas >= previous, t
        previous = by_t[t].desired_replicas
    assert by_t[panic_end - 1].desired_replicas == peak
    # Panic is over exactly one stable window after the last trigger; the stable
    # window then wants 3 at most (the burst is 5 of its 60 samples), so a
    # scale-down streak starts right there and removes one replica per 30 s.
    assert by_t[panic_end].mode == "stable"
    expected = peak
    for t in range(panic_end, 300):
        held = t - panic_end
        if held > 0 and held % 30 == 0:
            expected = max(expected - 1, 1)
        assert by_t[t].desired_replicas == expected, t
    assert state.panic_until_s is None


def test_panic_never_drops_below_its_own_last_answer_when_current_lags() -> None:
    # Serve keeps reporting 1 replica (the others are still loading) while the
    # burst fades. Triggers at t=0..7 (t=7's panic window still holds t=2's 200),
    # so panic lasts until t=67; the target must stay at 20 throughout.
    state = AutoscaleState()
    for t in range(0, 67):
        d, state = tick(t, 200.0 if t <= 2 else 0.0, 1, state, CFG)
        assert (d.mode, d.desired_replicas) == ("panic", 20), t
    assert state.panic_until_s == 67
    d, state = tick(67, 0.0, 1, state, CFG)
    assert (d.mode, d.desired_replicas) == ("stable", 1)


def test_panic_is_extended_by_each_new_trigger() -> None:
    state = AutoscaleState()
    d, state = tick(0, 40.0, 1, state, INSTANT)  # 5 >= 2: trigger
    assert state.panic_until_s == 1.0
    d, state = tick(1, 200.0, 5, state, INSTANT)  # 25 >= 10: trigger again
    assert (d.mode, state.panic_until_s) == ("panic", 2.0)
    d, state = tick(2, 0.0, 20, state, INSTANT)  # no trigger, panic over at t=2
    assert (d.mode, state.panic_until_s) == ("stable", None)
    assert d.desired_replicas == 20  # the down-streak only starts now
    assert state.below_since_s == 2


# ----------------------------------------------------------------- slow scale-down


def test_scale_down_one_step_per_delay_with_exact_boundaries() -> None:
    decisions, state = walk(INSTANT, lambda t: 8.0, range(0, 200), current=4)
    got = [d.desired_replicas for d in decisions]
    # Streak starts at t=0; steps at t=30, 60, 90; floor reached (want = 1).
    assert got[:30] == [4] * 30
    assert got[30:60] == [3] * 30
    assert got[60:90] == [2] * 30
    assert got[90:] == [1] * 110
    assert state.below_since_s is None


def test_interrupted_scale_down_streak_restarts_the_delay() -> None:
    def load(t: int) -> float:
        return 32.0 if t == 20 else 8.0  # one tick back at current (4 replicas)

    decisions, state = walk(INSTANT, load, range(0, 60), current=4)
    got = [d.desired_replicas for d in decisions]
    assert got[:51] == [4] * 51  # no step at t=30, where the old streak would end
    assert got[51:] == [3] * 9  # new streak from t=21, step at t=51


def test_a_desired_still_below_current_does_not_interrupt() -> None:
    def load(t: int) -> float:
        return 16.0 if t % 2 else 8.0  # wants 2 or 1, always below 4

    decisions, _ = walk(INSTANT, load, range(0, 31), current=4)
    assert [d.desired_replicas for d in decisions] == [4] * 30 + [3]


def test_max_scale_down_step() -> None:
    cfg = AutoscaleConfig(
        min_replicas=1, max_replicas=20, target_gpu_util_pct=None,
        stable_window_s=1.0, panic_window_s=1.0, scale_down_delay_s=10.0, max_scale_down_step=2,
    )  # fmt: skip
    decisions, _ = walk(cfg, lambda t: 0.0, range(0, 40), current=6)
    got = [d.desired_replicas for d in decisions]
    assert got[:10] == [6] * 10
    assert got[10:20] == [4] * 10
    assert got[20:30] == [2] * 10
    assert got[30:] == [1] * 10  # bounded by min, not by the step


def test_zero_delay_scales_down_on_the_first_tick() -> None:
    cfg = AutoscaleConfig(target_gpu_util_pct=None, stable_window_s=1.0, panic_window_s=1.0, scale_down_delay_s=0.0)
    d, _ = tick(0, 0.0, 3, AutoscaleState(), cfg)
    assert d.desired_replicas == 2


# ----------------------------------------------------------------- bounds


def test_min_and_max_bounds() -> None:
    # Huge load: max, in panic or not.
    d, _ = tick(0, 10_000.0, 1, AutoscaleState(), INSTANT)
    assert d.desired_replicas == 20
    d, _ = tick(0, 10_000.0, 19, AutoscaleState(), INSTANT)
    assert (d.desired_replicas, d.stable_desired) == (20, 1250)
    # No load forever: never below min.
    decisions, _ = walk(INSTANT, lambda t: 0.0, range(0, 300), current=3)
    assert min(d.desired_replicas for d in decisions) == 1
    assert decisions[-1].desired_replicas == 1
    # Current outside [min, max] (config changed under us): clamped at once.
    d, _ = tick(0, 0.0, 25, AutoscaleState(), INSTANT)
    assert d.desired_replicas == 20
    cfg = AutoscaleConfig(min_replicas=2, max_replicas=4, target_gpu_util_pct=None)
    d, _ = tick(0, 0.0, 0, AutoscaleState(), cfg)
    assert d.desired_replicas == 2


def test_min_zero_scales_to_zero_and_back() -> None:
    cfg = AutoscaleConfig(
        min_replicas=0, max_replicas=4, target_gpu_util_pct=None,
        stable_window_s=1.0, panic_window_s=1.0, scale_down_delay_s=5.0,
    )  # fmt: skip
    decisions, state = walk(cfg, lambda t: 0.0, range(0, 6), current=1)
    assert [d.desired_replicas for d in decisions] == [1, 1, 1, 1, 1, 0]
    d, _ = tick(6, 3.0, 0, state, cfg)
    assert d.desired_replicas == 1


# ----------------------------------------------------------------- utilization


def test_util_drives_scale_up_when_concurrency_does_not() -> None:
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=8, target_gpu_util_pct=80.0)
    state = AutoscaleState()
    # 8 ongoing -> 1 replica by concurrency; 2 replicas at 100 % vs 80 % -> ceil(2.5) = 3.
    d, state = tick(0, 8.0, 2, state, cfg, util=100.0)
    assert (d.desired_replicas, d.stable_desired, d.mode) == (3, 3, "stable")
    # Util at target: holds the current count, no scale-down streak.
    d, state = tick(1, 8.0, 2, AutoscaleState(), cfg, util=80.0)
    assert (d.desired_replicas, state.below_since_s) == (2, None)


def test_absent_util_is_ignored_not_zero() -> None:
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=8, target_gpu_util_pct=80.0)
    # No util at all: concurrency alone (1 replica wanted, streak starts).
    d, state = tick(0, 8.0, 2, AutoscaleState(), cfg, util=None)
    assert (d.stable_desired, state.below_since_s) == (1, 0)
    # Mixed: the average is over the samples that carry util (100, 100), not (100, 0, 100).
    state = AutoscaleState()
    for t, util in ((0, 100.0), (1, None), (2, 100.0)):
        d, state = tick(t, 8.0, 2, state, cfg, util=util)
    assert d.stable_desired == 3
    # Disabled by config: util never counts.
    d, _ = tick(0, 8.0, 2, AutoscaleState(), CFG, util=100.0)
    assert d.stable_desired == 1


def test_util_does_not_trigger_panic() -> None:
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=8, target_gpu_util_pct=80.0)
    # One replica at 100 %: util wants ceil(1.25) = 2 = 2x current, but panic is
    # about request bursts only.
    d, state = tick(0, 4.0, 1, AutoscaleState(), cfg, util=100.0)
    assert (d.mode, d.desired_replicas, d.panic_desired) == ("stable", 2, 1)
    assert state.panic_until_s is None


# ----------------------------------------------------------------- sample window


def test_samples_trimmed_to_the_stable_window() -> None:
    _, state = walk(CFG, lambda t: 8.0, range(0, 200), current=1)
    times = [s.t_s for s in state.samples]
    assert len(times) == 60
    assert times[0] == 140 and times[-1] == 199  # window (139, 199]


def test_samples_bounded_by_max_samples() -> None:
    cfg = AutoscaleConfig(target_gpu_util_pct=None, max_samples=10)
    state = AutoscaleState()
    for i in range(1000):  # ten ticks per second: 600 would fit the window
        _, state = decide(AutoscaleSample(t_s=i / 10, ongoing_requests=8.0), 1, state, cfg)
        assert len(state.samples) <= 10
    assert len(state.samples) == 10
    assert state.samples[-1].t_s == 99.9


def test_old_burst_leaves_the_window() -> None:
    # A burst at t=0 only counts while it is inside the 60 s stable window.
    d, state = tick(0, 80.0, 10, AutoscaleState(), CFG)
    for t in range(1, 61):
        d, state = tick(t, 0.0, 10, state, CFG)
        # ceil(80 / (t + 1) / 8) while the t=0 sample is in (t - 60, t].
        assert d.stable_desired == (-(-10 // (t + 1)) if t < 60 else 0), t


def test_samples_from_the_future_are_dropped() -> None:
    _, state = tick(1000, 800.0, 1, AutoscaleState(), CFG)
    d, state = tick(5, 8.0, 1, state, CFG)  # clock went backwards
    assert [s.t_s for s in state.samples] == [5]
    assert d.stable_desired == 1
    # A panic deadline further away than one stable window is from the old clock.
    assert (d.mode, d.desired_replicas, state.panic_until_s) == ("stable", 1, None)


# ----------------------------------------------------------------- fallback and config


def test_queue_length_fallback() -> None:
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=4)
    assert queue_length_fallback(0.0, 1, cfg) == 1
    assert queue_length_fallback(17.0, 1, cfg) == 3
    assert queue_length_fallback(16.0, 1, cfg) == 2
    assert queue_length_fallback(1000.0, 1, cfg) == 4
    # Stateless, so it never scales down on its own…
    assert queue_length_fallback(0.0, 3, cfg) == 3
    # …but still clamps a current count above max.
    assert queue_length_fallback(0.0, 9, cfg) == 4
    with pytest.raises(ValueError, match="total_requests"):
        queue_length_fallback(-1.0, 1, cfg)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_replicas": -1}, "min_replicas"),
        ({"max_replicas": 0}, "max_replicas"),
        ({"min_replicas": 5, "max_replicas": 4}, "min_replicas"),
        ({"target_ongoing_requests": 0.0}, "target_ongoing_requests"),
        ({"target_gpu_util_pct": 0.0}, "target_gpu_util_pct"),
        ({"target_gpu_util_pct": 120.0}, "target_gpu_util_pct"),
        ({"stable_window_s": 0.0}, "stable_window_s"),
        ({"panic_window_s": 0.0}, "panic_window_s"),
        ({"panic_window_s": 61.0}, "panic_window_s"),
        ({"panic_threshold_ratio": 0.5}, "panic_threshold_ratio"),
        ({"scale_down_delay_s": -1.0}, "scale_down_delay_s"),
        ({"max_scale_down_step": 0}, "max_scale_down_step"),
        ({"max_samples": 0}, "max_samples"),
        ({"min_replicas": True}, "min_replicas"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        AutoscaleConfig(**kwargs)


def test_sample_and_state_validation() -> None:
    with pytest.raises(ValueError, match="ongoing_requests"):
        AutoscaleSample(t_s=0.0, ongoing_requests=-1.0)
    with pytest.raises(ValueError, match="t_s"):
        AutoscaleSample(t_s=float("inf"), ongoing_requests=0.0)
    with pytest.raises(ValueError, match="gpu_util_pct"):
        AutoscaleSample(t_s=0.0, ongoing_requests=0.0, gpu_util_pct=float("nan"))
    with pytest.raises(ValueError, match="current_replicas"):
        decide(AutoscaleSample(t_s=0.0, ongoing_requests=0.0), -1, AutoscaleState(), CFG)
    with pytest.raises(ValueError, match="last_desired"):
        AutoscaleState(last_desired=-2)


def test_panic_never_desires_fewer_than_stable() -> None:
    # Knative's max(stable, panic). A burst of 72 ongoing on 4 replicas triggers
    # panic (9 >= 2 x 4). The work needs 9.6 GPUs' worth at 100 % (util is
    # 960 / replicas %, capped at 100): at 9 replicas the GPUs are saturated and
    # stable mode asks ceil(9 x 100 / 80) = 12, while the panic window,
    # concurrency only, still says 9. The old code held 9 for the whole 60 s
    # panic; the decision must be at least 12 from the first held tick on.
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=16, target_gpu_util_pct=80.0)

    def util(replicas: int) -> float:
        return min(100.0, 960.0 / replicas)

    d, state = tick(0, 72.0, 4, AutoscaleState(), cfg, util=util(4))
    assert (d.mode, d.panic_desired, d.stable_desired, d.desired_replicas) == ("panic", 9, 9, 9)
    current = d.desired_replicas
    d, state = tick(1, 72.0, current, state, cfg, util=util(current))
    assert (d.mode, d.panic_desired, d.stable_desired, d.desired_replicas) == ("panic", 9, 12, 12)
    current = d.desired_replicas
    for t in range(2, 60):
        d, state = tick(t, 72.0, current, state, cfg, util=util(current))
        # The panic window still says 9; the decision follows stable (the 60 s
        # util average lags, so stable may ask more than 12), never the 9.
        assert (d.mode, d.panic_desired) == ("panic", 9), t
        assert d.desired_replicas >= cfg.clamp(max(d.stable_desired, 12)), t
        current = d.desired_replicas
    # Panic ends a stable window after its trigger; stable mode does not go back to 9.
    d, state = tick(60, 72.0, current, state, cfg, util=util(current))
    assert d.mode == "stable"
    assert d.desired_replicas >= 12
